// Cycles of wait() on collectives across groups (declared in comm.h).
//
// NCCL runs a group's k-th collective once every member issued it (each communicator runs its collectives in the
// order issued, on its own stream), and a host blocked in wait() issues nothing more. Rank 0 waiting on group A's
// all-reduce that rank 1 issues only after its wait on group B's all-reduce, which rank 0 issues only after its
// own wait, is a cycle: NCCL hangs. On sim each rank's collectives run on its device's queue, so neither queue ever
// holds two items (the bound's report, comm_queue.cpp, needs one waiting behind another) and the job hung silently.
//
// Model: rank r blocked in wait() on the k-th collective of group G waits for every member of G that has issued
// fewer than k of G's collectives; a member that is itself blocked in wait() issues none before its own wait ends.
// A wait blocked longer than kQuiet publishes its record in the job's store ("simccl/cwait/<global rank>": an
// episode number, G, k, the operation, and this process's count of issued collectives per group, frozen while it
// is blocked) and follows the members' records; a chain of such waits that returns to this rank is reported by its
// lowest rank once every record was read twice, the same both times: at one instant (between the passes) every
// rank of the cycle was blocked and none had issued what the previous one waits for; none ever will. Every
// change of a record bumps "simccl/cwait/version"; a poll whose version is the last search's searches nothing and
// backs off (SearchPace, comm.h): a legal long wait costs each rank two reads a second, not one per member every
// 0.1 s, and a cycle is reported within about a second of closing. ASSUMED, as
// in wait_cycle.cpp: one thread issues a rank's collectives on the sim device (a second thread issuing the awaited
// collective while the first is blocked would make a report false). A wait that is not blocked for kQuiet costs
// no store traffic; a collective costs one counter update. A member that released the group (destroy_process_group)
// before issuing the collective waited on is reported at the next search too (its release bumps the version); the
// last member to release deletes the group's records, and a group made again under the same name (new_group(...,
// use_local_synchronization=True) names a group by its ranks) is another group here: its store and name carry its
// incarnation (omnitron/backends/sim/device.py), so it never reads the destroyed one's records. A report found by
// one rank and told to the others names the group and the collective stuck there: a told rank raises it from a
// wait on that collective or a later one of that group only (on NCCL it hangs there, and nowhere else).
#include "comm.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <sstream>

namespace sim {
namespace {

constexpr std::chrono::milliseconds kQuiet{100};
const char kAbsent[] = "\x01";
const char* const kVersionKey = kCollectiveVersion;  // bumped at every change of a record (and by stuck.cpp)

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

std::string peek(c10d::Store& store, const std::string& key) {  // the value, or kAbsent (never blocks)
  auto got = store.compareSet(key, bytes(kAbsent), bytes(kAbsent));
  return {got.begin(), got.end()};
}

std::string record_key(int global) { return "simccl/cwait/" + std::to_string(global); }
std::string member_key(int rank) { return "simccl/global_rank/" + std::to_string(rank); }
std::string released_key(int rank) { return "simccl/released/" + std::to_string(rank); }
const char kReleasesKey[] = "simccl/releases";  // in the group's store: how many members released it
// A report told to rank ``global`` about ``group``'s collectives from the ``k``-th on: "<k>\t<report>".
std::string told_key(int global, const std::string& group) {
  return "simccl/cdeadlock/" + std::to_string(global) + "/" + group;
}
int64_t told_from(const std::string& told) {  // the first collective a told report concerns; -1: none told
  auto tab = told.find('\t');
  return tab == std::string::npos ? -1 : std::stoll(told.substr(0, tab));
}

// Tell ``report`` to rank ``global`` about ``group``'s collectives from the ``k``-th on, unless an earlier one of
// the group was told already (two of a group's collectives stuck on one device: the first is where it hangs).
void tell_one(c10d::Store& job, int global, const std::string& group, int64_t k, const std::string& report) {
  int64_t was = told_from(peek(job, told_key(global, group)));
  if (was < 0 || k < was) job.set(told_key(global, group), bytes(std::to_string(k) + '\t' + report));
}

std::mutex g_issued_mutex;
std::map<std::string, int64_t> g_issued;  // this process's collectives issued per group
std::atomic<int64_t> g_episode{0};

struct Record {
  std::string group, op, raw;
  int64_t k = -1;
  std::vector<int> members;          // the group's members, global ranks
  std::map<std::string, int64_t> issued;
};

// "<episode>\t<group>\t<k>\t<members a,b>\t<op>\t<group>\x1f<n>\x1e..." (the issued counts last)
Record decode(const std::string& s) {
  Record r;
  std::vector<std::string> f;
  size_t at = 0;
  for (int i = 0; i < 5; ++i) {
    auto tab = s.find('\t', at);
    if (tab == std::string::npos) return {};
    f.push_back(s.substr(at, tab - at));
    at = tab + 1;
  }
  r.group = f[1];
  r.k = std::stoll(f[2]);
  std::istringstream ms(f[3]);
  for (std::string m; std::getline(ms, m, ',');) r.members.push_back(std::stoi(m));
  r.op = f[4];
  std::istringstream is(s.substr(at));
  for (std::string e; std::getline(is, e, '\x1e');) {
    auto sep = e.find('\x1f');
    if (sep != std::string::npos) r.issued[e.substr(0, sep)] = std::stoll(e.substr(sep + 1));
  }
  r.raw = s;
  return r;
}

int64_t issued_of(const Record& r, const std::string& group) {
  auto it = r.issued.find(group);
  return it == r.issued.end() ? 0 : it->second;
}

std::string describe(const std::vector<int>& cycle, std::map<int, Record>& records) {
  std::ostringstream os;
  os << "sim: collective wait() cycle deadlock across groups through ranks";
  for (size_t i = 0; i < cycle.size(); ++i) os << (i ? ", " : " ") << cycle[i];
  os << ":";
  for (size_t i = 0; i < cycle.size(); ++i) {
    const Record& r = records.at(cycle[i]);
    int next = cycle[(i + 1) % cycle.size()];
    os << (i ? ";" : "") << " rank " << cycle[i] << " waits in wait() on " << r.op << " (collective #" << r.k
       << " of its group) for rank " << next << ", which issued " << issued_of(records.at(next), r.group)
       << " of that group's collectives and waits itself";
  }
  os << ": NCCL runs a group's collective once every member issued it, and a rank blocked in wait() issues "
        "nothing, so none of these completes; issue the collectives of different groups in the same order on "
        "every rank (or wait on a group's work only after every rank issued it)";
  return os.str();
}

// A cycle from ``at`` back to ``me`` through ranks above ``me`` only (its lowest rank reports): the ranks in order.
bool find_cycle(int me, int at, c10d::Store& store, std::map<int, Record>& records, std::vector<int>& path) {
  const Record& r = records.at(at);
  for (int s : r.members) {
    if (s == at) continue;
    if (s == me) {
      if (issued_of(records.at(me), r.group) < r.k) return true;
      continue;
    }
    if (s < me || std::find(path.begin(), path.end(), s) != path.end()) continue;
    if (!records.count(s)) records[s] = decode(peek(store, record_key(s)));
    if (records[s].k < 0 || issued_of(records[s], r.group) >= r.k) continue;  // not blocked, or issued it
    path.push_back(s);
    if (find_cycle(me, s, store, records, path)) return true;
    path.pop_back();
  }
  return false;
}

// Set this rank's record to ``value`` and bump the version (after: a search that read the old version sees it).
void set_record(c10d::Store& store, int global, const std::string& value) {
  store.set(record_key(global), bytes(value));
  store.add(kVersionKey, 1);
}

}  // namespace


bool SearchPace::due(int64_t version) {
  if (version != searched) {
    searched = version;
    interval = kFirst;
    return true;
  }
  interval = std::min(interval * 2, kMost);
  return false;
}

void note_collective_issued(const std::string& group, int64_t k) {
  std::lock_guard<std::mutex> lock(g_issued_mutex);
  g_issued[group] = k;
}

void publish_member(c10d::Store& group_store, int rank, int global) {
  group_store.set(member_key(rank), bytes(std::to_string(global)));
}

void publish_released(const c10::intrusive_ptr<c10d::Store>& group_store, const std::string& group, int rank, int size,
                      int global, int64_t issued) {
  group_store->set(released_key(rank), bytes(std::to_string(issued)));
  {
    std::lock_guard<std::mutex> lock(g_issued_mutex);
    g_issued.erase(group);  // no wait in this process follows the group's count again
  }
  auto job = job_store(group_store);
  job->deleteKey(told_key(global, group));  // told and never raised: no wait on the group is left to raise it
  job->add(kVersionKey, 1);  // a blocked member's next poll searches, and sees it
  if (group_store->add(kReleasesKey, 1) < size) return;
  for (int i = 0; i < size; ++i) {  // the last to release: no member waits on the group, none reads these again
    group_store->deleteKey(released_key(i));
    group_store->deleteKey(member_key(i));
    group_store->deleteKey(gone_key(i));
  }
  group_store->deleteKey(kBlockedVersion);  // bumped by every release (publish_gone), blocked waits or none
  group_store->deleteKey(kReleasesKey);
}

CollectiveWait::CollectiveWait(c10::intrusive_ptr<c10d::Store> group_store, std::string group, int rank, int size,
                               int global, int64_t k, std::string op)
    : group_store_(std::move(group_store)), group_(std::move(group)), op_(std::move(op)), rank_(rank), size_(size),
      global_(global), k_(k) {}

std::string CollectiveWait::poll() {
  auto now = std::chrono::steady_clock::now();
  if (!started_) {
    started_ = true;
    since_ = searched_ = now;
    return "";
  }
  if (now - since_ < kQuiet || now - searched_ < pace_.interval) return "";
  searched_ = now;
  if (!store_) store_ = job_store(group_store_);
  if (std::string report = told(); !report.empty()) return report;
  if (record_.empty() && !publish()) return "";
  if (!pace_.due(store_->add(kVersionKey, 0))) return "";  // no record changed since the last search began
  if (std::string gone = released_member(); !gone.empty()) return gone;
  std::map<int, Record> records{{global_, decode(record_)}};
  std::vector<int> cycle{global_};
  if (!find_cycle(global_, global_, *store_, records, cycle)) return "";
  for (int r : cycle)  // pass 2: every rank still in the same wait
    if (r != global_ && peek(*store_, record_key(r)) != records[r].raw) return "";
  std::string report = describe(cycle, records);
  for (int r : cycle)  // every member of the cycle's groups: on NCCL they hang at the collective waited on there
    for (int m : records[r].members)
      if (m != global_) tell_one(*store_, m, records[r].group, records[r].k, report);
  return report;
}

std::string CollectiveWait::told() const {
  std::string told = peek(*store_, told_key(global_, group_));
  int64_t from = told_from(told);
  if (from < 0 || k_ < from) return "";  // none told, or this wait is before the stuck collective: it may complete
  store_->deleteKey(told_key(global_, group_));
  return told.substr(told.find('\t') + 1);
}

std::string CollectiveWait::released_member() const {
  for (int i = 0; i < size_; ++i) {
    if (i == rank_) continue;  // this rank waits: it released nothing
    if (Gone g = member_gone(*group_store_, i); g.stuck && g.completed < k_ && !report_left_unread()) {  // stuck.cpp
      std::ostringstream os;
      os << "sim: collective deadlock on group '" << group_ << "': rank " << global_ << " waits in wait() on " << op_
         << " (collective #" << k_ << " of the group) for rank " << peek(*group_store_, member_key(i)) << " (rank "
         << i << " of the group), which completed " << g.completed << " of the group's collectives and runs no "
         << "more: it is stuck (NCCL hangs there, and this wait behind it): " << g.report;
      return os.str();
    }
    std::string issued = peek(*group_store_, released_key(i));
    if (issued == kAbsent || issued.empty() || std::stoll(issued) >= k_) continue;
    std::ostringstream os;
    os << "sim: collective deadlock on group '" << group_ << "': rank " << peek(*group_store_, member_key(i))
       << " (rank " << i << " of the group) released the group (destroy_process_group, or its process ended) after "
       << "issuing " << issued << " of its collectives, while rank " << global_ << " waits in wait() on " << op_
       << " (collective #" << k_ << " of the group): NCCL hangs there; every rank must issue a group's "
       << "collectives before it destroys the group";
    return os.str();
  }
  return "";
}

bool CollectiveWait::publish() {
  std::ostringstream os;
  os << g_episode.fetch_add(1) << '\t' << group_ << '\t' << k_ << '\t';
  for (int i = 0; i < size_; ++i) {  // the members' global ranks, as each published them when the group was made
    std::string g = peek(*group_store_, member_key(i));
    if (g == kAbsent || g.empty()) return false;  // a member has not made the group yet: the next poll
    os << (i ? "," : "") << g;
  }
  os << '\t' << op_ << '\t';
  {
    std::lock_guard<std::mutex> lock(g_issued_mutex);
    for (const auto& [group, n] : g_issued) os << group << '\x1f' << n << '\x1e';
  }
  record_ = os.str();
  set_record(*store_, global_, record_);
  return true;
}

void CollectiveWait::leave() {
  if (record_.empty() || !store_) return;
  try {
    set_record(*store_, global_, "-");  // not deleted: a peer's pass 2 sees the change
  } catch (const std::exception&) {  // the store is gone: the job is ending
  }
  record_.clear();
}

void CollectiveWait::tell(const std::string& report) const {
  auto store = job_store(group_store_);  // not store_: poll() may be setting it on the waiting thread
  for (int i = 0; i < size_; ++i) {
    std::string g = peek(*group_store_, member_key(i));
    if (g != kAbsent && !g.empty() && std::stoi(g) != global_) tell_one(*store, std::stoi(g), group_, k_, report);
  }
}

}  // namespace sim
