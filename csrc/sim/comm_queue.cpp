// The communicator queue of a sim device, the outputs in flight, and the work of an operation (comm_queue.h).
#include "comm_queue.h"

#include <algorithm>
#include <atomic>
#include <set>
#include <sstream>

namespace sim {
namespace {

Span span_of(const at::Tensor& t) {
  auto lo = reinterpret_cast<uintptr_t>(t.data_ptr());
  int64_t extent = 1;
  for (int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * t.stride(d);
  return {lo, lo + static_cast<uintptr_t>(extent * t.element_size())};
}

// Outputs not yet waited for, across this process.
std::mutex g_flight_mutex;
std::vector<ItemPtr> g_flight;
std::atomic<int> g_flight_count{0};
// Point-to-point operations launched in gloo (under g_flight_mutex): an aborted communicator aborts them.
std::vector<std::weak_ptr<Item>> g_p2p;
size_t g_p2p_pruned = 0;

}  // namespace

void register_flight(const ItemPtr& item) {
  for (auto& [dev, host] : item->back)
    if (dev.numel()) item->spans.push_back(span_of(dev));
  if (item->spans.empty()) return;
  std::lock_guard<std::mutex> lock(g_flight_mutex);
  g_flight.push_back(item);
  g_flight_count.store(static_cast<int>(g_flight.size()));
}

void release_flight(const ItemPtr& item) {
  std::lock_guard<std::mutex> lock(g_flight_mutex);
  if (item->released) return;
  item->released = true;
  for (size_t i = 0; i < g_flight.size(); ++i) {
    if (g_flight[i] != item) continue;
    g_flight.erase(g_flight.begin() + static_cast<std::ptrdiff_t>(i));
    break;
  }
  g_flight_count.store(static_cast<int>(g_flight.size()));
}

void launched(const ItemPtr& item, int device, c10::intrusive_ptr<c10d::Work> inner) {
  std::lock_guard<std::mutex> lock(g_flight_mutex);  // abort_queue reads both under it
  item->device = device;
  item->inner = std::move(inner);
  if (g_p2p.size() >= g_p2p_pruned * 2 + 64) {  // drop the works nobody holds any more (amortized)
    g_p2p.erase(std::remove_if(g_p2p.begin(), g_p2p.end(), [](const auto& w) { return w.expired(); }), g_p2p.end());
    g_p2p_pruned = g_p2p.size();
  }
  g_p2p.push_back(item);
}

namespace {
std::mutex g_raised_mutex;
std::set<std::string> g_raised;  // the reports raised to callers (a few: each breaks a communicator)
}  // namespace

void raise_report(const std::string& report) {
  {
    std::lock_guard<std::mutex> lock(g_raised_mutex);
    g_raised.insert(report);
  }
  TORCH_CHECK(false, report);
}

bool raised_before(const std::string& report) {
  std::lock_guard<std::mutex> lock(g_raised_mutex);
  return g_raised.count(report) > 0;
}

namespace {
std::atomic<int64_t> g_raised_ops[kMaxDevices];
}  // namespace

void note_raised(int device) { g_raised_ops[device].fetch_add(1); }
int64_t raised_ops(int device) { return g_raised_ops[device].load(); }

std::chrono::milliseconds deadlock_bound() {
  static const int64_t ms = [] {
    const char* s = std::getenv("OMNITRON_SIM_DEADLOCK_S");
    return static_cast<int64_t>((s ? std::atof(s) : 60.0) * 1000);
  }();
  return std::chrono::milliseconds(ms);
}

// Never destroyed: a static destructor running at exit would destroy a condition variable a thread waits on.
Queue* const g_queues = new Queue[kMaxDevices];

namespace {

void finish(Queue& q, const ItemPtr& item, const std::string& error) {
  {
    std::lock_guard<std::mutex> lock(q.m);
    if (item->done) return;  // already failed by the deadlock report
  }
  if (error.empty()) item->copy_back();
  record_finish(item->record, error);
  std::lock_guard<std::mutex> lock(q.m);
  item->error = error;
  item->done = true;
  if (error.empty() && item->completed) item->completed->fetch_add(1);  // before a waiter can see it done
  if (!q.items.empty() && q.items.front() == item) q.items.pop_front();
  q.cv.notify_all();
}

}  // namespace

std::string broken_report(Queue& q) {
  std::lock_guard<std::mutex> lock(q.m);
  return q.broken;
}

// Mark the communicator broken with ``message`` and fail what is queued (lock held), as an aborted NCCL
// communicator does: every later collective on the device raises it.
void abort_queue(Queue& q, const std::string& message) {
  q.broken = message;
  q.raised_when_broken = raised_ops(static_cast<int>(&q - g_queues));
  for (auto& item : q.items) {
    item->error = q.broken;
    item->done = true;
    record_finish(item->record, q.broken);
  }
  q.items.clear();
  q.cv.notify_all();
  // The device's point-to-point operations end too (a wait() blocked in gloo returns), and their wait() raises
  // ``message``: a peer that failed never posts their counterparts.
  int index = static_cast<int>(&q - g_queues);
  std::lock_guard<std::mutex> lock(g_flight_mutex);
  for (auto& weak : g_p2p)
    if (auto item = weak.lock(); item && item->device == index) item->inner->abort();
}

namespace {

// Report a deadlock (lock held): the running collective waits for peers stuck behind their own.
// Fails every queued collective and every later one (the communicator is aborted, as NCCL's would be).
void report_deadlock(Queue& q, int index, SteadyClock::duration waited) {
  std::ostringstream os;
  auto s = std::chrono::duration_cast<std::chrono::seconds>(waited).count();
  os << "sim: collective deadlock on sim:" << index << ": " << q.items[0]->describe() << " has waited " << s
     << " s for its peers while " << q.items[1]->describe()
     << " waits behind it (a device runs one communicator kernel at a time, as NCCL may): every rank must issue "
        "collectives on different groups in the same order, from one thread";
  abort_queue(q, os.str());
}

// Runs one collective to completion. gloo's work completes only when waited on (some of its
// collectives are lazy), so the worker blocks in wait() and the watchdog looks for deadlocks.
void run_one(Queue& q, const ItemPtr& item) {
  {
    std::lock_guard<std::mutex> lock(q.m);
    q.started_at = SteadyClock::now();
  }
  std::string error;
  try {
    if (item->gloo) error = exchange_fingerprints(*item->gloo, item->group, item->key, item->site);
    if (error.empty()) item->launch()->wait();
  } catch (const std::exception& e) {
    error = e.what();
  }
  finish(q, item, error);
}

void worker(int index) {
  Queue& q = g_queues[index];
  for (;;) {
    ItemPtr item;
    {
      std::unique_lock<std::mutex> lock(q.m);
      q.cv.wait(lock, [&] { return !q.items.empty() || q.stop; });
      if (q.items.empty()) return;  // stopped with nothing queued
      item = q.items.front();
    }
    run_one(q, item);
  }
}

// Groups this process sent point-to-point on: a receiver that finds the order broken leaves its report under
// ``key`` in the group's store, and the sender's watchdog aborts the sender's communicator with it.
// The key is read on SearchPace's ladder (kFirst doubling to kMost while nothing came, back to kFirst when the
// communicator issues a point-to-point operation or starts its release): an idle group costs its rank one store
// read a second, not ten, and a report still arrives within about a second.
struct ReportPace {
  std::atomic<int64_t> activity{0};  // bumped at each point-to-point operation of the owner (p2p_activity)
  int64_t seen = 0;                  // the rest: the device's watchdog only
  SteadyClock::time_point next = SteadyClock::now() + SearchPace::kFirst;
  std::chrono::milliseconds interval = SearchPace::kFirst;
  bool due(SteadyClock::time_point now) {
    if (int64_t a = activity.load(); a != seen) {
      seen = a;
      interval = SearchPace::kFirst;
      next = std::min(next, now + interval);  // not later: a hot loop of operations must not postpone the check
    }
    if (now < next) return false;
    interval = std::min(interval * 2, SearchPace::kMost);
    next = now + interval;
    return true;
  }
};
struct P2PWatch {
  const void* owner;
  c10::intrusive_ptr<c10d::Store> store;
  std::string key;
  int device;
  std::function<void()> progress;
  std::function<void(const std::string&)> on_report;
  std::shared_ptr<ReportPace> pace = std::make_shared<ReportPace>();
};
std::mutex g_watch_mutex;
std::vector<P2PWatch> g_watches;

// Batched operations whose wait() blocks in gloo before the peer posted the counterpart (SimWork::blocked_inner).
struct BlockedEntry {
  ItemPtr item;
  std::shared_ptr<BlockedWait> blocked;
  int device;
};
std::mutex g_blocked_mutex;
std::vector<BlockedEntry> g_blocked;

// The entries of ``all`` (guarded by ``m``) on device ``index``, copied: polled without the lock.
template <typename T>
std::vector<T> of_device(std::mutex& m, const std::vector<T>& all, int index) {
  std::lock_guard<std::mutex> lock(m);
  std::vector<T> out;
  for (const auto& e : all)
    if (e.device == index) out.push_back(e);
  return out;
}

// On the watchdog: a cycle of blocked waits through one of ``index``'s fails this rank (its communicator aborted,
// which ends the wait in gloo with the report) and, through their watchdogs, the group's other ranks.
void poll_blocked(Queue& q, int index) {
  for (const auto& e : of_device(g_blocked_mutex, g_blocked, index)) {
    CycleReport found;
    try {
      found = e.blocked->poll();
      if (!found.report.empty()) e.item->on_cycle(found);
    } catch (const std::exception&) {  // the store is gone: the job is ending
      return;
    }
    if (found.report.empty()) continue;
    std::lock_guard<std::mutex> lock(q.m);
    if (q.broken.empty()) abort_queue(q, found.report);
    return;
  }
}

// Unbatched waits issued before the peer's counterpart (SimWork::await_pair): the issuing thread blocks in a store
// wait for the pair's wake key (await_pair_place), so the watchdog runs their checks, paced, and wakes them.
struct PairWait {
  std::shared_ptr<BlockedWait> blocked;      // the cycle search of the wait (wait_cycle.cpp)
  std::function<std::string()> early_check;  // a receive's order check against the sender's, while waiting
  std::function<void(const CycleReport&)> on_cycle;
  c10::intrusive_ptr<c10d::Store> store;
  std::string wake;
  SteadyClock::time_point until, next_check;
  std::chrono::milliseconds interval{100};  // the early check's, doubling to 1 s (SearchPace's ladder)
  std::mutex m;
  std::string report;  // what the waiter is woken with ("" at the bound)
  bool woken = false, closed = false;
  // Once, unless the wait ended (close): the key set where absent (a peer's verdict stays), under the lock, so
  // close() sees every write of it done.
  void wake_up(const std::string& found) {
    std::lock_guard<std::mutex> lock(m);
    if (woken || closed) return;
    woken = true;
    report = found;
    try {
      store->compareSet(wake, {}, std::vector<uint8_t>{'w'});
    } catch (const std::exception&) {  // the store is gone: the waiter's own store wait ends too
    }
  }
  // The wait ended: no wake from here on, and one set before is deleted (the waiter may have returned on the
  // peer's verdict first): the wake key does not outlive the wait.
  void close() {
    std::lock_guard<std::mutex> lock(m);
    closed = true;
    if (!woken) return;
    try {
      store->deleteKey(wake);
    } catch (const std::exception&) {  // the store is gone: nothing is left in it
    }
  }
  std::string taken() {
    std::lock_guard<std::mutex> lock(m);
    return report;
  }
};
struct PairWaitEntry {
  std::shared_ptr<PairWait> wait;
  int device;
};
std::mutex g_pair_mutex;
std::vector<PairWaitEntry> g_pair_waits;

// On the watchdog: the device broken, a cycle of blocked waits through one of ``index``'s (its communicator
// aborted), the receive's order check failed (paced on SearchPace's ladder: a legal long wait costs each rank a
// few store operations a second), or the bound passed: the waiter is woken.
void poll_pair_waits(Queue& q, int index) {
  auto now = SteadyClock::now();
  for (const auto& e : of_device(g_pair_mutex, g_pair_waits, index)) {
    PairWait& w = *e.wait;
    std::string report;
    {
      std::lock_guard<std::mutex> lock(q.m);
      report = q.broken;
    }
    try {
      CycleReport found = report.empty() && w.blocked ? w.blocked->poll() : CycleReport{};
      if (!found.report.empty()) {
        w.on_cycle(found);
        std::lock_guard<std::mutex> lock(q.m);
        if (q.broken.empty()) abort_queue(q, found.report);
        report = found.report;
      }
      if (report.empty() && w.early_check && now >= w.next_check) {
        report = w.early_check();
        w.next_check = now + w.interval;
        w.interval = std::min(w.interval * 2, SearchPace::kMost);
      }
    } catch (const std::exception&) {  // the store is gone: the job is ending
      return;
    }
    if (!report.empty() || now >= w.until) w.wake_up(report);
  }
}

void poll_p2p_reports(Queue& q, int index) {
  auto now = SteadyClock::now();
  for (const auto& w : of_device(g_watch_mutex, g_watches, index)) {
    try {
      if (!w.pace->due(now) || !w.store->check({w.key})) continue;
      auto raw = w.store->get(w.key);
      std::string report(raw.begin(), raw.end());
      if (w.on_report) w.on_report(report);
      {
        std::lock_guard<std::mutex> lock(q.m);
        if (q.broken.empty()) abort_queue(q, report);
      }
      w.store->deleteKey(w.key);  // after the break: report_left_unread() sees the key or the broken device
    } catch (const std::exception&) {  // the store is gone: the job is ending
    }
  }
  std::lock_guard<std::mutex> lock(g_watch_mutex);  // held: unwatch_p2p (the communicator's release) waits for it
  for (const auto& w : g_watches)
    if (w.device == index && w.progress) w.progress();
}

// The deadlock bound's report, told to the other members of both groups (the running collective's, whose peers may
// sit in gloo on theirs, and the one behind it): their blocked wait() raises it within about a second, not at
// gloo's timeout. Off the queue's lock (store operations).
void tell_members(const std::vector<std::shared_ptr<CollectiveWait>>& stuck, const std::string& report) {
  for (const auto& c : stuck) {
    try {
      if (c) c->tell(report);
    } catch (const std::exception&) {  // the store is gone: the job is ending
    }
  }
}

void watchdog(int index) {
  Queue& q = g_queues[index];
  for (;;) {
    std::vector<std::shared_ptr<CollectiveWait>> stuck;  // the groups of a deadlock reported here
    std::string report, broken;
    {
      std::unique_lock<std::mutex> lock(q.m);
      if (q.cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return q.stop; })) return;
      auto waited = SteadyClock::now() - q.started_at;
      if (q.broken.empty() && q.items.size() > 1 && waited > deadlock_bound()) {
        stuck = {q.items[0]->cwait, q.items[1]->cwait};
        report_deadlock(q, index, waited);
        report = q.broken;
      }
      broken = q.broken;
    }
    tell_members(stuck, report);
    publish_stuck(index, broken);  // once per report: a peer blocked on an operation this rank never issues raises it
    poll_p2p_reports(q, index);
    poll_blocked(q, index);
    poll_pair_waits(q, index);
  }
}

}  // namespace

void start_threads(Queue& q, int index) {  // lock held
  if (!q.worker.joinable()) {
    q.worker = std::thread(worker, index);
    q.watchdog = std::thread(watchdog, index);
  }
}

void enqueue(int index, const ItemPtr& item) {
  Queue& q = g_queues[index];
  std::lock_guard<std::mutex> lock(q.m);
  if (!q.broken.empty()) {
    note_raised(index);
    raise_report(q.broken);
  }
  for (auto& other : q.items)
    TORCH_CHECK(other->thread == item->thread, "sim: ", item->describe(), " was issued while ", other->describe(),
                " is still queued on sim:", index,
                ": collectives issued from two threads at once reach the device in an order that can differ between "
                "ranks, which deadlocks NCCL; issue them from one thread, or use a gloo (CPU) group in the other");
  q.items.push_back(item);
  start_threads(q, index);
  q.cv.notify_all();
}

void watch_p2p(const void* owner, const c10::intrusive_ptr<c10d::Store>& store, const std::string& key, int index,
               std::function<void()> progress, std::function<void(const std::string&)> on_report) {
  std::lock_guard<std::mutex> lock(g_watch_mutex);
  for (const auto& w : g_watches)
    if (w.owner == owner) return;
  g_watches.push_back({owner, store, key, index, std::move(progress), std::move(on_report)});
  Queue& q = g_queues[index];
  std::lock_guard<std::mutex> qlock(q.m);
  start_threads(q, index);
}

void p2p_activity(const void* owner) {
  std::lock_guard<std::mutex> lock(g_watch_mutex);
  for (const auto& w : g_watches)
    if (w.owner == owner) w.pace->activity.fetch_add(1);
}

bool report_left_unread() {
  std::vector<std::pair<c10::intrusive_ptr<c10d::Store>, std::string>> keys;
  {
    std::lock_guard<std::mutex> lock(g_watch_mutex);
    for (const auto& w : g_watches) keys.emplace_back(w.store, w.key);
  }
  for (const auto& [store, key] : keys) {
    try {
      if (store->check({key})) return true;
    } catch (const std::exception&) {  // the store is gone: the job is ending
    }
  }
  return false;
}

void unwatch_p2p(const void* owner) {
  std::lock_guard<std::mutex> lock(g_watch_mutex);
  auto mine = [&](const P2PWatch& w) { return w.owner == owner; };
  g_watches.erase(std::remove_if(g_watches.begin(), g_watches.end(), mine), g_watches.end());
}

namespace {

// Stop and join one device's communicator threads once what is queued has run. A collective still
// running after the deadlock bound (its peers never came) cannot be interrupted: its threads are
// detached then, and the communicator is marked broken, as an aborted NCCL communicator is.
void stop_queue(Queue& q) {
  std::thread w, d;
  bool drained;
  {
    std::unique_lock<std::mutex> lock(q.m);
    if (!q.worker.joinable()) return;
    drained = q.cv.wait_for(lock, deadlock_bound(), [&] { return q.items.empty(); });
    if (!drained && q.broken.empty())
      q.broken = "sim: the communicator was shut down while " + q.items.front()->describe() + " was still running";
    q.stop = true;
    q.cv.notify_all();
    w = std::move(q.worker);
    d = std::move(q.watchdog);
  }
  d.join();
  if (drained) w.join(); else w.detach();
  std::lock_guard<std::mutex> lock(q.m);
  q.stop = false;  // a later collective starts new threads
}

class SimWork final : public c10d::Work {
 public:
  SimWork(ItemPtr item, int device) : device(device), item_(std::move(item)) {}
  bool wait(std::chrono::milliseconds timeout) override {
    try {
      return wait_for(timeout);
    } catch (...) {
      note_raised(device);
      throw;
    }
  }
  bool wait_for(std::chrono::milliseconds timeout) {
    bool ok = true;
    if (item_->inner) {
      await_pair(timeout);
      if (!settled()) ok = blocked_inner(timeout);
      settle_inner();
    } else {
      wait_queued(timeout);
    }
    release_flight(item_);
    record_wait(item_->record);
    if (!item_->error.empty()) raise_report(item_->error);
    event_block(item_->event, current_stream(device));  // as NCCL's: the current stream waits, the host need not
    return ok;
  }
  bool isCompleted() override {
    bool done;
    if (item_->inner) {
      done = item_->inner->isCompleted();
      if (done) settle_inner();
    } else {
      std::lock_guard<std::mutex> lock(queue_of().m);
      done = item_->done;
    }
    if (done) {
      release_flight(item_);
      record_wait(item_->record);
      event_query(item_->event);  // the host has seen the communicator stream reach it
    }
    return done;
  }
  bool isSuccess() const override { return item_->error.empty(); }
  std::vector<at::Tensor> result() override {
    std::vector<at::Tensor> out;
    for (auto& [dev, host] : item_->back) out.push_back(dev);
    return out;
  }

  const int device;

 private:
  Queue& queue_of() { return g_queues[device]; }
  // A collective: wait until it ran, polling for a cycle of waits across groups (collective_wait.cpp) every
  // kCyclePoll; a bounded wait (strict mode's) reports a deadlock its own way: says "timed out".
  void wait_queued(std::chrono::milliseconds timeout) {
    constexpr std::chrono::milliseconds kCyclePoll{50};
    Queue& q = queue_of();
    auto done = [&] { return item_->done; };
    auto until = SteadyClock::now() + timeout;
    std::unique_lock<std::mutex> lock(q.m);
    while (!q.cv.wait_for(lock, kCyclePoll, done)) {
      if (timeout != kNoTimeout && SteadyClock::now() >= until) {
        lock.unlock();
        if (item_->cwait) item_->cwait->leave();
        TORCH_CHECK(false, "sim: ", item_->describe(), " timed out after ", timeout.count(),
                    " ms waiting for its peers");
      }
      if (!item_->cwait) continue;
      lock.unlock();
      std::string report;
      try {
        report = item_->cwait->poll();
      } catch (const std::exception&) {  // the store is gone: the job is ending
      }
      lock.lock();
      if (!report.empty() && q.broken.empty()) abort_queue(q, report);  // fails this item, and what is queued
    }
    if (item_->cwait) {
      lock.unlock();
      item_->cwait->leave();
      lock.lock();
    }
  }
  bool settled() {
    std::lock_guard<std::mutex> lock(mutex_);
    return item_->done;
  }
  // A batched operation issued before its peer's counterpart (item_->blocked, no pair key): while its wait()
  // blocks in gloo the device's watchdog polls it for a cycle of blocked waits (wait_cycle.cpp).
  bool blocked_inner(std::chrono::milliseconds timeout) {
    if (!item_->blocked || !item_->pair_key.empty()) return wait_inner(timeout);
    std::shared_ptr<BlockedWait> blocked;
    std::swap(blocked, item_->blocked);  // once: a second wait() does not block
    blocked->enter();
    {
      std::lock_guard<std::mutex> lock(g_blocked_mutex);
      g_blocked.push_back({item_, blocked, device});
    }
    auto unregister = [&] {
      std::lock_guard<std::mutex> lock(g_blocked_mutex);
      g_blocked.erase(std::remove_if(g_blocked.begin(), g_blocked.end(),
                                     [&](const BlockedEntry& e) { return e.item == item_; }), g_blocked.end());
      blocked->leave();
    };
    try {
      bool ok = wait_inner(timeout);
      unregister();
      return ok;
    } catch (...) {
      unregister();
      throw;
    }
  }
  // A gloo work waited twice waits for another message: waited once. Aborted with the communicator (abort_queue):
  // raises the report that broke it.
  bool wait_inner(std::chrono::milliseconds timeout) {
    bool ok;
    try {
      ok = item_->inner->wait(timeout);
    } catch (const std::exception&) {
      raise_if_broken();
      throw;
    }
    if (!ok) raise_if_broken();  // gloo's aborted receive returns false
    return ok;
  }
  void raise_if_broken() {
    std::string broken = broken_report(queue_of());
    if (broken.empty()) return;
    release_flight(item_);
    raise_report(broken);
  }
  // Issued before the peer's operation at the same place of the pair's order: block in gloo only once the peer
  // issued a matching one, so a deadlock the peer finds fails this rank too, with the peer's report. The host waits
  // in the store for the peer's claim (no polling: a legal completion wakes it at once); the watchdog runs the
  // checks meanwhile (poll_pair_waits) and wakes it with a report or at the bound.
  void await_pair(std::chrono::milliseconds timeout) {
    std::string key;
    std::swap(key, item_->pair_key);
    if (key.empty()) return;
    auto bound = timeout == kNoTimeout ? deadlock_bound() : timeout;
    auto w = std::make_shared<PairWait>();
    w->blocked = item_->blocked;
    w->early_check = item_->early_check;
    w->on_cycle = item_->on_cycle;
    w->store = item_->pair_store;
    w->wake = wake_key(key);
    w->next_check = SteadyClock::now() + SearchPace::kFirst;
    w->until = SteadyClock::now() + bound + std::chrono::milliseconds(20);  // after the waiter's own deadline
    if (w->blocked) w->blocked->enter();
    {
      std::lock_guard<std::mutex> lock(g_pair_mutex);
      g_pair_waits.push_back({w, device});
    }
    std::string report;
    auto done = [&] {
      {
        std::lock_guard<std::mutex> lock(g_pair_mutex);
        g_pair_waits.erase(std::remove_if(g_pair_waits.begin(), g_pair_waits.end(),
                                          [&](const PairWaitEntry& e) { return e.wait == w; }), g_pair_waits.end());
      }
      w->close();
      if (w->blocked) w->blocked->leave();
    };
    try {
      report = await_pair_place(*item_->pair_store, key, bound, [&w] { return w->taken(); });
    } catch (...) {
      done();
      throw;
    }
    done();
    item_->blocked.reset();  // the counterpart was posted (or the bound passed): gloo's wait is not watched
    if (report.empty()) return;
    release_flight(item_);
    raise_report(report);
  }
  void settle_inner() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (item_->done) return;
    if (item_->on_settle) item_->error = item_->on_settle();
    if (item_->error.empty()) item_->copy_back();
    item_->done = true;
    record_finish(item_->record, item_->error);
  }
  ItemPtr item_;
  std::mutex mutex_;
};

}  // namespace

c10::intrusive_ptr<c10d::Work> sim_work(ItemPtr item, int device) {
  return c10::make_intrusive<SimWork>(std::move(item), device);
}

void check_not_in_flight(const at::Tensor& t, const char* op) {
  if (g_flight_count.load(std::memory_order_relaxed) == 0 || !t.defined() || t.numel() == 0) return;
  Span a = span_of(t);
  std::lock_guard<std::mutex> lock(g_flight_mutex);
  for (const auto& item : g_flight)
    for (const auto& b : item->spans)
      TORCH_CHECK(a.hi <= b.lo || b.hi <= a.lo, "sim: ", op, " touched the output of ", item->describe(),
                  " before its work.wait(): a collective's result is valid only after wait() (or a device "
                  "synchronize)");
}

void synchronize_collectives() {
  for (int i = 0; i < kMaxDevices; ++i) {
    Queue& q = g_queues[i];
    std::unique_lock<std::mutex> lock(q.m);
    q.cv.wait(lock, [&] { return q.items.empty(); });
  }
  std::vector<ItemPtr> done;
  {
    std::lock_guard<std::mutex> lock(g_flight_mutex);
    for (auto& item : g_flight)
      if (!item->inner) done.push_back(item);
  }
  for (auto& item : done) release_flight(item);
}

void stop_collective_workers() {
  for (int i = 0; i < kMaxDevices; ++i) stop_queue(g_queues[i]);
}

}  // namespace sim
