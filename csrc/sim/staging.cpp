// Host staging of a sim collective (declared in staging.h), and the hook that names where a collective was
// issued (comm.h's python_site_full).
#include "staging.h"

#include "comm.h"

#include <functional>
#include <mutex>
#include <sstream>

namespace sim {

at::Tensor stage_in(const at::Tensor& t) {
  return t.is_privateuseone() ? host_copy(t).contiguous() : t;
}

at::Tensor stage_out(const at::Tensor& t) {
  return t.is_privateuseone() ? at::empty(t.sizes(), t.options().device(c10::kCPU)) : t;
}

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

namespace {

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

void set_site_hook(std::function<Site()> hook) {
  std::lock_guard<std::mutex> lock(g_site_mutex);
  g_site_hook = std::move(hook);
}

}  // namespace sim
