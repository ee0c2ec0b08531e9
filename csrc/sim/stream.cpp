// Streams and events of the sim accelerator: the order work may run in, checked like a race detector.
//
// The model (documented in omnitron/backends/sim/backend.py): a kernel (an op on sim tensors) runs on the
// host when it is issued, so its data is final at once; what the device would do later is modelled by
// *order*. Each stream counts the kernels issued on it; each stream carries a vector clock of how far it
// is ordered after every other stream of its device (raised by Event.wait / Stream.wait_stream), and
// the host carries one of how far it has observed each stream (raised by synchronize, Event.synchronize
// and a query that says done). Compute never completes on its own: a stream is "done" up to a point
// only once the host or another stream has waited for it (the worst case a GPU allows), so a missing
// wait is found every time, not when a race happens to lose.
//
// Asynchronous work that has a visible effect on the host -- a non_blocking device-to-host copy into
// pinned memory -- is queued on a worker thread per device, which performs it after a delay
// (OMNITRON_SIM_ASYNC_DELAY_MS, default 50) unless the host waits for it first; until then the
// destination holds 0xff bytes (NaN), so a host read before synchronizing shows garbage.
#include "sim.h"

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <thread>

namespace sim {
namespace {

using SteadyClock = std::chrono::steady_clock;

struct AsyncItem {
  int stream;
  uint64_t ticket;
  SteadyClock::time_point ready;
  std::function<void()> fn;
};

struct StreamState {
  std::atomic<uint64_t> ops{0};  // kernels issued on this stream
  Clock known;                   // how far this stream is ordered after each stream of the device
  uint64_t async_issued = 0, async_done = 0;
};

struct DeviceState {
  std::mutex m;
  std::condition_variable cv;
  StreamState streams[kStreams];
  Clock host;  // how far the host has observed each stream
  std::deque<AsyncItem> queue;
  int hurry = 0;  // host threads waiting: the worker runs queued items without their delay
  bool stop = false;  // shutdown: run what is queued without delay, then end
  std::thread worker;
  std::atomic<int> next_pool{0};
};

// Never destroyed: a static destructor running at exit would destroy a condition variable a worker waits on.
DeviceState* const g_devices = new DeviceState[kMaxDevices];
thread_local int64_t g_current_stream[kMaxDevices] = {};

std::chrono::milliseconds async_delay() {
  static const int ms = [] {
    const char* s = std::getenv("OMNITRON_SIM_ASYNC_DELAY_MS");
    return s ? std::atoi(s) : 50;
  }();
  return std::chrono::milliseconds(ms);
}

void worker_loop(DeviceState* d) {
  std::unique_lock<std::mutex> lock(d->m);
  for (;;) {
    if (d->queue.empty()) {
      if (d->stop) return;
      d->cv.wait(lock);
      continue;
    }
    AsyncItem& head = d->queue.front();
    if (d->hurry == 0 && !d->stop && SteadyClock::now() < head.ready) {
      d->cv.wait_until(lock, head.ready);
      continue;
    }
    AsyncItem item = std::move(head);
    d->queue.pop_front();
    lock.unlock();
    item.fn();
    // NOTE: destroy the callable (its captured tensors) before taking the lock: dropping the last reference
    // to a tensor with a Python object takes the GIL, and a Python thread holding the GIL may be waiting for
    // this lock (an event record from an autograd hook): a lock-order inversion that hangs both
    item.fn = nullptr;
    lock.lock();
    d->streams[item.stream].async_done = item.ticket;
    d->cv.notify_all();
  }
}

DeviceState& device_state(c10::DeviceIndex index) {
  check_index(index);
  return g_devices[index];
}

int stream_index(const c10::Stream& s) {
  auto id = s.id();
  TORCH_CHECK(id >= 0 && id < kStreams, "sim: unknown stream id ", id);
  return static_cast<int>(id);
}

// Block the host until stream ``s``'s async work up to ``ticket`` is done (lock held).
void wait_async(DeviceState& d, std::unique_lock<std::mutex>& lock, int s, uint64_t ticket) {
  if (d.streams[s].async_done >= ticket) return;
  ++d.hurry;
  d.cv.notify_all();
  d.cv.wait(lock, [&] { return d.streams[s].async_done >= ticket; });
  --d.hurry;
}

// The host has waited for stream ``s`` up to its current point (lock held).
void observe_stream(DeviceState& d, int s) {
  d.host.merge(d.streams[s].known);
  d.host.v[s] = std::max(d.host.v[s], d.streams[s].ops.load());
}

}  // namespace

// ---- current stream ----------------------------------------------------------------------------
c10::Stream current_stream(c10::DeviceIndex index) {
  if (index < 0) index = current_device();
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(kSim, index), g_current_stream[index]);
}

c10::Stream exchange_stream(const c10::Stream& s) {
  auto index = s.device_index() < 0 ? current_device() : s.device_index();
  check_index(index);
  auto old = current_stream(index);
  g_current_stream[index] = stream_index(s);
  return old;
}

c10::Stream pool_stream(c10::DeviceIndex index) {
  if (index < 0) index = current_device();
  int id = 1 + device_state(index).next_pool.fetch_add(1) % kPoolStreams;  // 32 pool streams, as CUDA has
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(kSim, index), id);
}

uint64_t note_kernel(c10::DeviceIndex index) {
  return g_devices[index].streams[g_current_stream[index]].ops.fetch_add(1) + 1;
}

bool ordered_after(c10::DeviceIndex index, int stream, int other, uint64_t point) {
  DeviceState& d = device_state(index);
  std::lock_guard<std::mutex> lock(d.m);
  return d.streams[stream].known.v[other] >= point || d.host.v[other] >= point;
}

uint64_t stream_point(c10::DeviceIndex index, int stream) { return device_state(index).streams[stream].ops.load(); }

uint64_t comm_kernel(c10::DeviceIndex index, int comm) {
  DeviceState& d = device_state(index);
  auto cur = g_current_stream[index];
  std::lock_guard<std::mutex> lock(d.m);
  StreamState& c = d.streams[comm];
  c.known.merge(d.streams[cur].known);
  c.known.v[cur] = std::max(c.known.v[cur], d.streams[cur].ops.load());
  return c.ops.fetch_add(1) + 1;
}

Clock stream_clock(c10::DeviceIndex index, int stream) {
  DeviceState& d = device_state(index);
  std::lock_guard<std::mutex> lock(d.m);
  Clock c = d.streams[stream].known;
  c.merge(d.host);
  return c;
}

Clock host_clock(c10::DeviceIndex index) {
  DeviceState& d = device_state(index);
  std::lock_guard<std::mutex> lock(d.m);
  return d.host;
}

void host_waits_current(c10::DeviceIndex index) {
  DeviceState& d = device_state(index);
  std::lock_guard<std::mutex> lock(d.m);
  observe_stream(d, static_cast<int>(g_current_stream[index]));
}

// ---- async work --------------------------------------------------------------------------------
void enqueue_async(c10::DeviceIndex index, std::function<void()> fn) {
  DeviceState& d = device_state(index);
  int s = static_cast<int>(g_current_stream[index]);
  std::lock_guard<std::mutex> lock(d.m);
  if (!d.worker.joinable()) d.worker = std::thread(worker_loop, &d);
  uint64_t ticket = ++d.streams[s].async_issued;
  d.queue.push_back({s, ticket, SteadyClock::now() + async_delay(), std::move(fn)});
  d.cv.notify_all();
}

void stop_async_workers() {
  for (int i = 0; i < kMaxDevices; ++i) {
    DeviceState& d = g_devices[i];
    std::thread worker;
    {
      std::lock_guard<std::mutex> lock(d.m);
      if (!d.worker.joinable()) continue;
      d.stop = true;
      worker = std::move(d.worker);
      d.cv.notify_all();
    }
    worker.join();  // it performs what is queued (copies into live host memory), then returns
    std::lock_guard<std::mutex> lock(d.m);
    d.stop = false;  // a later async copy starts a new worker
  }
}

// ---- events ------------------------------------------------------------------------------------
namespace {

struct SimEvent {
  c10::DeviceIndex device = -1;
  int stream = 0;
  Clock clock;
  uint64_t ticket = 0;
  SteadyClock::time_point time;
};

}  // namespace

void event_record(void** event, const c10::Stream& stream) {
  if (*event == nullptr) *event = new SimEvent();
  auto* e = static_cast<SimEvent*>(*event);
  DeviceState& d = device_state(stream.device_index());
  int s = stream_index(stream);
  std::lock_guard<std::mutex> lock(d.m);
  e->device = stream.device_index();
  e->stream = s;
  e->clock = d.streams[s].known;
  e->clock.v[s] = d.streams[s].ops.load();
  e->ticket = d.streams[s].async_issued;
  e->time = SteadyClock::now();
}

void event_block(void* event, const c10::Stream& stream) {
  if (event == nullptr) return;  // an event never recorded: nothing to wait for (as CUDA)
  auto* e = static_cast<SimEvent*>(event);
  DeviceState& d = device_state(stream.device_index());
  std::lock_guard<std::mutex> lock(d.m);
  d.streams[stream_index(stream)].known.merge(e->clock);
}

bool event_query(void* event) {
  if (event == nullptr) return true;
  auto* e = static_cast<SimEvent*>(event);
  DeviceState& d = device_state(e->device);
  std::lock_guard<std::mutex> lock(d.m);
  if (d.streams[e->stream].async_done < e->ticket) return false;
  d.host.merge(e->clock);
  return true;
}

void event_synchronize(void* event) {
  if (event == nullptr) return;
  auto* e = static_cast<SimEvent*>(event);
  DeviceState& d = device_state(e->device);
  std::unique_lock<std::mutex> lock(d.m);
  wait_async(d, lock, e->stream, e->ticket);
  d.host.merge(e->clock);
}

void event_destroy(void* event) { delete static_cast<SimEvent*>(event); }

double event_elapsed_ms(void* start, void* end) {
  TORCH_CHECK(start && end, "sim: elapsed_time needs both events recorded");
  auto* a = static_cast<SimEvent*>(start);
  auto* b = static_cast<SimEvent*>(end);
  event_synchronize(end);
  return std::chrono::duration<double, std::milli>(b->time - a->time).count();
}

// ---- synchronization ---------------------------------------------------------------------------
bool stream_query(const c10::Stream& stream) {
  DeviceState& d = device_state(stream.device_index());
  int s = stream_index(stream);
  std::lock_guard<std::mutex> lock(d.m);
  if (d.streams[s].async_done < d.streams[s].async_issued) return false;
  observe_stream(d, s);
  return true;
}

void stream_synchronize(const c10::Stream& stream) {
  DeviceState& d = device_state(stream.device_index());
  int s = stream_index(stream);
  std::unique_lock<std::mutex> lock(d.m);
  wait_async(d, lock, s, d.streams[s].async_issued);
  observe_stream(d, s);
}

void device_synchronize(c10::DeviceIndex index) {
  if (index < 0) index = current_device();
  DeviceState& d = device_state(index);
  std::unique_lock<std::mutex> lock(d.m);
  for (int s = 0; s < kStreams; ++s) wait_async(d, lock, s, d.streams[s].async_issued);
  for (int s = 0; s < kStreams; ++s) observe_stream(d, s);
}

// ---- deferred errors ---------------------------------------------------------------------------
namespace {
std::mutex g_error_mutex;
std::string g_error;
std::atomic<bool> g_has_error{false};
}  // namespace

void defer_error(const std::string& message) {
  std::lock_guard<std::mutex> lock(g_error_mutex);
  if (g_error.empty()) g_error = message;
  g_has_error.store(true);
}

void check_deferred() {
  if (!g_has_error.load(std::memory_order_relaxed)) return;
  std::string message;
  {
    std::lock_guard<std::mutex> lock(g_error_mutex);
    message.swap(g_error);
    g_has_error.store(false);
  }
  if (!message.empty()) TORCH_CHECK(false, message);
}

}  // namespace sim
