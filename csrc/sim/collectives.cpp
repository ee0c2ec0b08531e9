// "simccl": the sim device's process-group backend, gloo under explicit host staging copies.
//
// Every collective copies its device inputs to host buffers, runs gloo on those, and copies the
// results back into the device tensors when the work is waited on (or seen complete), the way a
// vendor library hands results back on its own stream. So a result read before wait() is stale
// here, as it can be on real hardware. The staging copies are not counted as host syncs.
#include "compat.h"
#include "sim.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <mutex>

namespace sim {
namespace {

using Tensors = std::vector<at::Tensor>;

at::Tensor stage_in(const at::Tensor& t) {
  return t.is_privateuseone() ? host_copy(t).contiguous() : t;
}

at::Tensor stage_out(const at::Tensor& t) {
  return t.is_privateuseone() ? at::empty(t.sizes(), t.options().device(c10::kCPU)) : t;
}

// Host buffers of one collective and the device tensors they are copied back into.
struct Staging {
  std::vector<std::pair<at::Tensor, at::Tensor>> back;  // (device, host)

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
    if (write_back && dev.is_privateuseone()) back.emplace_back(dev, h);
    return h;
  }
};

class StagedWork final : public c10d::Work {
 public:
  StagedWork(c10::intrusive_ptr<c10d::Work> inner, Staging staging)
      : inner_(std::move(inner)), back_(std::move(staging.back)) {}
  bool wait(std::chrono::milliseconds timeout) override {
    bool ok = inner_->wait(timeout);
    finish();
    return ok;
  }
  bool isCompleted() override {
    if (!inner_->isCompleted()) return false;
    finish();
    return true;
  }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  std::vector<at::Tensor> result() override { return inner_->result(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return inner_->getFuture(); }

 private:
  void finish() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [dev, host] : back_) dev.copy_(host);  // host-to-device: not a sync
    back_.clear();
  }
  c10::intrusive_ptr<c10d::Work> inner_;
  std::vector<std::pair<at::Tensor, at::Tensor>> back_;
  std::mutex mutex_;
};

c10::intrusive_ptr<c10d::Work> staged(c10::intrusive_ptr<c10d::Work> work, Staging&& s) {
  return c10::make_intrusive<StagedWork>(std::move(work), std::move(s));
}

// An in-place collective (all-reduce, broadcast): inputs staged in and copied back.
template <typename F>
c10::intrusive_ptr<c10d::Work> in_place(Tensors& ts, F&& call) {
  Staging s;
  auto h = s.in(ts, true);
  return staged(call(h), std::move(s));
}

// A data-moving collective: inputs staged in, outputs staged out and copied back.
template <typename O, typename I, typename F>
c10::intrusive_ptr<c10d::Work> moving(O& outs, I& ins, F&& call) {
  Staging s;
  auto hi = s.in(ins);
  auto ho = s.out(outs);
  return staged(call(ho, hi), std::move(s));
}

class SimCollectives final : public c10d::Backend {
 public:
  explicit SimCollectives(c10::intrusive_ptr<c10d::Backend> gloo)
      : c10d::Backend(gloo->getRank(), gloo->getSize()), gloo_(std::move(gloo)) {}

  const std::string getBackendName() const override { return "simccl"; }

  c10::intrusive_ptr<c10d::Work> broadcast(Tensors& ts, const c10d::BroadcastOptions& o) override {
    return in_place(ts, [&](Tensors& h) { return gloo_->broadcast(h, o); });
  }
  c10::intrusive_ptr<c10d::Work> allreduce(Tensors& ts, const c10d::AllreduceOptions& o) override {
    return in_place(ts, [&](Tensors& h) { return gloo_->allreduce(h, o); });
  }
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(Tensors& ts, const c10d::AllreduceCoalescedOptions& o) override {
    return in_place(ts, [&](Tensors& h) { return gloo_->allreduce_coalesced(h, o); });
  }
  c10::intrusive_ptr<c10d::Work> reduce(Tensors& ts, const c10d::ReduceOptions& o) override {
    return in_place(ts, [&](Tensors& h) { return gloo_->reduce(h, o); });
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<Tensors>& outs, Tensors& ins,
                                           const c10d::AllgatherOptions& o) override {
    return moving(outs, ins, [&](auto& ho, auto& hi) { return gloo_->allgather(ho, hi, o); });
  }
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions& o) override {
    return moving(out, in, [&](auto& ho, auto& hi) { return gloo_->_allgather_base(ho, hi, o); });
  }
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(Tensors& outs, Tensors& ins,
                                                                 const c10d::AllgatherOptions& o) override {
    return moving(outs, ins, [&](auto& ho, auto& hi) { return gloo_->allgather_into_tensor_coalesced(ho, hi, o); });
  }
  c10::intrusive_ptr<c10d::Work> gather(std::vector<Tensors>& outs, Tensors& ins,
                                        const c10d::GatherOptions& o) override {
    return moving(outs, ins, [&](auto& ho, auto& hi) { return gloo_->gather(ho, hi, o); });
  }
  c10::intrusive_ptr<c10d::Work> scatter(Tensors& outs, std::vector<Tensors>& ins,
                                         const c10d::ScatterOptions& o) override {
    return moving(outs, ins, [&](auto& ho, auto& hi) { return gloo_->scatter(ho, hi, o); });
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(Tensors& outs, std::vector<Tensors>& ins,
                                                const c10d::ReduceScatterOptions& o) override {
    return moving(outs, ins, [&](auto& ho, auto& hi) { return gloo_->reduce_scatter(ho, hi, o); });
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                      const c10d::ReduceScatterOptions& o) override {
    return moving(out, in, [&](auto& ho, auto& hi) { return gloo_->_reduce_scatter_base(ho, hi, o); });
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(Tensors& outs, Tensors& ins,
                                                                 const c10d::ReduceScatterOptions& o) override {
    return moving(outs, ins, [&](auto& ho, auto& hi) { return gloo_->reduce_scatter_tensor_coalesced(ho, hi, o); });
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                                               std::vector<int64_t>& in_splits,
                                               const c10d::AllToAllOptions& o) override {
    return moving(out, in, [&](auto& ho, auto& hi) { return gloo_->alltoall_base(ho, hi, out_splits, in_splits, o); });
  }
  c10::intrusive_ptr<c10d::Work> alltoall(Tensors& outs, Tensors& ins, const c10d::AllToAllOptions& o) override {
    return moving(outs, ins, [&](auto& ho, auto& hi) { return gloo_->alltoall(ho, hi, o); });
  }
  c10::intrusive_ptr<c10d::Work> send(Tensors& ts, int dst, int tag) override {
    Tensors none;
    return moving(none, ts, [&](auto&, auto& hi) { return gloo_->send(hi, dst, tag); });
  }
  c10::intrusive_ptr<c10d::Work> recv(Tensors& ts, int src, int tag) override {
    Tensors none;
    return moving(ts, none, [&](auto& ho, auto&) { return gloo_->recv(ho, src, tag); });
  }
  c10::intrusive_ptr<c10d::Work> recvAnysource(Tensors& ts, int tag) override {
    Tensors none;
    return moving(ts, none, [&](auto& ho, auto&) { return gloo_->recvAnysource(ho, tag); });
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& o) override { return gloo_->barrier(o); }
#if SIM_BACKEND_HAS_SET_TIMEOUT
  void setTimeout(std::chrono::milliseconds timeout) override { gloo_->setTimeout(timeout); }
#endif

 private:
  c10::intrusive_ptr<c10d::Backend> gloo_;
};

}  // namespace

c10::intrusive_ptr<c10d::Backend> collective_backend(c10::intrusive_ptr<c10d::Backend> gloo) {
  return c10::make_intrusive<SimCollectives>(std::move(gloo));
}

}  // namespace sim
