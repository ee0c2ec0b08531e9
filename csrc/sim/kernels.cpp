// The sim device's own kernels: allocation, copies, resize, views, set_, item, and the sync counter.
//
// Everything else runs through the boxed fallback (fallback.cpp). Copies and item() run on CPU
// views of device memory; a device-to-host copy or item() outside the collective layer's staging
// is counted as a host synchronization (the host waits for the device there on real hardware).
// A non_blocking device-to-host copy into pinned memory completes asynchronously (stream.cpp).
#include "sim.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/CPUAllocator.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <mutex>

namespace sim {

// ---- host-sync counter ----------------------------------------------------------------------
namespace {

std::atomic<int64_t> g_syncs[4];
const char* const kKinds[4] = {"copy", "item", "shape", "compare"};
thread_local bool g_internal_copy = false;
std::mutex g_hook_mutex;
std::function<void(const std::string&, const std::string&)> g_hook;

int kind_index(const std::string& kind) {
  for (int i = 0; i < 4; ++i)
    if (kind == kKinds[i]) return i;
  TORCH_CHECK(false, "sim: unknown sync kind '", kind, "' (copy, item, shape, compare)");
}

}  // namespace

void count_sync(const char* kind, const char* op) {
  g_syncs[kind_index(kind)].fetch_add(1);
  std::function<void(const std::string&, const std::string&)> hook;
  {
    std::lock_guard<std::mutex> lock(g_hook_mutex);
    hook = g_hook;
  }
  if (hook) hook(kind, op);
}

int64_t sync_count(const std::string& kind) {
  if (!kind.empty()) return g_syncs[kind_index(kind)].load();
  int64_t total = 0;
  for (auto& c : g_syncs) total += c.load();
  return total;
}

void reset_sync_count() {
  for (auto& c : g_syncs) c.store(0);
}

void set_sync_hook(std::function<void(const std::string&, const std::string&)> hook) {
  std::lock_guard<std::mutex> lock(g_hook_mutex);
  g_hook = std::move(hook);
}

InternalCopy::InternalCopy() : previous(g_internal_copy) { g_internal_copy = true; }
InternalCopy::~InternalCopy() { g_internal_copy = previous; }

// ---- CPU views of device memory ----------------------------------------------------------------
c10::Storage cpu_alias_storage(const c10::Storage& storage) {
  c10::DataPtr borrowed(const_cast<void*>(storage.data()), c10::Device(c10::kCPU));  // owns nothing
  return c10::Storage(c10::Storage::use_byte_size_t(), storage.nbytes(), std::move(borrowed), c10::GetCPUAllocator(),
                      /*resizable=*/true);
}

namespace {

at::Tensor over_storage(c10::Storage storage, c10::DispatchKey key, const at::Tensor& like) {
  auto out = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(key), like.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(), like.storage_offset());
  if (like.is_conj()) out._set_conj(true);
  if (like.is_neg()) out._set_neg(true);
  return out;
}

}  // namespace

at::Tensor cpu_view(const at::Tensor& t) {
  if (!t.defined() || !t.is_privateuseone()) return t;
  return over_storage(cpu_alias_storage(t.storage()), c10::DispatchKey::CPU, t);
}

at::Tensor wrap_storage(c10::Storage storage, const at::Tensor& like) {
  return over_storage(std::move(storage), c10::DispatchKey::PrivateUse1, like);
}

at::Tensor host_copy(const at::Tensor& t) {
  InternalCopy internal;
  return cpu_view(t).clone();
}

// ---- kernels ----------------------------------------------------------------------------------
namespace {

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout>, std::optional<at::Device> device, std::optional<bool>,
                               std::optional<at::MemoryFormat> memory_format) {
  c10::DeviceIndex saved = current_device();
  if (device && device->has_index()) set_current_device(device->index());
  auto out = at::detail::empty_generic(size, allocator(), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                       c10::dtype_or_default(dtype), memory_format);
  set_current_device(saved);
  return out;
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout>, std::optional<at::Device> device, std::optional<bool>) {
  c10::DeviceIndex saved = current_device();
  if (device && device->has_index()) set_current_device(device->index());
  auto out = at::detail::empty_strided_generic(size, stride, allocator(),
                                               c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                               c10::dtype_or_default(dtype));
  set_current_device(saved);
  return out;
}

// A kernel ``op`` on the current stream of each tensor's device: checked against collectives in flight and
// other streams' accesses (race.cpp), and noted as a use of the memory on that stream. ``uses[i]``: how
// ``ts[i]`` is accessed. Tensors on two devices (a copy between them) are a kernel on each.
void run_checks(std::initializer_list<std::pair<const at::Tensor*, Use>> uses, const char* op) {
  std::vector<Kernel> kernels;
  for (auto& [t, use] : uses) {
    if (!t->defined() || !t->is_privateuseone()) continue;
    auto index = t->device().index();
    auto stream = static_cast<int>(current_stream(index).id());
    auto it = std::find_if(kernels.begin(), kernels.end(), [&](const Kernel& k) { return k.device() == index; });
    if (it == kernels.end()) {
      kernels.emplace_back(index, stream, note_kernel(index), op);
      it = kernels.end() - 1;
    }
    check_not_in_flight(*t, op);
    note_use(t->storage(), it->point(), op);
    it->use(*t, use);
  }
  for (auto& k : kernels) k.check();
  for (auto& k : kernels) k.commit();
}

// A non_blocking copy into pinned host memory completes later on the device's worker: until then the
// destination holds garbage (NaN, or -1 in integer types), as a GPU's pinned buffer does before the event.
void copy_to_pinned_async(const at::Tensor& self, const at::Tensor& dst) {
  at::Tensor snapshot = cpu_view(self).clone();  // the source as the stream sees it at this point
  if (dst.is_floating_point() || dst.is_complex()) {
    dst.fill_(std::numeric_limits<double>::quiet_NaN());
  } else if (dst.scalar_type() != at::kBool) {
    dst.fill_(-1);
  }
  int guard = -1;
  if (dst.is_contiguous()) {
    auto site = python_site();
    guard = guard_pages(dst.data_ptr(), dst.nbytes(),
                        "sim: host access to the destination of a non_blocking device-to-host copy (issued at " +
                            site.first + ", thread " + site.second +
                            ") before it completed: synchronize the stream (or an event recorded after the copy) "
                            "before reading the host buffer");
  }
  enqueue_async(self.device().index(), [dst, snapshot, guard]() mutable {
    release_guard(guard);
    dst.copy_(snapshot);
  });
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  bool to_host = self.is_privateuseone() && dst.is_cpu();
  bool blocking_read = to_host && !non_blocking && !g_internal_copy;
  if (!g_internal_copy) {
    check_deferred();
    run_checks({{&self, Use::read}, {&dst, Use::write}}, blocking_read ? "a blocking copy to the host" : "copy_");
  }
  if (to_host && non_blocking && !g_internal_copy && is_pinned(dst.data_ptr())) {
    copy_to_pinned_async(self, dst);
    return dst;
  }
  if (blocking_read) count_sync("copy", "_copy_from");
  at::Tensor src = cpu_view(self), out = cpu_view(dst);
  out.copy_(src);
  if (blocking_read) host_waits_current(self.device().index());  // as CUDA's: the host waits for this stream only
  return dst;
}

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size, std::optional<at::MemoryFormat> format) {
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(size);
  if (format) impl->empty_tensor_restride(*format);
  size_t needed = at::detail::computeStorageNbytes(self.sizes(), self.strides(), self.dtype().itemsize(),
                                                   self.storage_offset());
  if (needed > self.storage().nbytes()) resize_bytes(self.storage(), needed);
  return self;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (dst.is_privateuseone()) {
    resize_(dst, self.sizes(), std::nullopt);
  } else {
    dst.resize_(self.sizes());
  }
  return copy_from(self, dst, false);
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source, int64_t offset, c10::IntArrayRef size,
                        c10::IntArrayRef stride) {
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  if (stride.empty()) {
    impl->set_sizes_contiguous(size);
    impl->set_storage_offset(offset);
  } else {
    impl->set_sizes_and_strides(size, stride, offset);
  }
  size_t needed = at::detail::computeStorageNbytes(self.sizes(), self.strides(), self.dtype().itemsize(), offset);
  if (needed > self.storage().nbytes()) resize_bytes(self.storage(), needed);
  return self;
}

at::Tensor& set_source_storage(at::Tensor& self, c10::Storage source) {
  int64_t n = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return set_storage(self, std::move(source), 0, {n}, {});
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  if (self.unsafeGetTensorImpl() == source.unsafeGetTensorImpl()) return self;
  return set_storage(self, source.storage(), source.storage_offset(), source.sizes(), source.strides());
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage fresh(c10::Storage::use_byte_size_t(), 0, allocator(), /*resizable=*/true);
  return set_storage(self, std::move(fresh), 0, {0}, {});
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  check_deferred();
  run_checks({{&self, Use::read}}, "item()");
  count_sync("item", "_local_scalar_dense");
  host_waits_current(self.device().index());  // a blocking copy to the host on the current stream
  return at::_local_scalar_dense(cpu_view(self));
}

// native_dropout has no generator argument, so through the fallback the CPU kernel would draw its mask
// from the host's default generator; here the mask is drawn by bernoulli_ on the device (device generator).
std::tuple<at::Tensor, at::Tensor> native_dropout(const at::Tensor& input, double p, std::optional<bool> train) {
  if (input.numel() == 0) return {input, at::empty_like(input, input.options().dtype(at::kBool))};
  if (!train.value_or(true)) return {input.clone(), at::ones_like(input, input.options().dtype(at::kBool))};
  double keep = 1.0 - p, scale = keep == 0.0 ? 0.0 : 1.0 / keep;
  at::Tensor mask = at::empty_like(input, input.options().dtype(at::kBool));
  mask.bernoulli_(keep);
  return {input.mul(mask).mul_(scale), mask};
}

// The caching allocator keeps the block from reuse until ``stream`` has passed the point of the free.
void record_stream_kernel(at::Tensor& self, c10::Stream stream) { record_stream(self.storage().data_ptr(), stream); }

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("resize_", resize_);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("view", at::native::view);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("set_.source_Storage_storage_offset", set_storage);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Tensor", set_source_tensor);
  m.impl("set_", set_empty);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("record_stream", record_stream_kernel);
  m.impl("native_dropout", native_dropout);
}

}  // namespace sim
