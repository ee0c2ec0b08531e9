// Cycles of point-to-point batches through three or more ranks (declared in comm.h).
//
// group_order.cpp replays each pair's batches on their own, which finds two ranks waiting for each other but not
// a ring: rank 0's batch waits for rank 1's next one, rank 1's for rank 2's, rank 2's for rank 0's. Here each rank
// replays its own batches as NCCL runs every rank's (omnitron.testing.nccl_groups' rule): its running batch (its
// "head") completes once every peer it holds operations with has reached the peer's batch with the partners. That
// peer cannot leave that batch before this one runs (its operations would not have met theirs), so "the peer's
// published head is at or past it" is exact. Each rank publishes its head ("simccl/head/<rank>"); a head that waits
// for peers whose awaited batch is posted behind the peer's own head publishes which ("simccl/wait/<rank>").
//
// Never a false report: a cycle of such waits is reported only after the heads of its ranks were read twice with
// no change between the two passes, so at one instant every rank of the cycle ran the batch its record names and
// waited for a later batch of the next one; none can complete first, so none ever does (NCCL waits forever).
// Heads advance as each batch is posted and at the device watchdog's polls (every 0.1 s), which alone publish
// waits and look for cycles: a cycle is found within a poll or two of its last batch being posted, whatever the
// ranks do next, unless the job ends first.
#include "comm.h"

#include <algorithm>
#include <sstream>

namespace sim {
namespace {

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

std::string head_key(int rank) { return "simccl/head/" + std::to_string(rank); }
std::string wait_key(int rank) { return "simccl/wait/" + std::to_string(rank); }

// A rank's wait record: its running batch and, per peer it waits for, the peer's batch it waits for.
struct Wait {
  int64_t head = -1;
  std::string site;
  std::map<int, std::pair<int64_t, std::string>> on;  // peer -> (its batch awaited, that batch's site)
};

std::string encode(const Wait& w) {
  std::ostringstream os;
  os << w.head << '\t' << w.site;
  for (const auto& [peer, b] : w.on) os << '\n' << peer << '\t' << b.first << '\t' << b.second;
  return os.str();
}

Wait decode(const std::string& s) {
  Wait w;
  std::istringstream is(s);
  std::string line, field;
  std::getline(is, line);
  auto tab = line.find('\t');
  w.head = std::stoll(line.substr(0, tab));
  w.site = line.substr(tab + 1);
  while (std::getline(is, line)) {
    auto a = line.find('\t'), b = line.find('\t', a + 1);
    w.on[std::stoi(line.substr(0, a))] = {std::stoll(line.substr(a + 1, b - a - 1)), line.substr(b + 1)};
  }
  return w;
}

int64_t read_head(c10d::Store& store, int rank) {
  std::string key = head_key(rank);
  if (!store.check({key})) return 0;  // never published: no batch completed
  auto raw = store.get(key);
  return std::stoll(std::string(raw.begin(), raw.end()));
}

// The peer's batch holding the partner of this rank's last operation with it in ``ops``: the first of the peer's
// batches whose totals reach this rank's (its receives from this rank for this rank's sends, and conversely);
// -1 while the peer has not posted it. Also its site.
std::pair<int64_t, std::string> partner_batch(const std::deque<PairGroup>& seen, const BatchOps& ops) {
  std::pair<int64_t, std::string> out{-2, ""};
  auto find = [&](bool sends) {
    for (const auto& g : seen)
      if ((sends ? g.recvs >= ops.total_sends : g.sends >= ops.total_recvs)) return std::make_pair(g.batch, g.site);
    return std::make_pair(int64_t{-1}, std::string());
  };
  for (bool sends : {true, false}) {
    if ((sends ? ops.sends : ops.recvs) == 0) continue;
    auto b = find(sends);
    if (b.first < 0) return b;
    if (b.first > out.first) out = b;
  }
  return out;
}

// A cycle through ``me`` of at least three ranks, all of them above ``me`` but ``me``: the ranks in order.
bool find_cycle(int me, int at, const std::map<int, Wait>& waits, std::vector<int>& path) {
  for (const auto& [peer, awaited] : waits.at(at).on) {
    if (peer == me && path.size() >= 3) return true;
    if (peer <= me || std::find(path.begin(), path.end(), peer) != path.end() || !waits.count(peer)) continue;
    path.push_back(peer);
    if (find_cycle(me, peer, waits, path)) return true;
    path.pop_back();
  }
  return false;
}

std::string describe(const std::string& group, const std::vector<int>& cycle, const std::map<int, Wait>& waits) {
  std::ostringstream os;
  os << "sim: point-to-point cycle deadlock on group '" << group << "' through ranks";
  for (size_t i = 0; i < cycle.size(); ++i) os << (i ? ", " : " ") << cycle[i];
  os << ":";
  for (size_t i = 0; i < cycle.size(); ++i) {
    int rank = cycle[i], next = cycle[(i + 1) % cycle.size()];
    const Wait& w = waits.at(rank);
    const auto& awaited = w.on.at(next);
    os << (i ? "; " : " ") << "rank " << rank << "'s batch #" << w.head + 1 << " (issued at " << w.site
       << ") waits for rank " << next << "'s batch #" << awaited.first + 1 << " (issued at " << awaited.second << ")";
  }
  os << ": NCCL runs a communicator's batch_isend_irecv groups one after another, each until all its operations "
        "met their partners, so each of these waits for a batch its peer posts behind the one the peer is stuck in, "
        "and none completes (gloo completes them); post each send in the batch where its peer posts the matching "
        "receive, on every rank of the ring (one batch with the send to the next rank and the receive from the "
        "previous one)";
  return os.str();
}

}  // namespace

CycleReport GlobalReplay::step(c10d::Store& store, const std::string& group, int rank,
                               std::map<int, PairQueue>& pairs, bool search) {
  Wait mine;
  while (!pending.empty()) {
    const GlobalBatch& b = pending.front();
    mine = Wait{b.batch, b.site, {}};
    for (const auto& [peer, ops] : b.peers) {
      PairQueue& pq = pairs[peer];
      pq.read_available(store, rank, peer);
      auto awaited = partner_batch(pq.seen, ops);
      if (awaited.first < 0) continue;  // not posted yet: the peer may still post it (no wait on a batch to report)
      if (heads[peer] < awaited.first) heads[peer] = read_head(store, peer);
      if (heads[peer] < awaited.first) mine.on[peer] = awaited;
    }
    bool posted = true;
    for (const auto& [peer, ops] : b.peers) posted = posted && partner_batch(pairs[peer].seen, ops).first >= 0;
    if (!posted || !mine.on.empty()) break;
    for (const auto& [peer, ops] : b.peers) {  // every operation up to these totals met its partner: drop the
      auto& seen = pairs[peer].seen;           // peer's batches no later lookup can return
      while (!seen.empty() && seen.front().recvs <= ops.total_sends && seen.front().sends <= ops.total_recvs)
        seen.pop_front();
    }
    pending.pop_front();
    ++head;
    mine = Wait{};
  }
  if (head != published_head) {
    store.set(head_key(rank), bytes(std::to_string(head)));
    published_head = head;
  }
  if (!search || mine.on.empty()) return {};
  std::string record = encode(mine);
  if (record != published_wait) {
    store.set(wait_key(rank), bytes(record));
    published_wait = record;
  }
  // the waits of the ranks reachable from this one through ranks above it (the cycle's lowest rank reports)
  std::map<int, Wait> waits{{rank, mine}};
  std::vector<int> todo;
  for (const auto& [peer, awaited] : mine.on) todo.push_back(peer);
  while (!todo.empty()) {
    int r = todo.back();
    todo.pop_back();
    if (r <= rank || waits.count(r) || !store.check({wait_key(r)})) continue;
    auto raw = store.get(wait_key(r));
    waits[r] = decode(std::string(raw.begin(), raw.end()));
    for (const auto& [peer, awaited] : waits[r].on) todo.push_back(peer);
  }
  std::vector<int> cycle{rank};
  if (!find_cycle(rank, rank, waits, cycle)) return {};
  // two passes over the cycle's heads, the same both times and as the records say: at one instant (between the
  // passes) every rank ran the batch its record names, which waits for a later batch of the next rank
  for (int pass = 0; pass < 2; ++pass)
    for (size_t i = 0; i < cycle.size(); ++i) {
      int r = cycle[i], next = cycle[(i + 1) % cycle.size()];
      int64_t h = r == rank ? head : read_head(store, r);
      if (h != waits[r].head || waits[r].on.at(next).first <= waits[next].head) return {};
    }
  return {describe(group, cycle, waits), cycle};
}

}  // namespace sim
