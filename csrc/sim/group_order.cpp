// The order of a communicator's point-to-point groups as NCCL runs them (declared in comm.h).
//
// batch_isend_irecv is one NCCL group (ncclGroupStart/ncclGroupEnd) on the group's own communicator, and NCCL
// runs a communicator's groups one after another on its stream, in issue order: a group completes once every
// operation in it met its partner, and an operation meets its partner only while the partner's group is the one
// running on the peer. The k-th send of one rank to another pairs with the other's k-th receive from it (tags
// ignored). NCCL may finish a small send before its receive runs (it fits the connection's buffers), which the
// contract does not promise: checked as if every payload exceeded them. gloo runs each operation on its own and
// buffers sends, so without this check two ranks that each post a send-only group before the group with the
// matching receive complete here and hang on the GPU.
//
// The check, per pair of ranks: each rank publishes, for each of its groups holding operations with the peer, how
// many sends to and receives from the peer it has posted up to that group's end; each replays the two sequences
// as NCCL would run them. At the two groups heading the pair's queues, one completes when the other covers its
// operations (its sends up to its end are all received by then, and its receives all sent); when neither does,
// neither ever will: that is the deadlock, reported by whichever rank issued the later of the two. Restricting
// the groups to one pair's operations only drops waits, so a deadlock found here is one on NCCL too; a cycle
// through three or more ranks whose pairs are each in order is found by the replay of all ranks (cycle.cpp).
#include "comm.h"

#include <sstream>

namespace sim {
namespace {

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

// The key of the ``n``-th group of ``from`` holding operations with ``to``.
std::string group_key(int from, int to, size_t n) {
  return "simccl/group/" + std::to_string(from) + ">" + std::to_string(to) + "/" + std::to_string(n);
}

std::string encode(const PairGroup& g) {
  return std::to_string(g.sends) + "\t" + std::to_string(g.recvs) + "\t" + std::to_string(g.batch) + "\t" + g.site;
}

PairGroup decode(const std::string& s) {
  PairGroup g;
  std::istringstream is(s);
  std::string field;
  std::getline(is, field, '\t');
  g.sends = std::stoll(field);
  std::getline(is, field, '\t');
  g.recvs = std::stoll(field);
  std::getline(is, field, '\t');
  g.batch = std::stoll(field);
  std::getline(is, g.site);
  return g;
}

// ``g`` of ``rank``, described: its batch number on the group, what it holds with ``peer`` (``before``: the group
// completed before it) and its call site.
std::string describe(const PairGroup& g, const PairGroup& before, int rank, int peer) {
  std::ostringstream os;
  auto span = [](int64_t from, int64_t to) {  // operations #from..#to (counted from 1)
    return "#" + std::to_string(from) + (to > from ? ".." + std::to_string(to) : "");
  };
  os << "rank " << rank << "'s batch #" << g.batch + 1 << " (";
  if (g.sends > before.sends) os << "sends " << span(before.sends + 1, g.sends) << " to rank " << peer;
  if (g.sends > before.sends && g.recvs > before.recvs) os << ", ";
  if (g.recvs > before.recvs) os << "receives " << span(before.recvs + 1, g.recvs) << " from rank " << peer;
  os << ", issued at " << g.site << ")";
  return os.str();
}

}  // namespace

void PairQueue::post(c10d::Store& store, int rank, int peer, PairGroup g) {
  store.set(group_key(rank, peer, posted++), bytes(encode(g)));
  mine.push_back(std::move(g));
}

void PairQueue::read_available(c10d::Store& store, int rank, int peer) {
  for (;;) {  // the peer's next group, once it issued it (read once, then dropped)
    std::string key = group_key(peer, rank, read);
    if (!store.check({key})) return;
    auto raw = store.get(key);
    store.deleteKey(key);
    theirs.push_back(decode(std::string(raw.begin(), raw.end())));
    seen.push_back(theirs.back());
    ++read;
  }
}

std::string PairQueue::replay(c10d::Store& store, const std::string& group, int rank, int peer) {
  if (!mine.empty()) read_available(store, rank, peer);
  while (!mine.empty()) {
    if (theirs.empty()) return "";  // the peer has not issued its next group yet
    PairGroup g = mine.front(), h = theirs.front();
    bool g_done = g.sends <= h.recvs && g.recvs <= h.sends;  // h covers g: every operation of g met its partner
    bool h_done = h.sends <= g.recvs && h.recvs <= g.sends;
    if (!g_done && !h_done) {
      std::ostringstream os;
      os << "sim: point-to-point group deadlock on group '" << group << "': " << describe(g, mine_done, rank, peer)
         << " and " << describe(h, theirs_done, peer, rank)
         << " head their communicator's queues and neither can complete, as each waits for an operation the other "
            "rank posts in a later batch: NCCL runs a communicator's batch_isend_irecv groups one after another, "
            "each until all its operations met their partners (the k-th send to a rank pairs with its k-th "
            "receive), so both wait forever; post each send in the same batch as the receive its peer posts "
            "opposite it (one batch_isend_irecv with the send and the receive on both ranks)";
      return os.str();
    }
    if (g_done) {
      mine_done = g;
      mine.pop_front();
    }
    if (h_done) {
      theirs_done = h;
      theirs.pop_front();
    }
  }
  return "";
}

}  // namespace sim
