// Host staging of a sim collective (staging.cpp): NCCL's tensor rules, checked before any work, and the host
// buffers gloo runs on, with the device tensors they are copied back into.
#pragma once

#include "sim.h"

#include <ATen/ATen.h>

#include <string>
#include <utility>
#include <vector>

namespace sim {

using Tensors = std::vector<at::Tensor>;

at::Tensor stage_in(const at::Tensor& t);   // a host copy of a device tensor (a host tensor as it is)
at::Tensor stage_out(const at::Tensor& t);  // a host buffer for a device tensor's result

// NCCL's tensor rule (ProcessGroupNCCL's checks, before any work): a collective's single tensor must be contiguous
// in its suggested memory format, each tensor of a list non-overlapping and dense; point-to-point only warns.
// gloo takes any layout, so without this a strided view passes here and fails on the GPU.
enum class Layout { contiguous, dense };
void require_layout(const char* op, const at::Tensor& t, Layout rule);
void require_layout(const char* op, const Tensors& ts, Layout rule);
void require_layout(const char* op, const std::vector<Tensors>& tss, Layout rule);

// Point-to-point tensors as NCCL moves them: numel() elements from the first byte (one with gaps is refused).
Tensors p2p_views(const char* op, const Tensors& ts);
// A stacked (world, *part) buffer as the concatenation along dim 0 gloo takes.
at::Tensor as_concatenation(const at::Tensor& whole, const at::Tensor& part, int64_t world);
// all_to_all's fingerprint: the shape past the first dimension (per-rank lengths differ with uneven splits).
std::string rows_fingerprint(const at::Tensor& t);

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

}  // namespace sim
