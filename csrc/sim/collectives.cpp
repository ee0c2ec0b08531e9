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
// Point-to-point operations and barriers are not queued (a batched send/recv pair would otherwise
// deadlock, which NCCL avoids by fusing the batch into one kernel); their outputs are checked alike.
#include "compat.h"
#include "sim.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

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

// Host buffers of one collective and the device tensors they are copied back into.
struct Staging {
  std::vector<std::pair<at::Tensor, at::Tensor>> back;  // (device, host)
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
    }
    if (write_back && dev.is_privateuseone()) back.emplace_back(dev, h);
    return h;
  }
};

// ---- where and from which thread a collective was issued (a Python hook) ----------------------
std::mutex g_site_mutex;
std::function<std::pair<std::string, std::string>()> g_site_hook;

}  // namespace

std::pair<std::string, std::string> python_site() {
  std::function<std::pair<std::string, std::string>()> hook;
  {
    std::lock_guard<std::mutex> lock(g_site_mutex);
    hook = g_site_hook;
  }
  if (!hook) return {"(unknown site)", "thread"};
  return hook();
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
  std::vector<std::pair<at::Tensor, at::Tensor>> back;
  std::vector<Span> spans;
  c10::intrusive_ptr<c10d::Work> inner;  // p2p: launched at once
  bool done = false, released = false;
  std::string error;

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
  std::lock_guard<std::mutex> lock(q.m);
  item->error = error;
  item->done = true;
  if (!q.items.empty() && q.items.front() == item) q.items.pop_front();
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
  q.broken = os.str();
  for (auto& item : q.items) {
    item->error = q.broken;
    item->done = true;
  }
  q.items.clear();
  q.cv.notify_all();
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
    item->launch()->wait();
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

void watchdog(int index) {
  Queue& q = g_queues[index];
  std::unique_lock<std::mutex> lock(q.m);
  for (;;) {
    if (q.cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return q.stop; })) return;
    auto waited = SteadyClock::now() - q.started_at;
    if (q.broken.empty() && q.items.size() > 1 && waited > deadlock_bound()) report_deadlock(q, index, waited);
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
  if (!q.worker.joinable()) {
    q.worker = std::thread(worker, index);
    q.watchdog = std::thread(watchdog, index);
  }
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

class SimWork final : public c10d::Work {
 public:
  explicit SimWork(ItemPtr item) : item_(std::move(item)) {}
  bool wait(std::chrono::milliseconds timeout) override {
    bool ok = true;
    if (item_->inner) {
      ok = item_->inner->wait(timeout);
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
    TORCH_CHECK(item_->error.empty(), item_->error);
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
    if (done) release_flight(item_);
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
  void settle_inner() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!item_->done) item_->copy_back();
    item_->done = true;
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

class SimCollectives final : public c10d::Backend {
 public:
  SimCollectives(c10::intrusive_ptr<c10d::Backend> gloo, bool sync_returns_none)
      : c10d::Backend(gloo->getRank(), gloo->getSize()), gloo_(std::move(gloo)), sync_returns_none_(sync_returns_none) {
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
    Staging s;
    auto h = s.in(ts, true);
    return settle(submit("broadcast", s, [g = gloo_, h, o]() mutable { return g->broadcast(h, o); }), async_of(o));
  }
  c10::intrusive_ptr<c10d::Work> allreduce(Tensors& ts, const c10d::AllreduceOptions& o) override {
    Staging s;
    auto h = s.in(ts, true);
    return settle(submit("all_reduce", s, [g = gloo_, h, o]() mutable { return g->allreduce(h, o); }), async_of(o));
  }
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(Tensors& ts, const c10d::AllreduceCoalescedOptions& o) override {
    Staging s;
    auto h = s.in(ts, true);
    return submit("all_reduce_coalesced", s, [g = gloo_, h, o]() mutable { return g->allreduce_coalesced(h, o); });
  }
  c10::intrusive_ptr<c10d::Work> reduce(Tensors& ts, const c10d::ReduceOptions& o) override {
    Staging s;
    auto h = s.in(ts, true);
    return settle(submit("reduce", s, [g = gloo_, h, o]() mutable { return g->reduce(h, o); }), async_of(o));
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<Tensors>& outs, Tensors& ins,
                                           const c10d::AllgatherOptions& o) override {
    Staging s;
    auto hi = s.in(ins);
    auto ho = s.out(outs);
    return settle(submit("all_gather", s, [g = gloo_, ho, hi, o]() mutable { return g->allgather(ho, hi, o); }), async_of(o));
  }
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions& o) override {
    Staging s;
    auto hi = s.in(in);
    auto ho = s.out(out);
    return settle(submit("all_gather_into_tensor", s, [g = gloo_, ho, hi, o]() mutable { return g->_allgather_base(ho, hi, o); }), async_of(o));
  }
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(Tensors& outs, Tensors& ins,
                                                                 const c10d::AllgatherOptions& o) override {
    Staging s;
    auto hi = s.in(ins);
    auto ho = s.out(outs);
    return submit("all_gather_into_tensor_coalesced", s,
                  [g = gloo_, ho, hi, o]() mutable { return g->allgather_into_tensor_coalesced(ho, hi, o); });
  }
  c10::intrusive_ptr<c10d::Work> gather(std::vector<Tensors>& outs, Tensors& ins,
                                        const c10d::GatherOptions& o) override {
    Staging s;
    auto hi = s.in(ins);
    auto ho = s.out(outs);
    return settle(submit("gather", s, [g = gloo_, ho, hi, o]() mutable { return g->gather(ho, hi, o); }), async_of(o));
  }
  c10::intrusive_ptr<c10d::Work> scatter(Tensors& outs, std::vector<Tensors>& ins,
                                         const c10d::ScatterOptions& o) override {
    Staging s;
    auto hi = s.in(ins);
    auto ho = s.out(outs);
    return settle(submit("scatter", s, [g = gloo_, ho, hi, o]() mutable { return g->scatter(ho, hi, o); }), async_of(o));
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(Tensors& outs, std::vector<Tensors>& ins,
                                                const c10d::ReduceScatterOptions& o) override {
    Staging s;
    auto hi = s.in(ins);
    auto ho = s.out(outs);
    return settle(submit("reduce_scatter", s, [g = gloo_, ho, hi, o]() mutable { return g->reduce_scatter(ho, hi, o); }), async_of(o));
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                      const c10d::ReduceScatterOptions& o) override {
    Staging s;
    auto hi = s.in(in);
    auto ho = s.out(out);
    return settle(submit("reduce_scatter_tensor", s,
                  [g = gloo_, ho, hi, o]() mutable { return g->_reduce_scatter_base(ho, hi, o); }), async_of(o));
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(Tensors& outs, Tensors& ins,
                                                                 const c10d::ReduceScatterOptions& o) override {
    Staging s;
    auto hi = s.in(ins);
    auto ho = s.out(outs);
    return submit("reduce_scatter_tensor_coalesced", s,
                  [g = gloo_, ho, hi, o]() mutable { return g->reduce_scatter_tensor_coalesced(ho, hi, o); });
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                                               std::vector<int64_t>& in_splits,
                                               const c10d::AllToAllOptions& o) override {
    Staging s;
    auto hi = s.in(in);
    auto ho = s.out(out);
    return settle(submit("all_to_all_single", s, [g = gloo_, ho, hi, out_splits, in_splits, o]() mutable {
      return g->alltoall_base(ho, hi, out_splits, in_splits, o);
    }), async_of(o));
  }
  c10::intrusive_ptr<c10d::Work> alltoall(Tensors& outs, Tensors& ins, const c10d::AllToAllOptions& o) override {
    Staging s;
    auto hi = s.in(ins);
    auto ho = s.out(outs);
    return settle(submit("all_to_all", s, [g = gloo_, ho, hi, o]() mutable { return g->alltoall(ho, hi, o); }), async_of(o));
  }
  c10::intrusive_ptr<c10d::Work> send(Tensors& ts, int dst, int tag) override {
    Staging s;
    auto hi = s.in(ts);
    return submit("send", s, [g = gloo_, hi, dst, tag]() mutable { return g->send(hi, dst, tag); }, false);
  }
  c10::intrusive_ptr<c10d::Work> recv(Tensors& ts, int src, int tag) override {
    Staging s;
    auto ho = s.out(ts);
    return submit("recv", s, [g = gloo_, ho, src, tag]() mutable { return g->recv(ho, src, tag); }, false);
  }
  c10::intrusive_ptr<c10d::Work> recvAnysource(Tensors& ts, int tag) override {
    Staging s;
    auto ho = s.out(ts);
    return submit("recv", s, [g = gloo_, ho, tag]() mutable { return g->recvAnysource(ho, tag); }, false);
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& o) override {
    return settle(gloo_->barrier(o), async_of(o));
  }
#if SIM_BACKEND_HAS_SET_TIMEOUT
  void setTimeout(std::chrono::milliseconds timeout) override { gloo_->setTimeout(timeout); }
#endif

 private:
  // ``sync_returns_none``: a synchronous call (``async_op=False``) completes before it returns and returns no work,
  // as torch_musa's MCCL does from v2.9.1 ("comm operators in synchronous mode ... return nullptr").
  c10::intrusive_ptr<c10d::Work> settle(c10::intrusive_ptr<c10d::Work> work, bool async_op) {
    if (!sync_returns_none_ || async_op) return work;
    work->wait();
    return {};
  }

  // One collective: queued on its device's communicator (``queued``) or launched at once (p2p).
  template <typename F>
  c10::intrusive_ptr<c10d::Work> submit(const char* op, Staging& s, F&& launch, bool queued = true) {
    auto item = std::make_shared<Item>();
    auto site = python_site();
    item->op = op;
    item->group = group_name(*this);
    item->site = site.first;
    item->thread = site.second;
    item->back = std::move(s.back);
    int index = s.device < 0 ? current_device() : s.device;
    auto work = c10::make_intrusive<SimWork>(item);
    work->device = index;
    register_flight(item);  // before the worker can run it (its copy-back consumes item->back)
    try {
      if (queued) {
        item->launch = std::forward<F>(launch);
        enqueue(index, item);
      } else {
        item->inner = launch();
      }
    } catch (...) {
      release_flight(item);
      throw;
    }
    return work;
  }

  void release() {
    if (!released_.exchange(true) && g_live_communicators.fetch_sub(1) == 1) stop_collective_workers();
  }

  c10::intrusive_ptr<c10d::Backend> gloo_;
  bool sync_returns_none_;
  std::atomic<bool> released_{false};
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

void set_site_hook(std::function<std::pair<std::string, std::string>()> hook) {
  std::lock_guard<std::mutex> lock(g_site_mutex);
  g_site_hook = std::move(hook);
}

c10::intrusive_ptr<c10d::Backend> collective_backend(c10::intrusive_ptr<c10d::Backend> gloo, bool sync_returns_none) {
  return c10::make_intrusive<SimCollectives>(std::move(gloo), sync_returns_none);
}

}  // namespace sim
