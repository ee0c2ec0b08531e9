// Device memory of the sim accelerator: a stream-ordered caching allocator over host memory.
//
// As CUDA's caching allocator: a block belongs to the stream it was allocated on; when freed it goes
// back to that stream's cache (rounded to 512 bytes, kept until empty_cache()) and is reused at once
// by the next allocation of its size on that stream -- and on no other stream. A block given to
// record_stream(s) is held back until stream s has passed the point where it was freed (the
// allocation stream waited for s, or the host synchronized it). Freed blocks are poisoned (0xff bytes,
// NaN in every float type) so a kernel still reading one reads garbage.
//
// What CUDA leaves silent is found here: a block used by a kernel on another stream t and freed without
// record_stream, while its allocation stream a is not ordered after that use, is a hazard only once its bytes
// are used again: a GPU's allocator may give them (split or merged, so to an allocation of any size) to the
// next allocations on stream a. So every block allocated on stream a after such a free, until stream a is
// ordered after t's use, carries that use into the race detector (race.cpp): a kernel touching the block that is
// not ordered after it raises, naming the freed tensor and record_stream. A free followed by a.wait_stream(t)
// before the next allocation (how FSDP2 keeps its reduce-scatter output, read by the optimizer on the default
// stream, without record_stream) is safe, as on a GPU. Blocks are never split, so inactive split bytes are
// always 0.
// Memory a CPU kernel allocated for a result is adopted (sim::adopt) rather than copied: counted as
// allocated and reserved while alive, checked on free like any block, but not cached.
#include "sim.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace sim {
namespace {

constexpr size_t kRound = 512;

struct Counters {
  std::atomic<int64_t> allocated{0}, peak{0}, allocations{0}, reserved{0}, peak_reserved{0}, cached_blocks{0};
};
Counters g_mem[kMaxDevices];
bool g_poison = false;
const bool g_poison_free = [] {
  const char* s = std::getenv("OMNITRON_SIM_POISON_FREED");
  return !(s && std::string(s) == "0");
}();

void raise_peak(std::atomic<int64_t>& peak, int64_t now) {
  int64_t p = peak.load();
  while (now > p && !peak.compare_exchange_weak(p, now)) {
  }
}

void add_bytes(c10::DeviceIndex index, int64_t nbytes, bool fresh) {
  auto& c = g_mem[index];
  raise_peak(c.peak, c.allocated.fetch_add(nbytes) + nbytes);
  if (fresh) raise_peak(c.peak_reserved, c.reserved.fetch_add(nbytes) + nbytes);
  c.allocations.fetch_add(1);
}

// What a device DataPtr owns: a cached block of ``size`` bytes, or an adopted host DataPtr.
struct Block {
  size_t size;
  c10::DeviceIndex index;
  int stream;
  void* raw;
  c10::DataPtr adopted;
  uint64_t recorded = 0;  // bit s: record_stream(s) was called
  std::unique_ptr<uint64_t[]> uses;  // per foreign stream: the point of its last kernel on this block
  const char* last_op = nullptr;
  History* history = nullptr;  // the race detector's record of its accesses (race.cpp)
};

// A freed block waiting for the streams it was recorded on.
struct Held {
  void* raw;
  size_t size;
  int stream;
  uint64_t recorded;
  uint64_t points[kStreams];
};

struct Pool {
  std::mutex m;
  std::unordered_map<uint64_t, std::vector<void*>> free;  // key: stream << 48 | size
  std::vector<Held> held;
};
Pool g_pools[kMaxDevices];
std::mutex g_use_mutex;

// The unordered use of a freed block (by its latest point on the using stream): [device][allocation stream][user].
struct Stale {
  uint64_t point = 0;
  const char* op = nullptr;
  size_t size = 0;
};
Stale g_stale[kMaxDevices][kStreams][kStreams];  // under g_use_mutex

uint64_t key(int stream, size_t size) { return (static_cast<uint64_t>(stream) << 48) | size; }

bool held_ready(c10::DeviceIndex index, const Held& h) {
  for (int t = 0; t < kStreams; ++t)
    if ((h.recorded >> t & 1) && !ordered_after(index, h.stream, t, h.points[t])) return false;
  return true;
}

void* take_cached(c10::DeviceIndex index, int stream, size_t size) {
  Pool& p = g_pools[index];
  std::lock_guard<std::mutex> lock(p.m);
  auto it = p.free.find(key(stream, size));
  if (it != p.free.end() && !it->second.empty()) {
    void* raw = it->second.back();
    it->second.pop_back();
    return raw;
  }
  for (size_t i = 0; i < p.held.size(); ++i) {
    Held& h = p.held[i];
    if (h.stream != stream || h.size != size || !held_ready(index, h)) continue;
    void* raw = h.raw;
    p.held.erase(p.held.begin() + static_cast<std::ptrdiff_t>(i));
    return raw;
  }
  return nullptr;
}

// Each use on a stream other than the block's, neither recorded nor waited for, is kept: the next allocations on
// the block's stream may reuse its bytes (see the top of the file).
void note_unsafe_uses(const Block& b) {
  if (!b.uses || !b.size) return;  // a block of no bytes gives none to a later allocation
  std::lock_guard<std::mutex> lock(g_use_mutex);
  for (int t = 0; t < kStreams; ++t) {
    if (!b.uses[t] || (b.recorded >> t & 1) || ordered_after(b.index, b.stream, t, b.uses[t])) continue;
    Stale& st = g_stale[b.index][b.stream][t];
    if (b.uses[t] >= st.point) st = {b.uses[t], b.last_op ? b.last_op : "a kernel", b.size};
  }
}

// A block just allocated on ``b.stream``: it carries every stale use its stream is not yet ordered after.
void carry_stale_uses(Block& b) {
  std::lock_guard<std::mutex> lock(g_use_mutex);
  for (int t = 0; t < kStreams; ++t) {
    Stale& st = g_stale[b.index][b.stream][t];
    if (!st.point) continue;
    if (ordered_after(b.index, b.stream, t, st.point)) {
      st = Stale();  // every later allocation on this stream is ordered after it
      continue;
    }
    note_freed_use(&b.history, b.size, t, st.point, st.op, st.size, b.stream);
  }
}

void cache_block(Block* b) {
  Pool& p = g_pools[b->index];
  if (g_poison_free && b->size) std::memset(b->raw, 0xff, b->size);
  std::lock_guard<std::mutex> lock(p.m);
  g_mem[b->index].cached_blocks.fetch_add(1);
  if (!b->recorded) {
    p.free[key(b->stream, b->size)].push_back(b->raw);
    return;
  }
  Held h{b->raw, b->size, b->stream, b->recorded, {}};
  for (int t = 0; t < kStreams; ++t)
    if (b->recorded >> t & 1) h.points[t] = stream_point(b->index, t);
  p.held.push_back(h);
}

void free_block(void* ctx) {
  auto* b = static_cast<Block*>(ctx);
  note_unsafe_uses(*b);
  auto& c = g_mem[b->index];
  c.allocated.fetch_sub(static_cast<int64_t>(b->size));
  if (b->raw) {
    cache_block(b);
  } else {
    c.reserved.fetch_sub(static_cast<int64_t>(b->size));
    if (b->raw) c10::free_cpu(b->raw);
  }
  drop_history(b->history);
  delete b;  // an adopted DataPtr frees its memory here
}

Block* block_of(const c10::DataPtr& dp) {
  return dp.get_deleter() == &free_block ? static_cast<Block*>(dp.get_context()) : nullptr;
}

struct SimAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    c10::DeviceIndex index = current_device();
    int stream = static_cast<int>(current_stream(index).id());
    size_t size = nbytes ? (nbytes + kRound - 1) / kRound * kRound : 0;
    void* ptr = size ? take_cached(index, stream, size) : nullptr;
    bool fresh = ptr == nullptr;
    if (fresh && size) {
      ptr = c10::alloc_cpu(size);
      if (g_poison) std::memset(ptr, 0xff, size);  // NaN in every float type: reads before writes show
    } else if (size) {
      g_mem[index].cached_blocks.fetch_sub(1);
    }
    add_bytes(index, static_cast<int64_t>(size), fresh);
    auto* b = new Block{size, index, stream, ptr, c10::DataPtr()};
    carry_stale_uses(*b);
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

void note_use(const c10::Storage& storage, uint64_t point, const char* op) {
  Block* b = block_of(storage.data_ptr());
  if (!b) return;
  int s = static_cast<int>(current_stream(b->index).id());
  if (s == b->stream) return;
  std::lock_guard<std::mutex> lock(g_use_mutex);
  if (!b->uses) b->uses.reset(new uint64_t[kStreams]());
  b->uses[s] = std::max(b->uses[s], point);
  b->last_op = op;
}

History** history_slot(const c10::Storage& storage) {
  Block* b = block_of(storage.data_ptr());
  return b ? &b->history : nullptr;
}

void record_stream(const c10::DataPtr& data, const c10::Stream& stream) {
  Block* b = block_of(data);
  if (!b || stream.id() == b->stream) return;
  std::lock_guard<std::mutex> lock(g_use_mutex);
  b->recorded |= uint64_t(1) << stream.id();
}

MemoryStats memory_stats(c10::DeviceIndex index) {
  check_index(index);
  const auto& c = g_mem[index];
  return {c.allocated.load(), c.peak.load(), c.allocations.load(), c.reserved.load(), c.peak_reserved.load(), 0,
          c.cached_blocks.load()};
}

void reset_peak(c10::DeviceIndex index) {
  check_index(index);
  g_mem[index].peak.store(g_mem[index].allocated.load());
  g_mem[index].peak_reserved.store(g_mem[index].reserved.load());
}

void empty_cache() {
  for (int i = 0; i < kMaxDevices; ++i) {
    Pool& p = g_pools[i];
    std::lock_guard<std::mutex> lock(p.m);
    for (auto& [k, ptrs] : p.free) {
      size_t size = k & ((uint64_t(1) << 48) - 1);
      for (void* raw : ptrs) c10::free_cpu(raw);
      g_mem[i].reserved.fetch_sub(static_cast<int64_t>(size * ptrs.size()));
      g_mem[i].cached_blocks.fetch_sub(static_cast<int64_t>(ptrs.size()));
    }
    p.free.clear();
  }
}

c10::DataPtr adopt(c10::DataPtr&& host, size_t nbytes, c10::DeviceIndex index) {
  void* ptr = host.get();
  add_bytes(index, static_cast<int64_t>(nbytes), true);
  int stream = static_cast<int>(current_stream(index).id());
  auto* b = new Block{nbytes, index, stream, nullptr, std::move(host)};
  carry_stale_uses(*b);
  return {ptr, b, &free_block, c10::Device(kSim, index)};
}

REGISTER_ALLOCATOR(kSim, &g_allocator);

}  // namespace sim
