// The communicator queue of a sim device (comm_queue.cpp): one collective kernel runs at a time per device, in
// issue order, on a worker thread; a watchdog reports deadlocks. Also the outputs in flight (not yet waited for)
// and the work a sim operation returns.
#pragma once

#include "comm.h"
#include "sim.h"

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace sim {

using SteadyClock = std::chrono::steady_clock;
constexpr std::chrono::milliseconds kNoTimeout{0};  // c10d's "no timeout"

// ---- one collective -----------------------------------------------------------------------------
struct Span {
  uintptr_t lo, hi;
};

struct Item {
  std::string op, group, site, thread;
  std::function<c10::intrusive_ptr<c10d::Work>()> launch;
  int64_t record = -1;                     // its flight record (comm_check.cpp)
  c10::intrusive_ptr<c10d::Backend> gloo;  // strict mode: exchange ``key`` on it before launching
  std::string key;
  std::function<std::string()> on_settle;  // p2p receive: the order check, once it completed ("" = fine)
  std::function<std::string()> early_check;  // the same check before, once the send was issued ("" = fine)
  std::vector<std::pair<at::Tensor, at::Tensor>> back;
  std::vector<Span> spans;
  c10::intrusive_ptr<c10d::Work> inner;  // p2p: launched at once
  int device = -1;                        // p2p: the device whose communicator it runs on
  std::string pair_key;                   // unbatched p2p issued before the peer's counterpart (pair_order.cpp)
  c10::intrusive_ptr<c10d::Store> pair_store;
  std::shared_ptr<BlockedWait> blocked;  // with pair_key: a cycle of waits through it (wait_cycle.cpp)
  std::function<void(const CycleReport&)> on_cycle;  // such a cycle found here: the group's other ranks told
  std::shared_ptr<CollectiveWait> cwait;  // a collective: a cycle of waits across groups through it
  std::shared_ptr<std::atomic<int64_t>> completed;  // a collective: its communicator's count, bumped once it ran
  bool done = false, released = false;
  std::string error;
  void* event = nullptr;  // recorded on the communicator stream after its kernel: what wait() orders after

  ~Item() { event_destroy(event); }

  std::string describe() const {
    return op + " on group '" + group + "' (issued at " + site + ", thread " + thread + ")";
  }
  void copy_back() {
    InternalCopy internal;
    for (auto& [dev, host] : back) dev.copy_(host);
    back.clear();
  }
};
using ItemPtr = std::shared_ptr<Item>;

// Outputs not yet waited for, across this process: a kernel touching one raises (check_not_in_flight).
void register_flight(const ItemPtr& item);
void release_flight(const ItemPtr& item);
// A point-to-point operation launched in gloo on ``device``'s communicator (``inner``: gloo's work).
void launched(const ItemPtr& item, int device, c10::intrusive_ptr<c10d::Work> inner);

// ---- the communicator queue of one device ----------------------------------------------------------
std::chrono::milliseconds deadlock_bound();  // OMNITRON_SIM_DEADLOCK_S

struct Queue {
  std::mutex m;
  std::condition_variable cv;
  std::deque<ItemPtr> items;  // front: the collective running; the rest wait behind it
  std::thread worker, watchdog;  // started by the first collective, joined by stop_collective_workers()
  bool stop = false;
  std::string broken;
  int64_t raised_when_broken = 0;  // raised_ops of the device when it broke (abort_queue)
  SteadyClock::time_point started_at;  // when the running collective was launched
};
extern Queue* const g_queues;  // one per device (comm_queue.cpp)

// Mark the communicator broken with ``message`` and fail what is queued (lock held), as an aborted NCCL
// communicator does: every later collective on the device raises it.
void abort_queue(Queue& q, const std::string& message);
// The device's report once it is broken, else "" (read under the queue's lock).
std::string broken_report(Queue& q);
void start_threads(Queue& q, int index);      // lock held: the worker and the watchdog, once
void enqueue(int index, const ItemPtr& item);  // raises when the device is broken or another thread's is queued

// A receiver that finds the point-to-point order broken leaves its report under ``key`` in ``store``; the
// watchdog of ``index`` aborts that communicator with it. ``owner``: the communicator watching (one entry each).
// ``progress``: called by the watchdog at each poll too (the replay of all ranks' batches, cycle.cpp), never after
// unwatch_p2p returned.
// ``on_report``: told each report read under ``key`` (it belongs to ``owner``'s group). The key is read on
// SearchPace's backoff, reset by p2p_activity.
void watch_p2p(const void* owner, const c10::intrusive_ptr<c10d::Store>& store, const std::string& key, int index,
               std::function<void()> progress = {}, std::function<void(const std::string&)> on_report = {});
void unwatch_p2p(const void* owner);
// ``owner`` issued a point-to-point operation or begins its release: its report key is read soon (the watchdog reads
// an idle communicator's on SearchPace's backoff).
void p2p_activity(const void* owner);

// Raise ``report`` (a broken communicator's, a deadlock's) to the caller, remembered as raised in this process: a
// communicator's release raises a report that reached it only when no operation raised it before (raised_before).
[[noreturn]] void raise_report(const std::string& report);
bool raised_before(const std::string& report);
// Operations on device ``device`` that raised, whatever the error (a report, gloo's, a timeout): a report noted
// before one of them raised (or on a device another report broke before it raised) is spent, the job's error
// already said (collectives.cpp, OwnReport).
void note_raised(int device);
int64_t raised_ops(int device);

// The key the first of a pair's unbatched operations waits on (await_pair_place): set by the peer when it claims
// the place, or by the watchdog when the wait must end (a report, the bound).
std::string wake_key(const std::string& key);

// The work an operation returns: waits for it in the queue, or for its point-to-point counterpart.
c10::intrusive_ptr<c10d::Work> sim_work(ItemPtr item, int device);

}  // namespace sim
