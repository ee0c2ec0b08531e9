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
#include <vector>

namespace sim {

constexpr int kMaxDevices = 16;
constexpr c10::DeviceType kSim = c10::DeviceType::PrivateUse1;

// ---- devices (device.cpp) -------------------------------------------------------------
c10::DeviceIndex device_count();
void set_device_count(int n);
c10::DeviceIndex current_device();
void set_current_device(c10::DeviceIndex index);
void check_index(c10::DeviceIndex index);

// ---- streams and events (stream.cpp) ----------------------------------------------------
// Per device: id 0 is the default stream, 1..32 the pool (as CUDA's), then simccl's communicator streams
// (a communicator takes slot ``n % kCommStreams``: two sharing one are ordered, which hides, never invents, a race).
constexpr int kPoolStreams = 32, kCommStreams = 8;
constexpr int kFirstComm = 1 + kPoolStreams, kStreams = kFirstComm + kCommStreams;
// A vector clock over the streams of one device: v[s] = how many of stream s's kernels are ordered before.
struct Clock {
  uint64_t v[kStreams] = {};
  void merge(const Clock& o) {
    for (int i = 0; i < kStreams; ++i) v[i] = v[i] < o.v[i] ? o.v[i] : v[i];
  }
};
c10::Stream current_stream(c10::DeviceIndex index);
c10::Stream exchange_stream(const c10::Stream& s);  // returns the previous current stream
c10::Stream pool_stream(c10::DeviceIndex index);
uint64_t note_kernel(c10::DeviceIndex index);  // a kernel issued on the current stream: its point there
uint64_t stream_point(c10::DeviceIndex index, int stream);
// A kernel on communicator stream ``comm``, which first waits for the current stream's work: its point there.
uint64_t comm_kernel(c10::DeviceIndex index, int comm);
// The clock a kernel on ``stream`` is ordered after (its waits, and what the host observed before issuing it).
Clock stream_clock(c10::DeviceIndex index, int stream);
Clock host_clock(c10::DeviceIndex index);  // how far the host has observed each stream
void host_waits_current(c10::DeviceIndex index);  // a blocking copy to the host: the host observed the current stream
// Whether ``stream`` (or the host) is ordered after ``other`` reached ``point``.
bool ordered_after(c10::DeviceIndex index, int stream, int other, uint64_t point);
void enqueue_async(c10::DeviceIndex index, std::function<void()> fn);  // on the current stream, after a delay
void event_record(void** event, const c10::Stream& stream);
void event_block(void* event, const c10::Stream& stream);
bool event_query(void* event);
void event_synchronize(void* event);
void event_destroy(void* event);
double event_elapsed_ms(void* start, void* end);
bool stream_query(const c10::Stream& stream);
void stream_synchronize(const c10::Stream& stream);
void device_synchronize(c10::DeviceIndex index);

// ---- errors found where they cannot be raised (a tensor's deleter) -----------------------------
void defer_error(const std::string& message);  // raised by the next check_deferred()
void check_deferred();

// ---- collectives in flight (collectives.cpp) ---------------------------------------------------
// Raise when ``t`` overlaps the output of a collective not yet waited for (``op``: the kernel touching it).
void check_not_in_flight(const at::Tensor& t, const char* op);
void synchronize_collectives();  // the host waits for every collective of this process
// Join the communicator threads once their queues have run (the last communicator's shutdown, and exit).
void stop_collective_workers();
// Join the asynchronous-copy workers once their queues have run (stream.cpp; at exit).
void stop_async_workers();

// ---- the happens-before race detector (race.cpp) ---------------------------------------------
struct History;                  // the accesses to one allocation block
void drop_history(History* h);   // the block was freed
History** history_slot(const c10::Storage& storage);  // allocator.cpp: the block's, nullptr if not a sim block
void name_comm_stream(c10::DeviceIndex index, int stream, const std::string& group);
// (accesses recorded, conflicts with another stream's access found ordered): what the detector has checked.
std::pair<int64_t, int64_t> race_stats();
enum class Use : uint8_t { read, write };
// One kernel's accesses to device memory, checked against the earlier kernels of other streams (check) and
// then recorded (commit). A kernel on ``stream`` at ``point``; ``op`` must outlive the process (a schema
// name or a literal).
class Kernel {
 public:
  Kernel(c10::DeviceIndex index, int stream, uint64_t point, const char* op)
      : index_(index), stream_(stream), point_(point), op_(op) {}
  void use(const at::Tensor& t, Use u);
  // raise (one line naming both kernels, both streams and the fix) on an unordered conflict; a second call checks
  // only the accesses added since (a kernel's fresh results, known once it has run)
  void check();
  void commit();  // record the accesses: later kernels are checked against them
  // Drop the accesses to the block whose history is ``slot``: the block is about to be freed (a CPU kernel gave its
  // storage new memory), and commit() must not write into it.
  void forget(History** slot);
  c10::DeviceIndex device() const { return index_; }
  uint64_t point() const { return point_; }

 private:
  struct Access {
    History** slot;
    uint64_t lo, hi;
    size_t nbytes;
    Use use;
  };
  c10::DeviceIndex index_;
  int stream_;
  uint64_t point_;
  const char* op_;
  std::vector<Access> accesses_;
  size_t checked_ = 0;
};
// A fresh block (``slot``, ``nbytes``) allocated on stream ``freed_on`` after a tensor of ``freed`` bytes
// allocated there was freed while stream ``stream``'s kernel ``op`` at ``point`` may still have been using it: the
// block may hold that tensor's bytes (a GPU's caching allocator splits and merges blocks), so a kernel touching it
// must be ordered after that use.
void note_freed_use(History** slot, size_t nbytes, int stream, uint64_t point, const char* op, size_t freed,
                    int freed_on);

// ---- memory (allocator.cpp) -----------------------------------------------------------
struct MemoryStats {
  int64_t allocated, peak, allocations, reserved, peak_reserved, inactive_split, cached_blocks;
};
void empty_cache();
// A kernel on the current stream uses the memory of ``storage`` (its point on the stream: ``point``).
void note_use(const c10::Storage& storage, uint64_t point, const char* op);
void record_stream(const c10::DataPtr& data, const c10::Stream& stream);
// ---- pinned host memory (pinned.cpp) ----------------------------------------------------
c10::Allocator* pinned_allocator();
bool is_pinned(const void* ptr);
// Protect the whole pages of [data, data + nbytes) until release_guard: an access prints ``message``
// and ends the process. Returns the guard (-1: nothing protected).
int guard_pages(void* data, size_t nbytes, const std::string& message);
void release_guard(int guard);
// (call site, thread) of the Python code running now (collectives.cpp's hook).
std::pair<std::string, std::string> python_site();
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
