// Cycles closed by wait() (declared in comm.h).
//
// An unbatched send or receive runs on NCCL only against its peer's matching operation, and work.wait() makes the
// rank's stream wait for it, so every operation the rank issues after the wait runs after it completed. Rank 0
// sending to rank 1 and waiting before it posts its receive from rank 2, rank 1 doing the same towards rank 2 and
// rank 2 towards rank 0, is a cycle: each send waits for a receive its peer posts behind its own wait, and NCCL
// hangs (each pair is in order, so pair_order.cpp's check passes; on gloo the ring hangs too, silently). On sim the
// host blocks in such a wait() (await_pair_place) until the peer posts the counterpart, so the cycle is: each rank
// of it blocked in wait() on an operation whose counterpart the next rank has not posted.
//
// A wait() blocked longer than kQuiet publishes its record ("simccl/blocked/<rank>": an episode number,
// the peer, the pair's key, the operation) and follows the peers' records; a chain that returns to this rank is
// reported by the chain's lowest rank once (1) every record was read twice, the same both times, and (2) between
// the two passes every awaited pair key still held only its first operation. At one instant (between the passes)
// every rank of the cycle was blocked in its wait() and no counterpart was posted; a blocked rank posts nothing, so
// none ever is. ASSUMED: one thread issues a communicator's point-to-point operations (true of the engine: MoE's
// overlap threads take turns, the async checkpoint writer talks over gloo); a second thread posting the
// counterpart while the first is blocked would make a report false. Never a false report; a wait() that is not
// blocked for kQuiet costs no store traffic; one blocked longer searches only when a record of the group changed
// since its last search began (each change bumps "simccl/blocked/version"), polling with backoff (SearchPace,
// comm.h) meanwhile: two reads a second in a legal long wait. The same holds for a batched operation
// (batch_isend_irecv): its wait() blocks in gloo until the peer posts the counterpart, and the device's watchdog
// polls it (comm_queue.cpp).
#include "comm.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <sstream>

namespace sim {
namespace {

constexpr std::chrono::milliseconds kQuiet{100};  // a wait blocked this long publishes its record, then searches
const char kAbsent[] = "\x01";  // compareSet's answer for a key that does not exist (its expected value)

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

std::string blocked_key(int rank) { return "simccl/blocked/" + std::to_string(rank); }
const char* const kVersionKey = kBlockedVersion;  // bumped at every change of a record of the group (and by stuck.cpp)

void set_record(c10d::Store& store, int rank, const std::string& value) {  // then the version: see SearchPace
  store.set(blocked_key(rank), bytes(value));
  store.add(kVersionKey, 1);
}

// The value at ``key``, or kAbsent: compareSet with an expected value no key holds never writes, and unlike
// check() then get() cannot block when the owner deletes the key between the two.
std::string peek(c10d::Store& store, const std::string& key) {
  auto got = store.compareSet(key, bytes(kAbsent), bytes(kAbsent));
  return {got.begin(), got.end()};
}

std::atomic<int64_t> g_episode{0};

struct Record {
  int peer = -1;
  std::string key, op;
};

Record decode(const std::string& s) {  // "<episode>\t<peer>\t<pair key>\t<op>"
  auto a = s.find('\t'), b = s.find('\t', a + 1), c = s.find('\t', b + 1);
  if (a == std::string::npos || b == std::string::npos || c == std::string::npos) return {};
  return {std::stoi(s.substr(a + 1, b - a - 1)), s.substr(b + 1, c - b - 1), s.substr(c + 1)};
}

std::string describe(const std::string& group, const std::vector<int>& cycle, const std::map<int, Record>& records) {
  std::ostringstream os;
  os << "sim: point-to-point wait() cycle deadlock on group '" << group << "' through ranks";
  for (size_t i = 0; i < cycle.size(); ++i) os << (i ? ", " : " ") << cycle[i];
  os << ":";
  for (size_t i = 0; i < cycle.size(); ++i)
    os << (i ? ";" : "") << " rank " << cycle[i] << " waits in wait() on " << records.at(cycle[i]).op
       << " for rank " << records.at(cycle[i]).peer << "'s matching operation";
  os << ": NCCL runs a send or receive (or a batch of them) only against its peer's matching one and orders every "
        "operation issued after a wait() after the operation waited for, so each waits for an operation its peer "
        "issues behind its own wait, and none completes; on one rank of the ring post the receive before waiting on "
        "the send, or issue the ring's sends and receives in one batch_isend_irecv";
  return os.str();
}

}  // namespace

BlockedWait::BlockedWait(c10::intrusive_ptr<c10d::Store> store, std::string group, int rank, int peer,
                         std::string key, std::string op)
    : store_(std::move(store)), group_(std::move(group)), rank_(rank), peer_(peer), key_(std::move(key)),
      op_(std::move(op)) {}

void BlockedWait::enter() {
  std::lock_guard<std::mutex> lock(mu_);
  since_ = searched_ = std::chrono::steady_clock::now();
  left_ = false;
  pace_ = SearchPace{};
}

CycleReport BlockedWait::poll() {
  std::lock_guard<std::mutex> lock(mu_);
  if (left_) return {};
  auto now = std::chrono::steady_clock::now();
  if (now - since_ < kQuiet || now - searched_ < pace_.interval) return {};
  searched_ = now;
  if (record_.empty()) {
    record_ = std::to_string(g_episode.fetch_add(1)) + "\t" + std::to_string(peer_) + "\t" + key_ + "\t" + op_;
    set_record(*store_, rank_, record_);
  }
  if (!pace_.due(store_->add(kVersionKey, 0))) return {};  // no record changed since the last search began
  if (std::string gone = peer_gone(); !gone.empty()) return {gone, {}};  // told to no one else: ranks empty
  // pass 1: follow the records from this rank's peer until the chain returns here
  std::map<int, std::string> raw{{rank_, record_}};
  std::map<int, Record> records{{rank_, decode(record_)}};
  std::vector<int> cycle{rank_};
  for (int at = peer_; at != rank_; at = records[at].peer) {
    if (raw.count(at)) return {};  // a cycle not through this rank: its own ranks report it
    raw[at] = peek(*store_, blocked_key(at));
    records[at] = decode(raw[at]);
    if (records[at].peer < 0) return {};  // not blocked in wait() (or not for long)
    cycle.push_back(at);
  }
  if (*std::min_element(cycle.begin(), cycle.end()) != rank_) return {};  // the cycle's lowest rank reports
  for (int r : cycle) {  // each awaited counterpart still unposted: the key holds its first operation alone (the
    std::string value = peek(*store_, records[r].key);  // second marks it, or deletes it, when it claims its place)
    if (value.empty() || value == kAbsent || value == "+" || value == "!") return {};
  }
  for (int r : cycle)  // pass 2: every rank still in the same wait
    if (r != rank_ && peek(*store_, blocked_key(r)) != raw[r]) return {};
  return {describe(group_, cycle, records), cycle};
}

std::string BlockedWait::peer_gone() {
  Gone g = member_gone(*store_, peer_);
  if ((!g.stuck && !g.released) || (g.stuck && report_left_unread())) return "";  // said by the report left here
  std::string value = peek(*store_, key_);  // read after: the counterpart still unposted then, so never posted
  if (value.empty() || value == kAbsent || value == "+" || value == "!") return "";
  std::ostringstream os;
  os << "sim: point-to-point deadlock on group '" << group_ << "': rank " << rank_ << " (of the group) waits in wait() "
     << "on " << op_ << " for rank " << peer_ << "'s matching operation, which rank " << peer_ << " never issues: ";
  if (g.stuck)
    os << "it is stuck (NCCL hangs there, and this wait behind it): " << g.report;
  else
    os << "it released the group (destroy_process_group, or its process ended) first; NCCL hangs there: post the "
          "counterpart of every send and receive before destroying the group";
  return os.str();
}

void BlockedWait::leave() {
  std::lock_guard<std::mutex> lock(mu_);
  left_ = true;
  if (record_.empty()) return;
  record_.clear();
  try {
    set_record(*store_, rank_, "-");  // not deleted: a peer's pass 2 sees the change
  } catch (const std::exception&) {  // the store is gone: the job is ending
  }
}

}  // namespace sim
