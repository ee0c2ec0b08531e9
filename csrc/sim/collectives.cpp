// "simccl": the sim device's process-group backend, gloo under explicit host staging copies, with
// NCCL's communicator semantics.
//
// Every collective snapshots its device inputs into host buffers when issued (the point on the
// caller's stream it waits for), and is queued on its device's communicator queue: one collective
// kernel runs at a time per device (the worst case NCCL allows), in issue order, on a worker thread
// that runs gloo on the host buffers and writes the results back into the device tensors. Until the
// host calls work.wait() (or sees isCompleted(), or synchronizes the device) the output is "in
// flight": any kernel or copy touching it raises, naming the collective and where it was issued.
//
// Two ranks that issue two groups' collectives in opposite orders deadlock here as on NCCL; a
// collective that has waited OMNITRON_SIM_DEADLOCK_S seconds (default 60) for its peers while another
// waits behind it is reported on its rank, naming both. A collective issued while another thread's
// collective is still queued on the device is an error (ranks may order the two differently).
// Barriers are queued like collectives. Point-to-point operations are not (a batched send/recv pair would
// otherwise deadlock, which NCCL avoids by fusing the batch into one kernel); their outputs are checked alike,
// and an unbatched one takes its place in its pair's order (pair_order.cpp): batch_isend_irecv coalesces here.
#include "comm.h"
#include "compat.h"
#include "sim.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <map>
#include <numeric>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

namespace sim {
namespace {

using Tensors = std::vector<at::Tensor>;
using SteadyClock = std::chrono::steady_clock;
constexpr std::chrono::milliseconds kNoTimeout{0};  // c10d's "no timeout"

at::Tensor stage_in(const at::Tensor& t) {
  return t.is_privateuseone() ? host_copy(t).contiguous() : t;
}

at::Tensor stage_out(const at::Tensor& t) {
  return t.is_privateuseone() ? at::empty(t.sizes(), t.options().device(c10::kCPU)) : t;
}

// NCCL's tensor rule (ProcessGroupNCCL's checks, before any work): a collective's single tensor must be contiguous
// in its suggested memory format, each tensor of a list non-overlapping and dense; point-to-point only warns.
// gloo takes any layout, so without this a strided view passes here and fails on the GPU.
enum class Layout { contiguous, dense };

void require_layout(const char* op, const at::Tensor& t, Layout rule) {
  if (!t.is_privateuseone()) return;
  bool single = rule == Layout::contiguous;
  bool ok = single ? t.is_contiguous(t.suggest_memory_format()) : t.is_non_overlapping_and_dense();
  TORCH_CHECK_VALUE(ok, "sim: ", op, " was given a ", single ? "non-contiguous" : "non-dense", " tensor (sizes ",
                    t.sizes(), ", strides ", t.strides(), "), which NCCL refuses (\"Tensors must be ",
                    single ? "contiguous" : "non-overlapping and dense", "\"): pass a .contiguous() copy");
}

void require_layout(const char* op, const Tensors& ts, Layout rule) {
  for (const auto& t : ts) require_layout(op, t, rule);
}

void require_layout(const char* op, const std::vector<Tensors>& tss, Layout rule) {
  for (const auto& ts : tss) require_layout(op, ts, rule);
}

// NCCL's point-to-point moves numel() elements from a tensor's first byte whatever its strides (it only warns): a
// dense tensor in another layout travels in memory order, so send and receive see the same bytes as on the GPU; a
// tensor with gaps would move bytes that are not its elements, so it is refused here.
Tensors p2p_views(const char* op, const Tensors& ts) {
  Tensors views;
  for (const auto& t : ts) {
    if (!t.is_privateuseone() || t.is_contiguous()) {
      views.push_back(t);
      continue;
    }
    TORCH_CHECK_VALUE(t.is_non_overlapping_and_dense(), "sim: ", op, " was given a tensor with gaps (sizes ", t.sizes(),
                      ", strides ", t.strides(), "): NCCL moves numel() elements from its first byte, which are not "
                      "its elements; pass a .contiguous() tensor");
    views.push_back(t.as_strided({t.numel()}, {1}));
  }
  return views;
}

// all_gather_into_tensor's output and reduce_scatter_tensor's input may be the ranks' parts stacked (world, *part)
// as well as concatenated along dim 0 (torch's documented forms; NCCL checks only numel); gloo takes the
// concatenation, so a stacked host buffer is handed over as that view of itself.
at::Tensor as_concatenation(const at::Tensor& whole, const at::Tensor& part, int64_t world) {
  if (part.dim() == 0 || whole.numel() != part.numel() * world) return whole;  // gloo names a size mismatch
  std::vector<int64_t> shape(part.sizes().begin(), part.sizes().end());
  shape[0] *= world;
  return whole.view(shape);
}

// all_to_all's per-rank lengths differ when the splits are uneven (MoE dispatch): strict mode compares the rest.
std::string rows_fingerprint(const at::Tensor& t) {
  std::ostringstream os;
  os << "shape=[*";
  for (int64_t d = 1; d < t.dim(); ++d) os << ", " << t.size(d);
  os << "] dtype=" << t.scalar_type();
  return os.str();
}

// Host buffers of one collective and the device tensors they are copied back into.
struct Staging {
  std::vector<std::pair<at::Tensor, at::Tensor>> back;  // (device, host)
  std::vector<std::pair<at::Tensor, Use>> uses;         // the device tensors, as the collective's kernel uses them
  c10::DeviceIndex device = -1;

  at::Tensor in(const at::Tensor& t, bool write_back = false) { return host(t, stage_in(t), write_back); }
  at::Tensor out(const at::Tensor& t) { return host(t, stage_out(t), true); }
  Tensors in(const Tensors& ts, bool write_back = false) {
    Tensors h;
    for (const auto& t : ts) h.push_back(in(t, write_back));
    return h;
  }
  Tensors out(const Tensors& ts) {
    Tensors h;
    for (const auto& t : ts) h.push_back(out(t));
    return h;
  }
  std::vector<Tensors> in(const std::vector<Tensors>& tss) {
    std::vector<Tensors> h;
    for (const auto& ts : tss) h.push_back(in(ts));
    return h;
  }
  std::vector<Tensors> out(const std::vector<Tensors>& tss) {
    std::vector<Tensors> h;
    for (const auto& ts : tss) h.push_back(out(ts));
    return h;
  }
  at::Tensor host(const at::Tensor& dev, at::Tensor h, bool write_back) {
    if (dev.is_privateuseone()) {
      check_not_in_flight(dev, "a collective");
      if (device < 0) device = dev.device().index();
      uses.emplace_back(dev, write_back ? Use::write : Use::read);
    }
    if (write_back && dev.is_privateuseone()) back.emplace_back(dev, h);
    return h;
  }
};

// ---- where and from which thread a collective was issued (a Python hook) ----------------------
std::mutex g_site_mutex;
std::function<Site()> g_site_hook;

}  // namespace

Site python_site_full() {
  std::function<Site()> hook;
  {
    std::lock_guard<std::mutex> lock(g_site_mutex);
    hook = g_site_hook;
  }
  return hook ? hook() : Site{};
}

std::pair<std::string, std::string> python_site() {
  Site site = python_site_full();
  return {site.where, site.thread};
}

namespace {

// ---- one collective -----------------------------------------------------------------------------
struct Span {
  uintptr_t lo, hi;
};

Span span_of(const at::Tensor& t) {
  auto lo = reinterpret_cast<uintptr_t>(t.data_ptr());
  int64_t extent = 1;
  for (int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * t.stride(d);
  return {lo, lo + static_cast<uintptr_t>(extent * t.element_size())};
}

struct Item {
  std::string op, group, site, thread;
  std::function<c10::intrusive_ptr<c10d::Work>()> launch;
  int64_t record = -1;                     // its flight record (comm_check.cpp)
  c10::intrusive_ptr<c10d::Backend> gloo;  // strict mode: exchange ``key`` on it before launching
  std::string key;
  std::function<std::string()> on_settle;  // p2p receive: the order check, once it completed ("" = fine)
  std::function<std::string()> early_check;  // the same check before, once the send was issued ("" = fine)
  std::vector<std::pair<at::Tensor, at::Tensor>> back;
  std::vector<Span> spans;
  c10::intrusive_ptr<c10d::Work> inner;  // p2p: launched at once
  std::string pair_key;                   // unbatched p2p issued before the peer's counterpart (pair_order.cpp)
  c10::intrusive_ptr<c10d::Store> pair_store;
  bool done = false, released = false;
  std::string error;
  void* event = nullptr;  // recorded on the communicator stream after its kernel: what wait() orders after

  ~Item() { event_destroy(event); }

  std::string describe() const { return op + " on group '" + group + "' (issued at " + site + ", thread " + thread + ")"; }
  void copy_back() {
    InternalCopy internal;
    for (auto& [dev, host] : back) dev.copy_(host);
    back.clear();
  }
};
using ItemPtr = std::shared_ptr<Item>;

// Outputs not yet waited for, across this process.
std::mutex g_flight_mutex;
std::vector<ItemPtr> g_flight;
std::atomic<int> g_flight_count{0};

void register_flight(const ItemPtr& item) {
  for (auto& [dev, host] : item->back)
    if (dev.numel()) item->spans.push_back(span_of(dev));
  if (item->spans.empty()) return;
  std::lock_guard<std::mutex> lock(g_flight_mutex);
  g_flight.push_back(item);
  g_flight_count.store(static_cast<int>(g_flight.size()));
}

void release_flight(const ItemPtr& item) {
  std::lock_guard<std::mutex> lock(g_flight_mutex);
  if (item->released) return;
  item->released = true;
  for (size_t i = 0; i < g_flight.size(); ++i) {
    if (g_flight[i] != item) continue;
    g_flight.erase(g_flight.begin() + static_cast<std::ptrdiff_t>(i));
    break;
  }
  g_flight_count.store(static_cast<int>(g_flight.size()));
}

// ---- the communicator queue of one device ----------------------------------------------------------
std::chrono::milliseconds deadlock_bound() {
  static const int64_t ms = [] {
    const char* s = std::getenv("OMNITRON_SIM_DEADLOCK_S");
    return static_cast<int64_t>((s ? std::atof(s) : 60.0) * 1000);
  }();
  return std::chrono::milliseconds(ms);
}

struct Queue {
  std::mutex m;
  std::condition_variable cv;
  std::deque<ItemPtr> items;  // front: the collective running; the rest wait behind it
  std::thread worker, watchdog;  // started by the first collective, joined by stop_collective_workers()
  bool stop = false;
  std::string broken;
  SteadyClock::time_point started_at;  // when the running collective was launched
};
// Never destroyed: a static destructor running at exit would destroy a condition variable a thread waits on.
Queue* const g_queues = new Queue[kMaxDevices];

void finish(Queue& q, const ItemPtr& item, const std::string& error) {
  {
    std::lock_guard<std::mutex> lock(q.m);
    if (item->done) return;  // already failed by the deadlock report
  }
  if (error.empty()) item->copy_back();
  record_finish(item->record, error);
  std::lock_guard<std::mutex> lock(q.m);
  item->error = error;
  item->done = true;
  if (!q.items.empty() && q.items.front() == item) q.items.pop_front();
  q.cv.notify_all();
}

// Mark the communicator broken with ``message`` and fail what is queued (lock held), as an aborted NCCL
// communicator does: every later collective on the device raises it.
void abort_queue(Queue& q, const std::string& message) {
  q.broken = message;
  for (auto& item : q.items) {
    item->error = q.broken;
    item->done = true;
    record_finish(item->record, q.broken);
  }
  q.items.clear();
  q.cv.notify_all();
}

// Report a deadlock (lock held): the running collective waits for peers stuck behind their own.
// Fails every queued collective and every later one (the communicator is aborted, as NCCL's would be).
void report_deadlock(Queue& q, int index, SteadyClock::duration waited) {
  std::ostringstream os;
  auto s = std::chrono::duration_cast<std::chrono::seconds>(waited).count();
  os << "sim: collective deadlock on sim:" << index << ": " << q.items[0]->describe() << " has waited " << s
     << " s for its peers while " << q.items[1]->describe()
     << " waits behind it (a device runs one communicator kernel at a time, as NCCL may): every rank must issue "
        "collectives on different groups in the same order, from one thread";
  abort_queue(q, os.str());
}

// Runs one collective to completion. gloo's work completes only when waited on (some of its
// collectives are lazy), so the worker blocks in wait() and the watchdog looks for deadlocks.
void run_one(Queue& q, const ItemPtr& item) {
  {
    std::lock_guard<std::mutex> lock(q.m);
    q.started_at = SteadyClock::now();
  }
  std::string error;
  try {
    if (item->gloo) error = exchange_fingerprints(*item->gloo, item->group, item->key, item->site);
    if (error.empty()) item->launch()->wait();
  } catch (const std::exception& e) {
    error = e.what();
  }
  finish(q, item, error);
}

void worker(int index) {
  Queue& q = g_queues[index];
  for (;;) {
    ItemPtr item;
    {
      std::unique_lock<std::mutex> lock(q.m);
      q.cv.wait(lock, [&] { return !q.items.empty() || q.stop; });
      if (q.items.empty()) return;  // stopped with nothing queued
      item = q.items.front();
    }
    run_one(q, item);
  }
}

// Groups this process sent point-to-point on: a receiver that finds the order broken leaves its report under
// ``key`` in the group's store, and the sender's watchdog aborts the sender's communicator with it.
struct P2PWatch {
  const void* owner;
  c10::intrusive_ptr<c10d::Store> store;
  std::string key;
  int device;
};
std::mutex g_watch_mutex;
std::vector<P2PWatch> g_watches;

void poll_p2p_reports(Queue& q, int index) {
  std::vector<P2PWatch> watches;
  {
    std::lock_guard<std::mutex> lock(g_watch_mutex);
    for (const auto& w : g_watches)
      if (w.device == index) watches.push_back(w);
  }
  for (const auto& w : watches) {
    try {
      if (!w.store->check({w.key})) continue;
      auto raw = w.store->get(w.key);
      w.store->deleteKey(w.key);
      std::lock_guard<std::mutex> lock(q.m);
      if (q.broken.empty()) abort_queue(q, std::string(raw.begin(), raw.end()));
    } catch (const std::exception&) {  // the store is gone: the job is ending
    }
  }
}

void watchdog(int index) {
  Queue& q = g_queues[index];
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(q.m);
      if (q.cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return q.stop; })) return;
      auto waited = SteadyClock::now() - q.started_at;
      if (q.broken.empty() && q.items.size() > 1 && waited > deadlock_bound()) report_deadlock(q, index, waited);
    }
    poll_p2p_reports(q, index);
  }
}

void start_threads(Queue& q, int index) {  // lock held
  if (!q.worker.joinable()) {
    q.worker = std::thread(worker, index);
    q.watchdog = std::thread(watchdog, index);
  }
}

void enqueue(int index, const ItemPtr& item) {
  Queue& q = g_queues[index];
  std::lock_guard<std::mutex> lock(q.m);
  TORCH_CHECK(q.broken.empty(), q.broken);
  for (auto& other : q.items)
    TORCH_CHECK(other->thread == item->thread, "sim: ", item->describe(), " was issued while ", other->describe(),
                " is still queued on sim:", index,
                ": collectives issued from two threads at once reach the device in an order that can differ between "
                "ranks, which deadlocks NCCL; issue them from one thread, or use a gloo (CPU) group in the other");
  q.items.push_back(item);
  start_threads(q, index);
  q.cv.notify_all();
}

// Stop and join one device's communicator threads once what is queued has run. A collective still
// running after the deadlock bound (its peers never came) cannot be interrupted: its threads are
// detached then, and the communicator is marked broken, as an aborted NCCL communicator is.
void stop_queue(Queue& q) {
  std::thread w, d;
  bool drained;
  {
    std::unique_lock<std::mutex> lock(q.m);
    if (!q.worker.joinable()) return;
    drained = q.cv.wait_for(lock, deadlock_bound(), [&] { return q.items.empty(); });
    if (!drained && q.broken.empty()) q.broken = "sim: the communicator was shut down while " + q.items.front()->describe() + " was still running";
    q.stop = true;
    q.cv.notify_all();
    w = std::move(q.worker);
    d = std::move(q.watchdog);
  }
  d.join();
  if (drained) w.join(); else w.detach();
  std::lock_guard<std::mutex> lock(q.m);
  q.stop = false;  // a later collective starts new threads
}

std::atomic<int> g_live_communicators{0};  // SimCollectives not yet shut down or destroyed
std::atomic<int> g_next_comm_stream{0};

class SimWork final : public c10d::Work {
 public:
  explicit SimWork(ItemPtr item) : item_(std::move(item)) {}
  bool wait(std::chrono::milliseconds timeout) override {
    bool ok = true;
    if (item_->inner) {
      await_pair(timeout);
      if (!settled()) ok = item_->inner->wait(timeout);  // a gloo work waited twice waits for another message
      settle_inner();
    } else {
      Queue& q = queue_of();
      std::unique_lock<std::mutex> lock(q.m);
      auto done = [&] { return item_->done; };
      if (timeout == kNoTimeout) {
        q.cv.wait(lock, done);
      } else {  // a bounded wait (strict mode's) reports a deadlock its own way: say "timed out"
        TORCH_CHECK(q.cv.wait_for(lock, timeout, done), "sim: ", item_->describe(), " timed out after ",
                    timeout.count(), " ms waiting for its peers");
      }
    }
    release_flight(item_);
    record_wait(item_->record);
    TORCH_CHECK(item_->error.empty(), item_->error);
    event_block(item_->event, current_stream(device));  // as NCCL's: the current stream waits, the host need not
    return ok;
  }
  bool isCompleted() override {
    bool done;
    if (item_->inner) {
      done = item_->inner->isCompleted();
      if (done) settle_inner();
    } else {
      std::lock_guard<std::mutex> lock(queue_of().m);
      done = item_->done;
    }
    if (done) {
      release_flight(item_);
      record_wait(item_->record);
      event_query(item_->event);  // the host has seen the communicator stream reach it
    }
    return done;
  }
  bool isSuccess() const override { return item_->error.empty(); }
  std::vector<at::Tensor> result() override {
    std::vector<at::Tensor> out;
    for (auto& [dev, host] : item_->back) out.push_back(dev);
    return out;
  }

  int device = 0;

 private:
  Queue& queue_of() { return g_queues[device]; }
  bool settled() {
    std::lock_guard<std::mutex> lock(mutex_);
    return item_->done;
  }
  // Issued before the peer's operation at the same place of the pair's order: block in gloo only once the peer
  // issued a matching one, so a deadlock the peer finds fails this rank too, with the peer's report.
  void await_pair(std::chrono::milliseconds timeout) {
    std::string key;
    std::swap(key, item_->pair_key);
    if (key.empty()) return;
    Queue& q = queue_of();
    auto broken = [&q, this] {
      {
        std::lock_guard<std::mutex> lock(q.m);
        if (!q.broken.empty()) return q.broken;
      }
      return item_->early_check ? item_->early_check() : std::string();
    };
    std::string report = await_pair_place(*item_->pair_store, key, timeout == kNoTimeout ? deadlock_bound() : timeout,
                                          broken);
    if (report.empty()) return;
    release_flight(item_);
    TORCH_CHECK(false, report);
  }
  void settle_inner() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (item_->done) return;
    if (item_->on_settle) item_->error = item_->on_settle();
    if (item_->error.empty()) item_->copy_back();
    item_->done = true;
    record_finish(item_->record, item_->error);
  }
  ItemPtr item_;
  std::mutex mutex_;
};

std::string group_name(const c10d::Backend& b) {
  const std::string& desc = b.getGroupDesc();
  const std::string& uid = b.getGroupUid();
  if (desc.empty() || desc == "undefined") return uid;
  return desc + " " + uid;
}

template <typename Options>
bool async_of(const Options& o) {
#if SIM_OPTIONS_HAVE_ASYNC_OP
  return o.asyncOp;
#else
  (void)o;
  return true;
#endif
}

// Send and receive counters of one communicator, per (peer, tag): gloo and NCCL match the n-th send to a peer
// with the n-th receive from it.
using PeerTag = std::pair<int, int>;

class SimCollectives final : public c10d::Backend {
 public:
  SimCollectives(c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<c10d::Backend> gloo, bool sync_returns_none)
      : c10d::Backend(gloo->getRank(), gloo->getSize()),
        store_(std::move(store)),
        gloo_(std::move(gloo)),
        sync_returns_none_(sync_returns_none),
        comm_stream_(kFirstComm + g_next_comm_stream.fetch_add(1) % kCommStreams) {
    g_live_communicators.fetch_add(1);
  }
  ~SimCollectives() override { release(); }

  const std::string getBackendName() const override { return "simccl"; }

  // destroy_process_group calls this on every group: the last communicator to go joins the device threads.
  void shutdown() override {
    release();
    gloo_->shutdown();
  }

  c10::intrusive_ptr<c10d::Work> broadcast(Tensors& ts, const c10d::BroadcastOptions& o) override {
    require_layout("broadcast", ts, Layout::contiguous);
    Staging s;
    auto h = s.in(ts, true);
    return settle(submit("broadcast", fingerprint(ts, "root=" + std::to_string(o.rootRank)), s,
                         [g = gloo_, h, o]() mutable { return g->broadcast(h, o); }), async_of(o));
  }
  c10::intrusive_ptr<c10d::Work> allreduce(Tensors& ts, const c10d::AllreduceOptions& o) override {
    require_layout("all_reduce", ts, Layout::contiguous);
    Staging s;
    auto h = s.in(ts, true);
    return settle(submit("all_reduce", fingerprint(ts, reduce_name(o.reduceOp)), s,
                         [g = gloo_, h, o]() mutable { return g->allreduce(h, o); }), async_of(o));
  }
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(Tensors& ts, const c10d::AllreduceCoalescedOptions& o) override {
    require_layout("all_reduce_coalesced", ts, Layout::dense);
    Staging s;
    auto h = s.in(ts, true);
    return submit("all_reduce_coalesced", fingerprint(ts, reduce_name(o.reduceOp)), s,
                  [g = gloo_, h, o]() mutable { return g->allreduce_coalesced(h, o); });
  }
  c10::intrusive_ptr<c10d::Work> reduce(Tensors& ts, const c10d::ReduceOptions& o) override {
    require_layout("reduce", ts, Layout::contiguous);
    Staging s;
    auto h = s.in(ts, true);
    return settle(submit("reduce", fingerprint(ts, reduce_name(o.reduceOp) + " root=" + std::to_string(o.rootRank)), s,
                         [g = gloo_, h, o]() mutable { return g->reduce(h, o); }), async_of(o));
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<Tensors>& outs, Tensors& ins,
                                           const c10d::AllgatherOptions& o) override {
    require_layout("all_gather", ins, Layout::contiguous);
    require_layout("all_gather", outs, Layout::dense);
    Staging s;
    auto hi = s.in(ins);
    auto ho = s.out(outs);
    return settle(submit("all_gather", fingerprint(ins), s,
                         [g = gloo_, ho, hi, o]() mutable { return g->allgather(ho, hi, o); }), async_of(o));
  }
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions& o) override {
    require_layout("all_gather_into_tensor", in, Layout::contiguous);
    require_layout("all_gather_into_tensor", out, Layout::contiguous);
    Staging s;
    auto hi = s.in(in);
    auto ho = as_concatenation(s.out(out), hi, getSize());
    return settle(submit("all_gather_into_tensor", fingerprint({in}), s,
                         [g = gloo_, ho, hi, o]() mutable { return g->_allgather_base(ho, hi, o); }), async_of(o));
  }
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(Tensors& outs, Tensors& ins,
                                                                 const c10d::AllgatherOptions& o) override {
    require_layout("all_gather_into_tensor_coalesced", ins, Layout::dense);
    require_layout("all_gather_into_tensor_coalesced", outs, Layout::dense);
    Staging s;
    auto hi = s.in(ins);
    auto ho = s.out(outs);
    return submit("all_gather_into_tensor_coalesced", fingerprint(ins), s,
                  [g = gloo_, ho, hi, o]() mutable { return g->allgather_into_tensor_coalesced(ho, hi, o); });
  }
  c10::intrusive_ptr<c10d::Work> gather(std::vector<Tensors>& outs, Tensors& ins,
                                        const c10d::GatherOptions& o) override {
    require_layout("gather", ins, Layout::contiguous);
    require_layout("gather", outs, Layout::dense);
    Staging s;
    auto hi = s.in(ins);
    auto ho = s.out(outs);
    return settle(submit("gather", fingerprint(ins, "root=" + std::to_string(o.rootRank)), s,
                         [g = gloo_, ho, hi, o]() mutable { return g->gather(ho, hi, o); }), async_of(o));
  }
  c10::intrusive_ptr<c10d::Work> scatter(Tensors& outs, std::vector<Tensors>& ins,
                                         const c10d::ScatterOptions& o) override {
    require_layout("scatter", outs, Layout::contiguous);
    require_layout("scatter", ins, Layout::dense);
    Staging s;
    auto hi = s.in(ins);
    auto ho = s.out(outs);
    return settle(submit("scatter", fingerprint(outs, "root=" + std::to_string(o.rootRank)), s,
                         [g = gloo_, ho, hi, o]() mutable { return g->scatter(ho, hi, o); }), async_of(o));
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(Tensors& outs, std::vector<Tensors>& ins,
                                                const c10d::ReduceScatterOptions& o) override {
    require_layout("reduce_scatter", outs, Layout::contiguous);
    require_layout("reduce_scatter", ins, Layout::dense);
    Staging s;
    auto hi = s.in(ins);
    auto ho = s.out(outs);
    return settle(submit("reduce_scatter", fingerprint(outs, reduce_name(o.reduceOp)), s,
                         [g = gloo_, ho, hi, o]() mutable { return g->reduce_scatter(ho, hi, o); }), async_of(o));
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                      const c10d::ReduceScatterOptions& o) override {
    require_layout("reduce_scatter_tensor", in, Layout::contiguous);
    require_layout("reduce_scatter_tensor", out, Layout::contiguous);
    Staging s;
    auto ho = s.out(out);
    auto hi = as_concatenation(s.in(in), ho, getSize());
    return settle(submit("reduce_scatter_tensor", fingerprint({out}, reduce_name(o.reduceOp)), s,
                         [g = gloo_, ho, hi, o]() mutable { return g->_reduce_scatter_base(ho, hi, o); }), async_of(o));
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(Tensors& outs, Tensors& ins,
                                                                 const c10d::ReduceScatterOptions& o) override {
    require_layout("reduce_scatter_tensor_coalesced", ins, Layout::dense);
    require_layout("reduce_scatter_tensor_coalesced", outs, Layout::dense);
    Staging s;
    auto hi = s.in(ins);
    auto ho = s.out(outs);
    return submit("reduce_scatter_tensor_coalesced", fingerprint(outs, reduce_name(o.reduceOp)), s,
                  [g = gloo_, ho, hi, o]() mutable { return g->reduce_scatter_tensor_coalesced(ho, hi, o); });
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                                               std::vector<int64_t>& in_splits,
                                               const c10d::AllToAllOptions& o) override {
    require_layout("all_to_all_single", in, Layout::contiguous);
    require_layout("all_to_all_single", out, Layout::contiguous);
    Staging s;
    auto hi = s.in(in);
    auto ho = s.out(out);
    auto launch = [g = gloo_, ho, hi, out_splits, in_splits, o]() mutable {
      return g->alltoall_base(ho, hi, out_splits, in_splits, o);
    };
    return settle(submit("all_to_all_single", rows_fingerprint(in), s, launch), async_of(o));
  }
  // gloo's list form needs every tensor one size; NCCL's moves each its own (an uneven dispatch): run it as the
  // single-tensor form over one flat host buffer each way, the outputs copied back from views of the received one.
  c10::intrusive_ptr<c10d::Work> alltoall(Tensors& outs, Tensors& ins, const c10d::AllToAllOptions& o) override {
    require_layout("all_to_all", ins, Layout::dense);
    require_layout("all_to_all", outs, Layout::dense);
    TORCH_CHECK_VALUE(!ins.empty() && !outs.empty(), "sim: all_to_all was given an empty tensor list");
    for (const auto* list : {&ins, &outs})
      for (const auto& t : *list)
        TORCH_CHECK_VALUE(t.scalar_type() == ins[0].scalar_type(), "sim: all_to_all was given tensors of types ",
                          ins[0].scalar_type(), " and ", t.scalar_type(),
                          " (NCCL: \"Tensors must have identical type\")");
    Staging s;
    std::vector<int64_t> in_splits, out_splits;
    Tensors flat;
    for (const auto& h : s.in(ins)) {
      flat.push_back(h.reshape({-1}));
      in_splits.push_back(h.numel());
    }
    auto hi = at::cat(flat);
    for (const auto& t : outs) out_splits.push_back(t.numel());
    auto ho = at::empty({std::accumulate(out_splits.begin(), out_splits.end(), int64_t{0})},
                        outs[0].options().device(c10::kCPU));
    int64_t offset = 0;
    for (const auto& t : outs) {
      s.host(t, ho.narrow(0, offset, t.numel()).view(t.sizes()), true);
      offset += t.numel();
    }
    std::string detail = "x" + std::to_string(ins.size()) + " dtype=" + c10::toString(ins[0].scalar_type());
    auto launch = [g = gloo_, ho, hi, out_splits, in_splits, o]() mutable {
      return g->alltoall_base(ho, hi, out_splits, in_splits, o);
    };
    return settle(submit("all_to_all", detail, s, launch), async_of(o));
  }
  c10::intrusive_ptr<c10d::Work> send(Tensors& tensors, int dst, int tag) override {
    Tensors ts = p2p_views("send", tensors);
    Staging s;
    auto hi = s.in(ts);
    std::string detail = fingerprint(ts, "to rank " + std::to_string(dst) + " tag=" + std::to_string(tag));
    return submit("send", detail, s, [g = gloo_, hi, dst, tag]() mutable { return g->send(hi, dst, tag); },
                  Order::send, dst, tag);
  }
  c10::intrusive_ptr<c10d::Work> recv(Tensors& tensors, int src, int tag) override {
    Tensors ts = p2p_views("recv", tensors);
    Staging s;
    auto ho = s.out(ts);
    std::string detail = fingerprint(ts, "from rank " + std::to_string(src) + " tag=" + std::to_string(tag));
    return submit("recv", detail, s, [g = gloo_, ho, src, tag]() mutable { return g->recv(ho, src, tag); },
                  Order::recv, src, tag);
  }
  c10::intrusive_ptr<c10d::Work> recvAnysource(Tensors& tensors, int tag) override {
    Tensors ts = p2p_views("recv", tensors);
    Staging s;
    auto ho = s.out(ts);
    return submit("recv", fingerprint(ts, "from any rank"), s,
                  [g = gloo_, ho, tag]() mutable { return g->recvAnysource(ho, tag); }, Order::none);
  }
  // Queued, fingerprinted and recorded like the collectives (NCCL's barrier is an all-reduce on the communicator).
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& o) override {
    Staging s;
    if (o.device.has_value() && o.device->is_privateuseone() && o.device->has_index()) s.device = o.device->index();
    return settle(submit("barrier", fingerprint({}), s, [g = gloo_, o]() mutable { return g->barrier(o); }),
                  async_of(o));
  }
  // batch_isend_irecv coalesces on a backend that says it can (otherwise it issues each operation unbatched):
  // the operations between start and end are one NCCL group, which progress together (no pair order).
  bool supportsCoalescing() const override { return true; }
  void startCoalescing() override {
    std::lock_guard<std::mutex> lock(p2p_mutex_);
    coalescing_ = true;
    batch_.clear();
  }
  c10::intrusive_ptr<c10d::Work> endCoalescing() override {
    std::lock_guard<std::mutex> lock(p2p_mutex_);
    coalescing_ = false;
    return batch_work(std::move(batch_));
  }
#if SIM_BACKEND_HAS_SET_TIMEOUT
  void setTimeout(std::chrono::milliseconds timeout) override { gloo_->setTimeout(timeout); }
#endif

 private:
  // How an operation is ordered: queued on the device's communicator (a collective), or launched at once
  // with its place among the group's collectives published (send) or checked against the sender's (recv).
  enum class Order { queued, send, recv, none };

  // ``sync_returns_none``: a synchronous call (``async_op=False``) completes before it returns and returns no work,
  // as torch_musa's MCCL does from v2.9.1 ("comm operators in synchronous mode ... return nullptr").
  c10::intrusive_ptr<c10d::Work> settle(c10::intrusive_ptr<c10d::Work> work, bool async_op) {
    if (!sync_returns_none_ || async_op) return work;
    work->wait();
    return {};
  }

  // One operation: queued on its device's communicator, or launched at once (point-to-point).
  template <typename F>
  c10::intrusive_ptr<c10d::Work> submit(const char* op, const std::string& detail, Staging& s, F&& launch,
                                        Order order = Order::queued, int peer = -1, int tag = 0) {
    auto item = std::make_shared<Item>();
    Site site = python_site_full();
    item->op = op;
    item->group = group_name(*this);
    int index = s.device < 0 ? current_device() : s.device;
    run_on_comm_stream(index, op, item, s);
    item->site = site.where;
    item->thread = site.thread;
    item->back = std::move(s.back);
    item->record = record_issue(op, item->group, detail, site);
    auto work = c10::make_intrusive<SimWork>(item);
    work->device = index;
    register_flight(item);  // before the worker can run it (its copy-back consumes item->back)
    {
      std::lock_guard<std::mutex> lock(p2p_mutex_);
      if (coalescing_) batch_.push_back(work);
    }
    try {
      if (order == Order::queued) {
        place(item, detail, site);
        item->launch = std::forward<F>(launch);
        enqueue(index, item);
      } else {
        check_unbroken(index);
        if (order != Order::none) order_p2p(item, order, peer, tag, detail, index);
        if (order != Order::none) order_pair(item, order == Order::send, peer, detail, index);
        item->inner = launch();
      }
    } catch (...) {
      release_flight(item);
      record_finish(item->record, "failed when issued");
      throw;
    }
    return work;
  }

  // The operation's kernel on the communicator stream, which waits for the issuing thread's current stream first
  // (as NCCL's): its accesses are checked against other streams' (race.cpp), then an event marks its end.
  void run_on_comm_stream(int index, const char* op, const ItemPtr& item, const Staging& s) {
    name_comm_stream(index, comm_stream_, item->group);
    Kernel k(index, comm_stream_, comm_kernel(index, comm_stream_), op);
    for (const auto& [t, use] : s.uses) k.use(t, use);
    k.check();
    k.commit();
    event_record(&item->event, c10::Stream(c10::Stream::UNSAFE, c10::Device(kSim, index), comm_stream_));
  }

  // A collective's place on the group: counted for the point-to-point order; in strict mode (and not issued
  // by the engine's collective layer, which checks its own) its fingerprint is exchanged before it runs.
  void place(const ItemPtr& item, const std::string& detail, const Site& site) {
    std::lock_guard<std::mutex> lock(p2p_mutex_);
    ++collectives_;
    last_ = item->describe();
    if (getSize() > 1 && !site.engine && strict_enabled()) {
      item->gloo = gloo_;
      item->key = std::string(item->op) + " #" + std::to_string(++checked_) + " " + detail;
    }
  }

  // A send publishes its place among the group's collectives in the group's store before it is launched; the
  // matching receive compares its own once it completed (the message has arrived, so the key is there).
  void order_p2p(const ItemPtr& item, Order order, int peer, int tag, const std::string& detail, int index) {
    P2PPosition pos;
    int src = order == Order::send ? getRank() : peer, dst = order == Order::send ? peer : getRank();
    std::string key;
    {
      std::lock_guard<std::mutex> lock(p2p_mutex_);
      pos = {collectives_, last_, item->op + " " + detail + " (issued at " + item->site + ")", coalescing_};
      auto& count = (order == Order::send ? sends_ : recvs_)[PeerTag{peer, tag}];
      key = "simccl/p2p/" + std::to_string(src) + ">" + std::to_string(dst) + "/" + std::to_string(tag) + "/" +
            std::to_string(count++);
    }
    if (order == Order::send) {
      watch(index);
      store_->set(key, encode_position(pos));
      return;
    }
    auto compare = [store = store_, key, pos, group = item->group, src, dst](bool settled) {
      if (!settled && !store->check({key})) return std::string();  // the sender has not issued it yet
      auto raw = store->get(key);
      if (settled) store->deleteKey(key);
      std::string report = compare_positions(group, src, dst, std::string(raw.begin(), raw.end()), pos);
      if (!report.empty()) store->set(deadlock_key(src), report);  // the sender's watchdog raises it there
      return report;
    };
    item->on_settle = [compare] { return compare(true); };
    item->early_check = [compare] { return compare(false); };  // while wait() awaits the pair (pair_order.cpp)
  }

  // An unbatched send or receive takes the next place of its pair's order (pair_order.cpp): published there, or
  // compared with the peer's operation at that place; two sends or two receives fail both ranks at once.
  void order_pair(const ItemPtr& item, bool send, int peer, const std::string& detail, int index) {
    int64_t place;
    {
      std::lock_guard<std::mutex> lock(p2p_mutex_);
      if (coalescing_ || peer == getRank()) return;  // a batch's operations progress together (one NCCL group)
      place = pair_places_[peer]++;
    }
    watch(index);  // a deadlock the peer finds reaches this rank's communicator through the watchdog
    std::string key = pair_key(getRank(), peer, place);
    auto claim = claim_pair_place(*store_, key, item->group, getRank(), send,
                                  item->op + " " + detail + " (issued at " + item->site + ")");
    if (claim.first) {
      item->pair_key = key;
      item->pair_store = store_;
    }
    if (claim.report.empty()) return;
    store_->set(deadlock_key(peer), claim.report);  // the peer's watchdog raises it there
    Queue& q = g_queues[index];
    {
      std::lock_guard<std::mutex> lock(q.m);
      if (q.broken.empty()) abort_queue(q, claim.report);
    }
    TORCH_CHECK(false, claim.report);
  }

  static std::string deadlock_key(int rank) { return "simccl/p2p/deadlock/" + std::to_string(rank); }

  void watch(int index) {
    std::lock_guard<std::mutex> lock(g_watch_mutex);
    for (const auto& w : g_watches)
      if (w.owner == this) return;
    g_watches.push_back({this, store_, deadlock_key(getRank()), index});
    Queue& q = g_queues[index];
    std::lock_guard<std::mutex> qlock(q.m);
    start_threads(q, index);
  }

  static void check_unbroken(int index) {
    Queue& q = g_queues[index];
    std::lock_guard<std::mutex> lock(q.m);
    TORCH_CHECK(q.broken.empty(), q.broken);
  }

  void release() {
    if (released_.exchange(true)) return;
    {
      std::lock_guard<std::mutex> lock(g_watch_mutex);
      g_watches.erase(std::remove_if(g_watches.begin(), g_watches.end(), [&](const P2PWatch& w) { return w.owner == this; }),
                      g_watches.end());
    }
    if (g_live_communicators.fetch_sub(1) == 1) stop_collective_workers();
  }

  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Backend> gloo_;
  bool sync_returns_none_;
  int comm_stream_;  // this communicator's stream on each device (race.cpp's detector orders by it)
  std::atomic<bool> released_{false};
  std::mutex p2p_mutex_;
  int64_t collectives_ = 0, checked_ = 0;
  std::string last_;
  std::map<PeerTag, int64_t> sends_, recvs_;
  std::map<int, int64_t> pair_places_;  // unbatched operations issued per peer (NCCL ignores tags)
  bool coalescing_ = false;             // between startCoalescing and endCoalescing
  std::vector<c10::intrusive_ptr<c10d::Work>> batch_;
};

}  // namespace

void check_not_in_flight(const at::Tensor& t, const char* op) {
  if (g_flight_count.load(std::memory_order_relaxed) == 0 || !t.defined() || t.numel() == 0) return;
  Span a = span_of(t);
  std::lock_guard<std::mutex> lock(g_flight_mutex);
  for (const auto& item : g_flight)
    for (const auto& b : item->spans)
      TORCH_CHECK(a.hi <= b.lo || b.hi <= a.lo, "sim: ", op, " touched the output of ", item->describe(),
                  " before its work.wait(): a collective's result is valid only after wait() (or a device synchronize)");
}

void synchronize_collectives() {
  for (int i = 0; i < kMaxDevices; ++i) {
    Queue& q = g_queues[i];
    std::unique_lock<std::mutex> lock(q.m);
    q.cv.wait(lock, [&] { return q.items.empty(); });
  }
  std::vector<ItemPtr> done;
  {
    std::lock_guard<std::mutex> lock(g_flight_mutex);
    for (auto& item : g_flight)
      if (!item->inner) done.push_back(item);
  }
  for (auto& item : done) release_flight(item);
}

void stop_collective_workers() {
  for (int i = 0; i < kMaxDevices; ++i) stop_queue(g_queues[i]);
}

void set_site_hook(std::function<Site()> hook) {
  std::lock_guard<std::mutex> lock(g_site_mutex);
  g_site_hook = std::move(hook);
}

c10::intrusive_ptr<c10d::Backend> collective_backend(c10::intrusive_ptr<c10d::Store> store,
                                                     c10::intrusive_ptr<c10d::Backend> gloo, bool sync_returns_none) {
  return c10::make_intrusive<SimCollectives>(std::move(store), std::move(gloo), sync_returns_none);
}

}  // namespace sim
