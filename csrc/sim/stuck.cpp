// Members that never issue again (declared in comm.h): a rank whose device broke with a report, or a member that
// released its group.
//
// Told reports (collective_wait.cpp) reach the members of the stuck groups only. A rank blocked in wait() on an
// operation of another group -- a receive whose sender sits in a deadlocked all-reduce elsewhere -- was told nothing
// and waited for the full timeout, although on NCCL it hangs behind the sender for good. Here a broken device
// publishes its report in every group its process is a member of ("S<completed>\t<report>" under gone_key), once, from
// the device's watchdog (or at a communicator's release, whichever comes first), and a release publishes "R" where
// nothing was: a peer's blocked wait whose counterpart that member never posted raises it at its next search
// (BlockedWait::poll, CollectiveWait::poll), since each bump of the version counters makes a search due.
// A report a peer left for this rank (report_left_unread: a point-to-point deadlock, a cycle told to the group) comes
// first: the watchdog breaks this rank's device with it, the same failure said once, not wrapped in a stuck peer's.
// Sound: a broken device raises from every later operation (enqueue, check_unbroken), so a member published stuck
// issues nothing more, and a released group takes no operation. ASSUMED, as the cycle searches do: one device per
// rank (a rank whose one device broke could go on issuing on another). Costs a few store operations per group when a
// device breaks and two at each release; nothing while the job runs.
#include "comm.h"
#include "comm_queue.h"

#include <algorithm>
#include <map>
#include <mutex>

namespace sim {
namespace {

const char kAbsent[] = "\x01";  // compareSet's answer for a key that does not exist (its expected value)

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

struct Member {
  const void* owner;
  c10::intrusive_ptr<c10d::Store> store;
  std::string group;
  int rank;
  std::function<int64_t()> completed;  // the group's collectives its device completed (see comm.h)
};
std::mutex g_members_mutex;
std::vector<Member> g_members;  // this process's communicators of groups of two or more
std::map<int, std::string> g_published;  // per device: the report published (under g_members_mutex)

// Set ``key`` to ``value`` where absent (a stuck report stays: it says more than a release), then make the blocked
// waits of the group (and of the job: collective waits) search again.
void publish_once(c10d::Store& store, int rank, const std::string& value) {
  store.compareSet(gone_key(rank), {}, bytes(value));
  store.add(kBlockedVersion, 1);
  job_store(c10::intrusive_ptr<c10d::Store>::reclaim_copy(&store))->add(kCollectiveVersion, 1);
}

}  // namespace

std::string gone_key(int rank) { return "simccl/gone/" + std::to_string(rank); }

void remember_member(const void* owner, c10::intrusive_ptr<c10d::Store> store, std::string group, int rank,
                     std::function<int64_t()> completed) {
  std::lock_guard<std::mutex> lock(g_members_mutex);
  g_members.push_back({owner, std::move(store), std::move(group), rank, std::move(completed)});
}

void forget_member(const void* owner) {
  std::lock_guard<std::mutex> lock(g_members_mutex);
  g_members.erase(std::remove_if(g_members.begin(), g_members.end(), [&](const Member& m) { return m.owner == owner; }),
                  g_members.end());
}

void publish_stuck(int index, const std::string& report) {
  std::vector<std::pair<Member, int64_t>> to_tell;  // copied with each member's count: told off the lock
  {
    std::lock_guard<std::mutex> lock(g_members_mutex);
    auto& published = g_published[index];
    if (report.empty() || published == report) return;
    published = report;
    for (const auto& m : g_members) to_tell.emplace_back(m, m.completed());
  }
  for (const auto& [m, completed] : to_tell) {
    try {
      publish_once(*m.store, m.rank, "S" + std::to_string(completed) + "\t" + report);
    } catch (const std::exception&) {  // the store is gone: the job is ending
    }
  }
}

void publish_broken_devices() {
  for (int i = 0; i < kMaxDevices; ++i) publish_stuck(i, broken_report(g_queues[i]));
}

void publish_gone(c10d::Store& store, int rank) { publish_once(store, rank, "R"); }

Gone member_gone(c10d::Store& store, int rank) {
  auto got = store.compareSet(gone_key(rank), bytes(kAbsent), bytes(kAbsent));
  std::string value(got.begin(), got.end());
  Gone g;
  if (value == "R") {
    g.released = true;
  } else if (!value.empty() && value[0] == 'S') {
    auto tab = value.find('\t');
    g.stuck = tab != std::string::npos;
    if (g.stuck) {
      g.completed = std::stoll(value.substr(1, tab - 1));
      g.report = value.substr(tab + 1);
    }
  }
  return g;
}

}  // namespace sim
