// Devices, device guard, hooks and generators of the sim accelerator.
//
// The current device and each device's current stream are per thread (as on CUDA). Streams and
// events are stream.cpp's; pinned host memory is allocator.cpp's.
#include "sim.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <mutex>
#include <vector>

namespace sim {
namespace {

int g_device_count = 8;
thread_local c10::DeviceIndex g_current = 0;

}  // namespace

c10::DeviceIndex device_count() { return static_cast<c10::DeviceIndex>(g_device_count); }

void set_device_count(int n) {
  TORCH_CHECK(n >= 1 && n <= kMaxDevices, "sim: device count must be in [1, ", kMaxDevices, "], got ", n);
  g_device_count = n;
}

void check_index(c10::DeviceIndex index) {
  TORCH_CHECK(index >= 0 && index < g_device_count, "sim: invalid device index ", int(index), " (", g_device_count,
              " devices)");
}

c10::DeviceIndex current_device() { return g_current; }

void set_current_device(c10::DeviceIndex index) {
  check_index(index);
  g_current = index;
}

// ---- generators -------------------------------------------------------------------------
namespace {

// A device generator: its state lives in a CPU generator of its own (never the host default one),
// which the fallback hands to the CPU kernels, so device draws never advance the host RNG.
struct SimGenerator final : c10::GeneratorImpl {
  explicit SimGenerator(c10::DeviceIndex index)
      : c10::GeneratorImpl(c10::Device(kSim, index), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        cpu(at::detail::createCPUGenerator(c10::default_rng_seed_val)) {}
  static c10::DeviceType device_type() { return kSim; }
  void set_current_seed(uint64_t seed) override { cpu.set_current_seed(seed); }
  void set_offset(uint64_t offset) override { cpu.set_offset(offset); }
  uint64_t get_offset() const override { return cpu.get_offset(); }
  uint64_t current_seed() const override { return cpu.current_seed(); }
  uint64_t seed() override { return cpu.seed(); }
  void set_state(const c10::TensorImpl& state) override { cpu.unsafeGetGeneratorImpl()->set_state(state); }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override { return cpu.unsafeGetGeneratorImpl()->get_state(); }
  SimGenerator* clone_impl() const override {
    auto* g = new SimGenerator(device().index());
    g->cpu = cpu.clone();
    return g;
  }
  at::Generator cpu;
};

std::once_flag g_gen_once[kMaxDevices];
std::vector<at::Generator> g_generators(kMaxDevices);

}  // namespace

const at::Generator& default_generator(c10::DeviceIndex index) {
  if (index < 0) index = current_device();
  check_index(index);
  std::call_once(g_gen_once[index], [index] { g_generators[index] = at::make_generator<SimGenerator>(index); });
  return g_generators[index];
}

at::Generator new_generator(c10::DeviceIndex index) {
  return at::make_generator<SimGenerator>(index < 0 ? current_device() : index);
}

at::Generator cpu_generator_of(const at::Generator& gen) {
  TORCH_CHECK(gen.device().type() == kSim, "Expected a 'sim' device type for generator but found '",
              gen.device().type(), "'");
  return static_cast<SimGenerator*>(gen.unsafeGetGeneratorImpl())->cpu;
}

// ---- device guard -------------------------------------------------------------------------
namespace {

struct SimGuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kSim; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = c10::Device(kSim, current_device());
    if (d.index() >= 0) set_current_device(d.index());
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kSim, current_device()); }
  void setDevice(c10::Device d) const override { set_current_device(d.index()); }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < g_device_count) g_current = d.index();
  }
  c10::Stream getStream(c10::Device d) const override { return current_stream(d.index()); }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override { return pool_stream(d.index()); }
  c10::Stream getNewStream(c10::Device d, int) const override { return pool_stream(d.index()); }
  c10::Stream exchangeStream(c10::Stream s) const override { return exchange_stream(s); }
  c10::DeviceIndex deviceCount() const noexcept override { return device_count(); }
  void record(void** event, const c10::Stream& s, const c10::DeviceIndex, const c10::EventFlag) const override {
    event_record(event, s);
  }
  void block(void* event, const c10::Stream& s) const override { event_block(event, s); }
  bool queryEvent(void* event) const override { return event_query(event); }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override { event_destroy(event); }
  bool queryStream(const c10::Stream& s) const override { return stream_query(s); }
  void synchronizeStream(const c10::Stream& s) const override { stream_synchronize(s); }
  void synchronizeEvent(void* event) const override { event_synchronize(event); }
  void synchronizeDevice(const c10::DeviceIndex index) const override {
    synchronize_collectives();
    device_synchronize(index);
  }
  double elapsedTime(void* start, void* end, const c10::DeviceIndex) const override {
    return event_elapsed_ms(start, end);
  }
  void recordDataPtrOnStream(const c10::DataPtr& data, const c10::Stream& s) const override { record_stream(data, s); }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, SimGuardImpl);

// ---- hooks ----------------------------------------------------------------------------------
struct SimHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const override { return default_generator(index); }
  at::Generator getNewGenerator(c10::DeviceIndex index) const override { return new_generator(index); }
  at::Device getDeviceFromPtr(void*) const override { return c10::Device(kSim, current_device()); }
  bool isPinnedPtr(const void* ptr) const override { return is_pinned(ptr); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return pinned_allocator(); }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return device_count(); }
  void setCurrentDevice(c10::DeviceIndex index) const override { set_current_device(index); }
  c10::DeviceIndex getCurrentDevice() const override { return current_device(); }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex index) const override {
    auto old = current_device();
    set_current_device(index);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex index) const override { return exchangeDevice(index); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t nbytes) const override {
    resize_bytes(storage, nbytes);
  }
};

struct RegisterHooks {
  RegisterHooks() { at::RegisterPrivateUse1HooksInterface(new SimHooks()); }
};
RegisterHooks g_register_hooks;

}  // namespace

void resize_bytes(const c10::Storage& storage, size_t nbytes) {
  TORCH_CHECK(storage.resizable(), "sim: trying to resize storage that is not resizable");
  c10::DeviceIndex index = storage.device().index();
  c10::DeviceIndex saved = current_device();
  set_current_device(index < 0 ? saved : index);
  c10::DataPtr fresh = allocator()->allocate(nbytes);
  set_current_device(saved);
  size_t keep = std::min(nbytes, storage.nbytes());
  if (keep) allocator()->copy_data(fresh.get(), storage.data(), keep);
  storage.set_data_ptr_noswap(std::move(fresh));
  storage.set_nbytes(nbytes);
}

}  // namespace sim
