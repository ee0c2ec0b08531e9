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
#include "comm_queue.h"
#include "compat.h"
#include "sim.h"
#include "staging.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <iostream>
#include <map>
#include <numeric>
#include <sstream>
#include <thread>

namespace sim {
namespace {

std::atomic<int> g_live_communicators{0};  // SimCollectives not yet shut down or destroyed
std::atomic<int> g_next_comm_stream{0};

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
  SimCollectives(c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<c10d::Backend> gloo, bool sync_returns_none,
                 int global_rank, int64_t incarnation)
      : c10d::Backend(gloo->getRank(), gloo->getSize()),
        store_(std::move(store)),
        gloo_(std::move(gloo)),
        sync_returns_none_(sync_returns_none),
        comm_stream_(kFirstComm + g_next_comm_stream.fetch_add(1) % kCommStreams),
        global_rank_(global_rank < 0 ? getRank() : global_rank),
        incarnation_(incarnation) {
    g_live_communicators.fetch_add(1);
    if (getSize() <= 1) return;
    publish_member(*store_, getRank(), global_rank_);  // read by blocked waits' records
    // published stuck when its device breaks, with the count its device completed
    remember_member(this, store_, group(), getRank(), [completed = completed_] { return completed->load(); });
  }
  ~SimCollectives() override {
    std::string report = release();
    if (!report.empty()) std::cerr << report << std::endl;  // a destructor cannot raise: said on stderr
  }

  const std::string getBackendName() const override { return "simccl"; }

  // The group's name, and which of the groups made under that name in this process it is when not the first
  // (new_group(..., use_local_synchronization=True) names a group by its ranks: destroyed and made again, the name
  // repeats; every member counts the same). Names the group in messages and in the records of blocked waits.
  std::string group() const {
    return incarnation_ > 1 ? group_name(*this) + " #" + std::to_string(incarnation_) : group_name(*this);
  }

  // destroy_process_group calls this on every group: the last communicator to go joins the device threads.
  // A cycle the end-of-job check finds (flush_cycles) raises here, once the communicator is released.
  void shutdown() override {
    std::string report = release();
    gloo_->shutdown();
    if (!report.empty()) raise_report(report);
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
    return settle(submit("all_to_all_single", rows_fingerprint(in), s, launch, Order::queued, -1, 0,
                         counts_of(in, in_splits, out, out_splits)), async_of(o));
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
    return settle(submit("all_to_all", detail, s, launch, Order::queued, -1, 0, counts_of(in_splits, out_splits)),
                  async_of(o));
  }
  c10::intrusive_ptr<c10d::Work> send(Tensors& tensors, int dst, int tag) override {
    Tensors ts = p2p_views("send", tensors);
    Staging s;
    auto hi = s.in(ts);
    std::string detail = fingerprint(ts, "to rank " + std::to_string(dst) + " tag=" + std::to_string(tag));
    return submit("send", detail, s, [g = gloo_, hi, dst, tag]() mutable { return g->send(hi, dst, tag); },
                  Order::send, dst, tag, payload_of(ts));
  }
  c10::intrusive_ptr<c10d::Work> recv(Tensors& tensors, int src, int tag) override {
    Tensors ts = p2p_views("recv", tensors);
    Staging s;
    auto ho = s.out(ts);
    std::string detail = fingerprint(ts, "from rank " + std::to_string(src) + " tag=" + std::to_string(tag));
    return submit("recv", detail, s, [g = gloo_, ho, src, tag]() mutable { return g->recv(ho, src, tag); },
                  Order::recv, src, tag, payload_of(ts));
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
    batch_ops_.clear();
    batch_site_.clear();
  }
  // The batch takes its place in the communicator's order of groups (group_order.cpp) before its work returns.
  c10::intrusive_ptr<c10d::Work> endCoalescing() override {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    {
      std::lock_guard<std::mutex> lock(p2p_mutex_);
      coalescing_ = false;
      works = std::move(batch_);
    }
    order_group();
    return batch_work(std::move(works));
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
  // An all_to_all's element counts to and from each rank (``in=a,b out=c,d``), which strict mode pairs across
  // ranks (comm_check.cpp): rank i's count to j must be j's count from i. ``splits`` empty: even rows.
  std::string counts_of(const at::Tensor& in, const std::vector<int64_t>& in_splits, const at::Tensor& out,
                        const std::vector<int64_t>& out_splits) const {
    auto per_peer = [n = getSize()](const at::Tensor& t, const std::vector<int64_t>& splits) {
      int64_t row = t.dim() ? t.numel() / std::max<int64_t>(t.size(0), 1) : 1;
      std::vector<int64_t> out;
      for (int64_t j = 0; j < n; ++j)
        out.push_back(splits.empty() ? (t.dim() ? t.size(0) : 1) / n * row : splits[j] * row);
      return out;
    };
    return counts_of(per_peer(in, in_splits), per_peer(out, out_splits));
  }
  static std::string counts_of(const std::vector<int64_t>& in, const std::vector<int64_t>& out) {
    std::ostringstream os;
    for (size_t j = 0; j < in.size(); ++j) os << (j ? "," : "in=") << in[j];
    for (size_t j = 0; j < out.size(); ++j) os << (j ? "," : " out=") << out[j];
    return os.str();
  }

  // ``agree``: a point-to-point operation's payload (datatype and count), which its partner's must equal; an
  // all_to_all's counts per peer (counts_of), paired across ranks in strict mode.
  template <typename F>
  c10::intrusive_ptr<c10d::Work> submit(const char* op, const std::string& detail, Staging& s, F&& launch,
                                        Order order = Order::queued, int peer = -1, int tag = 0,
                                        const std::string& agree = "") {
    auto item = std::make_shared<Item>();
    Site site = python_site_full();
    item->op = op;
    item->group = group();
    int index = s.device < 0 ? current_device() : s.device;
    run_on_comm_stream(index, op, item, s);
    item->site = site.where;
    item->thread = site.thread;
    item->back = std::move(s.back);
    item->record = record_issue(op, item->group, detail, site);
    auto work = sim_work(item, index);
    register_flight(item);  // before the worker can run it (its copy-back consumes item->back)
    {
      std::lock_guard<std::mutex> lock(p2p_mutex_);
      if (coalescing_) batch_.push_back(work);
    }
    try {
      if (order == Order::queued) {
        place(item, detail, site, agree);
        item->launch = std::forward<F>(launch);
        enqueue(index, item);
      } else {
        check_unbroken(index);
        if (order != Order::none) order_p2p(item, order, peer, tag, detail, index);
        if (order != Order::none) order_pair(item, order == Order::send, peer, tag, agree, detail, index);
        launched(item, index, launch());
        check_unbroken(index);  // aborted since: abort_queue may have missed it
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

  // A collective's place on the group: counted for the point-to-point order; in strict mode its fingerprint is
  // exchanged before it runs, unless the engine's collective layer issued it (that layer checks its own), but for
  // an all_to_all's counts (``counts``), which that layer's check cannot pair (its fingerprint leaves dim 0 free:
  // the MoE dispatcher's and Ulysses' all_to_all_single with split sizes).
  void place(const ItemPtr& item, const std::string& detail, const Site& site, const std::string& counts) {
    std::lock_guard<std::mutex> lock(p2p_mutex_);
    ++collectives_;
    item->completed = completed_;
    last_ = item->describe();
    note_collective_issued(item->group, collectives_);
    if (getSize() > 1)
      item->cwait = std::make_shared<CollectiveWait>(store_, item->group, getRank(), getSize(), global_rank_,
                                                     collectives_, item->describe());
    if (getSize() > 1 && (!site.engine || !counts.empty()) && strict_enabled()) {
      item->gloo = gloo_;
      item->key = std::string(item->op) + " #" + std::to_string(++checked_) + " " + detail;
      if (!counts.empty()) item->key += kCountsMark + counts;  // paired, not compared (exchange_fingerprints)
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
  // compared with the peer's operation at that place; two sends or two receives, or tags or payloads (datatype and
  // count) that differ, fail both ranks at once. A batched one is counted for the group order, and its tag and
  // payload compared with its partner's.
  void order_pair(const ItemPtr& item, bool send, int peer, int tag, const std::string& payload,
                  const std::string& detail, int index) {
    int64_t place;
    bool batched;
    {
      std::lock_guard<std::mutex> lock(p2p_mutex_);
      if (peer == getRank()) return;
      batched = coalescing_;
      if (batched) {  // a batch's operations progress together (one NCCL group): counted for the group order
        auto& [sends, recvs] = batch_ops_[peer];
        ++(send ? sends : recvs);
        if (batch_site_.empty()) batch_site_ = item->site;
        batch_device_ = index;
        place = batched_places_[{peer, send}]++;
      } else {
        place = pair_places_[peer]++;
      }
    }
    watch(index);  // a deadlock the peer finds reaches this rank's communicator through the watchdog
    std::string op = item->op + " " + detail + " (issued at " + item->site + ")";
    std::string key = batched ? batched_key(send ? getRank() : peer, send ? peer : getRank(), place)
                              : pair_key(getRank(), peer, place);
    auto claim = batched ? claim_batched_place(*store_, item->group, getRank(), peer, send, place, tag, payload, op)
                         : claim_pair_place(*store_, key, item->group, getRank(), send, tag, payload, op);
    if (claim.first && !batched) {
      item->pair_key = key;
      item->pair_store = store_;
    }
    if (claim.first) {  // its wait() blocks until the peer posts the counterpart: a cycle of such waits is reported
      item->blocked = std::make_shared<BlockedWait>(store_, item->group, getRank(), peer, key, op);
      item->on_cycle = [store = store_, size = getSize()](const CycleReport& found) {
        if (found.ranks.empty()) return;  // the peer is stuck or gone (stuck.cpp): this wait alone hangs behind it
        for (int r = 0; r < size; ++r)  // every other rank of the group (ranks[0]: this one), as cycles() does
          if (r != found.ranks[0])
            store->set(deadlock_key(r), std::vector<uint8_t>(found.report.begin(), found.report.end()));
      };
    }
    if (!claim.report.empty()) fail_pair(index, peer, claim.report);
  }

  // A batch with operations to other ranks: for each peer, published as this rank's next group with it, and the
  // pair's groups replayed as NCCL runs them; two that wait for each other fail both ranks.
  void order_group() {
    std::string report;
    int peer = -1, index;
    {
      std::lock_guard<std::mutex> lock(p2p_mutex_);
      if (batch_ops_.empty()) return;
      index = batch_device_;
      int64_t batch = batches_++;
      GlobalBatch all{batch, batch_site_, {}};
      for (const auto& [with, counts] : batch_ops_) {
        PairQueue& pq = pair_queues_[with];
        pq.sends += counts.first;
        pq.recvs += counts.second;
        all.peers[with] = {counts.first, counts.second, pq.sends, pq.recvs};
        pq.post(*store_, getRank(), with, {pq.sends, pq.recvs, batch, batch_site_});
        if (!report.empty()) continue;
        report = pq.replay(*store_, group(), getRank(), with);
        peer = with;
      }
      batch_ops_.clear();
      global_.pending.push_back(std::move(all));
      global_.step(*store_, group(), getRank(), pair_queues_, false);  // the watchdog looks for cycles
    }
    watch(index);  // a deadlock the peer finds reaches this rank's communicator through the watchdog
    if (!report.empty()) fail_pair(index, peer, report);
  }

  // Fail this rank (its communicator aborted, as NCCL's would be) and ``peer``, whose watchdog raises ``report``.
  void fail_pair(int index, int peer, const std::string& report) {
    store_->set(deadlock_key(peer), report);
    Queue& q = g_queues[index];
    {
      std::lock_guard<std::mutex> lock(q.m);
      if (q.broken.empty()) abort_queue(q, report);
    }
    note_raised(index);
    raise_report(report);
  }

  static std::string deadlock_key(int rank) { return "simccl/p2p/deadlock/" + std::to_string(rank); }

  void watch(int index) {  // once: the first point-to-point operation's device; later ones reset the key's backoff
    if (watched_.exchange(true)) return p2p_activity(this);
    watched_device_ = index;
    watch_p2p(this, store_, deadlock_key(getRank()), index, [this, index] { cycles(index); },
              [own = own_, index](const std::string& report) { own->note(report, index); });
  }

  // On the watchdog: this rank's batches replayed with every peer's (cycle.cpp). A cycle through three or more
  // ranks fails every rank of the group (this rank's communicator aborted, the others' through their watchdogs):
  // on NCCL the cycle's ranks hang, and the group's other ranks with them at their next operation with one.
  void cycles(int index) {
    std::unique_lock<std::mutex> lock(p2p_mutex_, std::try_to_lock);  // busy: the next poll
    if (!lock.owns_lock() || global_.pending.empty()) return;
    CycleReport found;
    try {
      found = global_.step(*store_, group(), getRank(), pair_queues_, true);
      for (int r = 0; r < getSize() && !found.report.empty(); ++r)
        if (r != getRank()) store_->set(deadlock_key(r), found.report);
    } catch (const std::exception&) {  // the store is gone: the job is ending
      return;
    }
    lock.unlock();
    if (found.report.empty()) return;
    own_->note(found.report, index);
    Queue& q = g_queues[index];
    std::lock_guard<std::mutex> qlock(q.m);
    if (q.broken.empty()) abort_queue(q, found.report);
  }

  static void check_unbroken(int index) {
    std::string broken = broken_report(g_queues[index]);
    if (broken.empty()) return;
    note_raised(index);
    raise_report(broken);
  }

  // "" or the report of a cycle found at the end (flush_cycles).
  std::string release() {
    if (released_.exchange(true)) return "";
    if (getSize() > 1) {
      int64_t issued;
      {
        std::lock_guard<std::mutex> lock(p2p_mutex_);
        issued = collectives_;
      }
      try {
        publish_broken_devices();  // stuck (says more than released), unless the watchdog published it already
        forget_member(this);
        publish_gone(*store_, getRank());  // a peer blocked on a send or receive it never posted says so
        publish_released(store_, group(), getRank(), getSize(), global_rank_, issued);  // a blocked member says so
      } catch (const std::exception&) {  // the store is gone: the job is ending
        forget_member(this);
      }
    }
    std::string report = flush_cycles();
    unwatch_p2p(this);
    drop_waiters(*store_);  // the group's blocked-wait connections (pair_order.cpp)
    if (g_live_communicators.fetch_sub(1) == 1) stop_collective_workers();
    return report;
  }

  // The watchdog looks for cycles of batches at its polls only (cycle.cpp), so a cycle whose last batch was posted
  // within a poll or two of the job's end (process group destroy) would go unreported, and NCCL would hang there.
  // Before the communicator goes: replayed until every batch of this rank completed, or a cycle is found (here, or
  // by its lowest rank, whose report reaches this rank's watchdog), for at most kFlushPolls watchdog polls. Free
  // when the replay has nothing pending (every batch's partners were posted a poll before the end). Returns this
  // group's report that no operation raised yet, once; never another group's (the device is shared: its queue
  // broken by another group's report ends the wait here, and that group's release raises it).
  std::string flush_cycles() {
    constexpr int kFlushPolls = 10;
    if (!watched_) return "";
    p2p_activity(this);  // a peer's report is read at the watchdog's next poll, not a backoff later
    Queue& q = g_queues[watched_device_];
    for (int poll = 0; poll < kFlushPolls; ++poll) {
      bool broken;
      {
        std::lock_guard<std::mutex> lock(q.m);
        broken = !q.broken.empty();
      }
      // read after the device's state: a report of this group is noted before it breaks the device
      if (std::string mine = own_->take(); !mine.empty()) return mine;
      if (broken) return "";
      cycles(watched_device_);  // advances the replay as far as the peers' published heads allow
      {
        std::lock_guard<std::mutex> lock(p2p_mutex_);
        if (global_.pending.empty()) return "";
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return "";
  }

  // A report of this group that reached this communicator on the watchdog (its cycle found, or a peer's report
  // read) is raised by its release (flush_cycles), once, unless an operation raised it, or any operation on the
  // device raised after it came, or after another group's report broke the device first (the same fault said
  // another way: gloo's error once the peer aborted, a timeout, that other report): at the job's end, and mid-run
  // too when no later operation on the device raised (NCCL hangs there: the job must not end cleanly). Shared with
  // the watch's callback, which may outlive the communicator.
  struct OwnReport {
    std::mutex m;
    std::string report;
    int device = 0;
    int64_t raised_at = 0;  // raised_ops(device) when the report came, or when another report broke the device
    void note(const std::string& r, int on) {
      // A report that comes to a device another report broke first is that failure said again: an operation
      // that raised since the break said both, whether the watchdog noted this one before it or after (a poll
      // late under load); reading the time of noting alone made the outcome depend on the poll's timing.
      int64_t at = raised_ops(on);
      {
        Queue& q = g_queues[on];
        std::lock_guard<std::mutex> lock(q.m);
        if (!q.broken.empty() && q.broken != r) at = q.raised_when_broken;
      }
      std::lock_guard<std::mutex> lock(m);
      if (!report.empty()) return;
      report = r;
      device = on;
      raised_at = at;
    }
    std::string take() {  // "" or the report when no operation raised since it came
      std::lock_guard<std::mutex> lock(m);
      std::string r;
      std::swap(r, report);
      return raised_before(r) || raised_ops(device) > raised_at ? "" : r;
    }
  };

  std::shared_ptr<OwnReport> own_ = std::make_shared<OwnReport>();
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Backend> gloo_;
  bool sync_returns_none_;
  int comm_stream_;  // this communicator's stream on each device (race.cpp's detector orders by it)
  int global_rank_;  // this rank in the job (the default group)
  int64_t incarnation_;  // 1 for the first group made under its name in this process, 2 for the next (group())
  std::atomic<bool> released_{false}, watched_{false};
  int watched_device_ = 0;  // the device whose watchdog watches this communicator (watch)
  std::mutex p2p_mutex_;
  int64_t collectives_ = 0, checked_ = 0;
  // Its collectives the device ran to completion (comm_queue.cpp's finish): what a stuck member is published with,
  // since one it issued may sit behind the operation it is stuck on, and an aborted queue runs none of them.
  std::shared_ptr<std::atomic<int64_t>> completed_ = std::make_shared<std::atomic<int64_t>>(0);
  std::string last_;
  std::map<PeerTag, int64_t> sends_, recvs_;
  std::map<int, int64_t> pair_places_;  // unbatched operations issued per peer (NCCL ignores tags)
  std::map<std::pair<int, bool>, int64_t> batched_places_;  // batched sends to (true) and receives from each peer
  bool coalescing_ = false;             // between startCoalescing and endCoalescing
  std::vector<c10::intrusive_ptr<c10d::Work>> batch_;
  std::map<int, std::pair<int64_t, int64_t>> batch_ops_;  // the batch's (sends, receives) per peer
  std::string batch_site_;                                // where its first operation was issued
  int batch_device_ = 0;
  int64_t batches_ = 0;                  // batches with operations to other ranks issued on the group
  std::map<int, PairQueue> pair_queues_;  // per peer: the pair's batches as NCCL runs them (group_order.cpp)
  GlobalReplay global_;                   // this rank's batches as NCCL runs every rank's (cycle.cpp)
};

}  // namespace

c10::intrusive_ptr<c10d::Backend> collective_backend(c10::intrusive_ptr<c10d::Store> store,
                                                     c10::intrusive_ptr<c10d::Backend> gloo, bool sync_returns_none,
                                                     int global_rank, int64_t incarnation) {
  return c10::make_intrusive<SimCollectives>(counted_store(std::move(store)), std::move(gloo), sync_returns_none,
                                             global_rank, incarnation);
}

}  // namespace sim
