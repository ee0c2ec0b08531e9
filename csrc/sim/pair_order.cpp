// The order of point-to-point operations as NCCL runs them (declared in comm.h): a batch's work, and the order of
// a pair's unbatched operations.
//
// ProcessGroupNCCL issues a send or receive outside batch_isend_irecv on the communicator and stream of the
// pair (a two-rank communicator created on first use; the group's own when it was initialized eagerly), so a
// rank's unbatched operations with one peer run one after another in issue order, and each of ncclSend and
// ncclRecv "is blocking for the GPU" until the peer's matching operation runs (NCCL's API documentation:
// operations that must progress concurrently belong in one ncclGroupStart/ncclGroupEnd). The k-th unbatched
// operation of one rank with the other therefore runs against the other's k-th: a send against a receive
// completes; two sends (or two receives) wait for each other forever. NCCL may finish a small send before the
// receiver's kernel runs (it fits the connection's buffers), which the contract does not promise: checked at
// every size. gloo buffers sends, so without this check such a program completes here and hangs on the GPU.
//
// NCCL ignores tags: the two operations at one place pair whatever their tags, where gloo pairs a send only with a
// receive of its tag. So the tags must agree at each place, or NCCL moves the data gloo (and a program that relies
// on tags) keeps apart into other buffers: checked for a pair's unbatched operations, and for the k-th batched send
// of one rank to another against that rank's k-th batched receive from it (claim_batched_place), each before the
// second of the two is launched, so gloo never pairs the two ranks' operations otherwise than NCCL would. The sizes
// of a pair, batched or not, are compared too (NCCL's ncclSend/ncclRecv: the peer "needs to call ncclRecv with the
// same datatype and the same count"; gloo moves bytes: it ends the receiving process when the send is larger, before
// any report, fills only the front of a larger receive, and delivers a float32[8] into a bfloat16[16] as garbage,
// silently): the datatype and the element count, not the bytes.
#include "comm.h"

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <sstream>
#include <thread>

namespace sim {

std::string wake_key(const std::string& key);  // comm_queue.h

namespace {

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

const char kMatched[] = "+";   // the second of the two found the pair's operations complementary
const char kDeadlock[] = "!";  // the second found them the same kind, or tags that differ: its report follows
const char kSizeRule[] =
    "NCCL pairs the k-th send of one rank to another with the other's k-th receive from it, which must have the same "
    "count and datatype (gloo ends the receiving process when the send is larger)";
const char kSizeFix[] = "; send and receive tensors of the same datatype and number of elements";
const char kTagRule[] =
    "NCCL ignores tags and pairs the k-th send of one rank to another with the other's k-th receive from it, where "
    "gloo pairs a send with a receive of its tag, so on NCCL each gets data meant for another buffer";

// "dtype" when two payloads (``dtype=.. count=..``, payload_of) differ in datatype, else "size".
const char* mismatch_kind(const std::string& a, const std::string& b) {
  return a.substr(0, a.find(' ')) != b.substr(0, b.find(' ')) ? "dtype" : "size";
}

// What endCoalescing returns for a batch (batch_isend_irecv): one work for the whole batch, as NCCL's, that waits
// each of the batch's operations once however often it is itself waited.
class BatchWork final : public c10d::Work {
 public:
  explicit BatchWork(std::vector<c10::intrusive_ptr<c10d::Work>> works) : works_(std::move(works)) {}
  bool wait(std::chrono::milliseconds timeout) override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (; next_ < works_.size(); ++next_) works_[next_]->wait(timeout);
    return true;
  }
  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = next_; i < works_.size(); ++i)
      if (!works_[i]->isCompleted()) return false;
    return true;
  }
  bool isSuccess() const override {
    for (const auto& w : works_)
      if (!w->isSuccess()) return false;
    return true;
  }
  std::vector<at::Tensor> result() override {
    std::vector<at::Tensor> out;
    for (auto& w : works_)
      for (auto& t : w->result()) out.push_back(t);
    return out;
  }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  size_t next_ = 0;
  std::mutex mutex_;
};

}  // namespace

c10::intrusive_ptr<c10d::Work> batch_work(std::vector<c10::intrusive_ptr<c10d::Work>> works) {
  return c10::make_intrusive<BatchWork>(std::move(works));
}

std::string payload_of(const std::vector<at::Tensor>& ts) {
  int64_t count = 0;
  for (const auto& t : ts) count += t.numel();
  std::ostringstream os;
  os << "dtype=" << (ts.empty() ? c10::ScalarType::Undefined : ts[0].scalar_type()) << " count=" << count;
  return os.str();
}

std::string pair_key(int rank, int peer, int64_t place) {
  int lo = std::min(rank, peer), hi = std::max(rank, peer);
  return "simccl/pair/" + std::to_string(lo) + "-" + std::to_string(hi) + "/" + std::to_string(place);
}

PairClaim claim_pair_place(c10d::Store& store, const std::string& key, const std::string& group, int rank,
                           bool send, int tag, const std::string& payload, const std::string& op) {
  std::string mine = std::string(send ? "S" : "R") + std::to_string(rank) + "\t" + std::to_string(tag) + "\t" +
                     payload + "\t" + op;
  auto got = store.compareSet(key, {}, bytes(mine));
  std::string theirs(got.begin(), got.end());
  if (theirs == mine) return {true, ""};  // first at this place: the peer compares when it issues its own
  auto tab = theirs.find('\t'), tab2 = theirs.find('\t', tab + 1), tab3 = theirs.find('\t', tab2 + 1);
  bool their_send = !theirs.empty() && theirs[0] == 'S';
  std::string their_rank = theirs.substr(1, tab - 1), their_op = theirs.substr(tab3 + 1);
  int64_t place = std::stoll(key.substr(key.rfind('/') + 1));
  bool same_tag = std::stoi(theirs.substr(tab + 1, tab2 - tab - 1)) == tag;
  std::string their_payload = theirs.substr(tab2 + 1, tab3 - tab2 - 1);
  // The verdict lives in the wake key alone, written once, after the place is gone: the first one reads it only
  // once woken, and is the only one to delete it (a verdict in two keys could be read between the two writes).
  bool matched = their_send != send && same_tag && their_payload == payload;
  store.deleteKey(key);
  store.set(wake_key(key), bytes(matched ? kMatched : kDeadlock));  // the first one's wait() may proceed: woken
  if (matched) return {false, ""};
  std::ostringstream os;
  if (their_send != send) {
    os << "sim: point-to-point " << (same_tag ? mismatch_kind(their_payload, payload) : "tag") << " mismatch on group '"
       << group << "': rank " << their_rank << " (of the group) issued " << their_op << " and rank " << rank
       << " issued " << op << " as their unbatched operation #" << place + 1 << " with each other: "
       << (same_tag ? kSizeRule : kTagRule) << (same_tag ? kSizeFix : "; pair them in the same order on both ranks");
    return {false, os.str()};
  }
  os << "sim: point-to-point deadlock on group '" << group << "': rank " << their_rank << " (of the group) issued "
     << their_op << " and rank " << rank << " issued " << op << " as their unbatched operation #" << place + 1
     << " with each other: NCCL runs a pair's unbatched sends and receives one at a time in issue order, each "
        "waiting for the peer's matching one, so both wait forever; issue them together in one batch_isend_irecv, "
        "or post the "
     << (send ? "receive" : "send") << " first on one of the two ranks";
  return {false, os.str()};
}

std::string batched_key(int src, int dst, int64_t k) {
  return "simccl/batched/" + std::to_string(src) + ">" + std::to_string(dst) + "/" + std::to_string(k);
}

PairClaim claim_batched_place(c10d::Store& store, const std::string& group, int rank, int peer, bool send, int64_t k,
                              int tag, const std::string& payload, const std::string& op) {
  int src = send ? rank : peer, dst = send ? peer : rank;
  std::string key = batched_key(src, dst, k);
  std::string mine = std::to_string(tag) + "\t" + payload + "\t" + op;
  auto got = store.compareSet(key, {}, bytes(mine));
  std::string theirs(got.begin(), got.end());
  if (theirs == mine) return {true, ""};  // first of the two (a send's text differs from a receive's)
  store.deleteKey(key);                   // the peer compares; nobody reads it again
  auto tab = theirs.find('\t'), tab2 = theirs.find('\t', tab + 1);
  bool same_tag = std::stoi(theirs.substr(0, tab)) == tag;
  std::string their_payload = theirs.substr(tab + 1, tab2 - tab - 1);
  if (same_tag && their_payload == payload) return {false, ""};
  const std::string& sent = send ? op : theirs.substr(tab2 + 1);
  const std::string& received = send ? theirs.substr(tab2 + 1) : op;
  std::ostringstream os;
  os << "sim: point-to-point " << (same_tag ? mismatch_kind(their_payload, payload) : "tag") << " mismatch on group '"
     << group << "': rank "
     << src << " (of the group) posted " << sent << " as its batched send #" << k + 1 << " to rank " << dst
     << ", and rank " << dst << " posted " << received << " as its batched receive #" << k + 1 << " from rank "
     << src << ": ";
  if (same_tag) {
    os << kSizeRule << kSizeFix;
  } else {
    os << kTagRule << "; post the sends to one peer in the order that peer posts the receives (the same tags in the "
          "same order)";
  }
  return {false, os.str()};
}

std::string wake_key(const std::string& key) { return key + "/wake"; }

namespace {

// Second connections to group stores for blocked waits: a TCPStore client holds its one connection for the whole of
// a wait(), which would stall the watchdog's and other threads' operations on it. One per store and thread (the
// store held, so its address is never another's), the last kKeep of a thread's; a group's go at its release.
struct Waiter {
  c10::intrusive_ptr<c10d::Store> of, clone;
  std::thread::id thread;
};
std::mutex g_waiters_mutex;
std::vector<Waiter> g_waiters;

c10::intrusive_ptr<c10d::Store> waiter_of(c10d::Store& store) {
  constexpr size_t kKeep = 8;
  auto me = std::this_thread::get_id();
  std::lock_guard<std::mutex> lock(g_waiters_mutex);
  size_t mine = 0, oldest = g_waiters.size();
  for (size_t i = 0; i < g_waiters.size(); ++i) {
    if (g_waiters[i].thread != me) continue;
    if (g_waiters[i].of.get() == &store) return g_waiters[i].clone;
    if (mine++ == 0) oldest = i;
  }
  if (mine >= kKeep) g_waiters.erase(g_waiters.begin() + oldest);  // its wait, if any, holds its own reference
  auto held = c10::intrusive_ptr<c10d::Store>::reclaim_copy(&store);
  g_waiters.push_back({held, held->clone(), me});
  return g_waiters.back().clone;
}

}  // namespace

void drop_waiters(const c10d::Store& store) {
  std::lock_guard<std::mutex> lock(g_waiters_mutex);
  g_waiters.erase(std::remove_if(g_waiters.begin(), g_waiters.end(),
                                 [&](const Waiter& w) { return w.of.get() == &store; }), g_waiters.end());
}

// The wake key holds the peer's verdict (claim_pair_place) or the watchdog's wake (set only where absent: a
// verdict is never overwritten; one the waiter read and deleted is the watchdog's to delete, SimWork::await_pair).
// A matched verdict still yields to a report the watchdog woke this wait with. Leak-free but where the wait ends
// without the peer's claim (a report, the bound): a verdict the peer writes later stays in the store.
std::string await_pair_place(c10d::Store& store, const std::string& key, std::chrono::milliseconds bound,
                             const std::function<std::string()>& broken) {
  auto until = std::chrono::steady_clock::now() + bound;
  const std::string wake = wake_key(key);
  try {
    auto waiter = waiter_of(store);
    for (;;) {
      std::string report = broken();  // a report the watchdog woke this wait with, or the communicator's
      if (!report.empty()) return report;
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
      if (left.count() <= 0) return "";
      // pushed by the store when the peer claims its place or the watchdog wakes this wait (at the bound at the
      // latest, so the wait's own timeout, which the store logs, is a safety net only)
      waiter->wait({wake}, left + std::chrono::seconds(1));
      auto raw = store.get(wake);  // set: only this wait deletes it
      store.deleteKey(wake);
      if (std::string(raw.begin(), raw.end()) == kMatched) return broken();
      // a deadlock verdict: the peer's report reaches broken() through the watchdog, which wakes this wait again
    }
  } catch (const std::exception&) {  // the store is gone (the job is ending): gloo's own wait says what happened
  }
  return "";
}

}  // namespace sim
