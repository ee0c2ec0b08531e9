// The simulated accelerator "sim": a PrivateUse1 device whose memory is host memory.
//
// Shared declarations of the extension omnitron._sim: memory statistics, the host-sync counter,
// the current device, the default generators, and zero-copy CPU views of device tensors.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>

#include <cstdint>
#include <functional>
#include <string>

namespace sim {

constexpr int kMaxDevices = 16;
constexpr c10::DeviceType kSim = c10::DeviceType::PrivateUse1;

// ---- devices (device.cpp) -------------------------------------------------------------
c10::DeviceIndex device_count();
void set_device_count(int n);
c10::DeviceIndex current_device();
void set_current_device(c10::DeviceIndex index);
void check_index(c10::DeviceIndex index);

// ---- memory (allocator.cpp) -----------------------------------------------------------
struct MemoryStats {
  int64_t allocated, peak, allocations;
};
c10::Allocator* allocator();
MemoryStats memory_stats(c10::DeviceIndex index);
void reset_peak(c10::DeviceIndex index);
void set_poison(bool on);  // fill fresh device memory with 0xff bytes
// Take ownership of host memory a CPU kernel allocated, as device memory of ``index`` (counted).
c10::DataPtr adopt(c10::DataPtr&& host, size_t nbytes, c10::DeviceIndex index);
// Grow (or shrink) a device storage to ``nbytes``, keeping its leading contents.
void resize_bytes(const c10::Storage& storage, size_t nbytes);

// ---- host synchronizations (kernels.cpp) ----------------------------------------------
// Kinds: "copy" (device-to-host copy), "item" (_local_scalar_dense), "shape" (an op whose output
// shape depends on device data: nonzero, masked_select, unique, boolean indexing), "compare" (equal).
void count_sync(const char* kind, const char* op);
int64_t sync_count(const std::string& kind);  // "" = total
void reset_sync_count();
void set_sync_hook(std::function<void(const std::string&, const std::string&)> hook);
// While alive, device-to-host copies are not counted (the collective layer's staging copies).
struct InternalCopy {
  InternalCopy();
  ~InternalCopy();
  bool previous;
};

// ---- RNG (generator.cpp) --------------------------------------------------------------
const at::Generator& default_generator(c10::DeviceIndex index);
at::Generator new_generator(c10::DeviceIndex index);
// The CPU generator holding the state of a sim generator (the one CPU kernels draw from).
at::Generator cpu_generator_of(const at::Generator& gen);

// ---- tensors (kernels.cpp) ------------------------------------------------------------
// A CPU tensor over the same memory (no copy); ``storage`` reuses one alias per device storage.
at::Tensor cpu_view(const at::Tensor& t);
// A CPU storage over the memory of a device storage (no copy; resizable, so a CPU kernel may grow it).
c10::Storage cpu_alias_storage(const c10::Storage& storage);
// A device tensor over ``storage`` with the sizes, strides, offset and conj/neg bits of ``like``.
at::Tensor wrap_storage(c10::Storage storage, const at::Tensor& like);
at::Tensor host_copy(const at::Tensor& t);  // an uncounted device-to-host copy

}  // namespace sim
