// Device memory of the sim accelerator: host memory from c10::alloc_cpu, counted per device.
// With poisoning on, fresh memory is all 0xff bytes (NaN in every float type), as a GPU's reused
// memory is garbage: code that reads an empty() buffer before writing it shows up.
//
// Nothing is cached, so "reserved" equals "allocated" (the statistics say so honestly). Memory a
// CPU kernel allocated for a result is adopted (sim::adopt) rather than copied, and counted from then on.
#include "sim.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <algorithm>
#include <atomic>
#include <cstring>

namespace sim {
namespace {

struct Counters {
  std::atomic<int64_t> allocated{0}, peak{0}, allocations{0};
};
Counters g_mem[kMaxDevices];
bool g_poison = false;

void add_bytes(c10::DeviceIndex index, int64_t nbytes) {
  auto& c = g_mem[index];
  int64_t now = c.allocated.fetch_add(nbytes) + nbytes;
  int64_t peak = c.peak.load();
  while (now > peak && !c.peak.compare_exchange_weak(peak, now)) {
  }
  c.allocations.fetch_add(1);
}

// What a device DataPtr owns: raw memory from alloc_cpu, or an adopted host DataPtr.
struct Block {
  size_t nbytes;
  c10::DeviceIndex index;
  void* raw;
  c10::DataPtr adopted;
};

void free_block(void* ctx) {
  auto* b = static_cast<Block*>(ctx);
  g_mem[b->index].allocated.fetch_sub(static_cast<int64_t>(b->nbytes));
  if (b->raw) c10::free_cpu(b->raw);
  delete b;  // an adopted DataPtr frees its memory here
}

struct SimAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    c10::DeviceIndex index = current_device();
    void* ptr = nbytes ? c10::alloc_cpu(nbytes) : nullptr;
    if (ptr && g_poison) std::memset(ptr, 0xff, nbytes);  // NaN in every float type: reads before writes show
    add_bytes(index, static_cast<int64_t>(nbytes));
    auto* b = new Block{nbytes, index, ptr, c10::DataPtr()};
    return {ptr, b, &free_block, c10::Device(kSim, index)};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    if (count) std::memcpy(dest, src, count);
  }
};

SimAllocator g_allocator;

}  // namespace

void set_poison(bool on) { g_poison = on; }

c10::Allocator* allocator() { return &g_allocator; }

MemoryStats memory_stats(c10::DeviceIndex index) {
  check_index(index);
  const auto& c = g_mem[index];
  return {c.allocated.load(), c.peak.load(), c.allocations.load()};
}

void reset_peak(c10::DeviceIndex index) {
  check_index(index);
  g_mem[index].peak.store(g_mem[index].allocated.load());
}

c10::DataPtr adopt(c10::DataPtr&& host, size_t nbytes, c10::DeviceIndex index) {
  void* ptr = host.get();
  add_bytes(index, static_cast<int64_t>(nbytes));
  auto* b = new Block{nbytes, index, nullptr, std::move(host)};
  return {ptr, b, &free_block, c10::Device(kSim, index)};
}

REGISTER_ALLOCATOR(kSim, &g_allocator);

}  // namespace sim
