// What simccl checks and records at the process-group level (comm_check.cpp): every collective and
// point-to-point operation of a sim communicator passes here, whoever issued it -- the engine's
// Collectives, FSDP2 (fully_shard), DCP or a plain torch.distributed call.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace sim {

// Where a collective was issued: the call site, the thread, and whether the engine's collective layer
// (omnitron/backends/collectives.py, flight.py) issued it -- that layer records and checks its own.
struct Site {
  std::string where = "(unknown site)", thread = "thread";
  bool engine = false;
};
Site python_site_full();

// ``shape=[..] dtype=..`` of the first tensor (``xN`` when there are N), then ``extra``: what peers must agree on.
std::string fingerprint(const std::vector<at::Tensor>& ts, const std::string& extra = "");
std::string reduce_name(const c10d::ReduceOp& op);  // "op=SUM", as torch prints ReduceOp.SUM

// ---- the flight record: issue, completion and wait of every operation ---------------------------
// Returns the record's id. ``detail``: the fingerprint (shapes, dtype, reduce op, root or peer).
int64_t record_issue(const std::string& op, const std::string& group, const std::string& detail, const Site& site);
void record_finish(int64_t id, const std::string& error);  // the communicator finished it
void record_wait(int64_t id);                               // the host waited for it (work.wait / isCompleted)
std::vector<std::string> comm_records();                    // oldest first, one line each

// ---- strict mode (OMNITRON_STRICT_COLLECTIVES) ---------------------------------------------------
bool strict_enabled();
// Exchange ``key`` (op #seq fingerprint) with the other members of ``gloo``'s group before the collective
// runs; returns "" when every rank issued the same one, else a one-line report naming each rank's. An all_to_all's
// key ends in kCountsMark and its counts per peer (``in=a,b out=c,d``): rank i's count to j must be j's from i.
constexpr char kCountsMark[] = " \x1f";
std::string exchange_fingerprints(c10d::Backend& gloo, const std::string& group, const std::string& key,
                                  const std::string& site);

// ---- point-to-point order against the group's collectives ----------------------------------------
// NCCL runs a communicator's collectives and point-to-point operations in the order issued, so a send
// issued after k of the group's collectives must be received after k of them on the peer too.
struct P2PPosition {
  int64_t collectives = 0;  // the group's collectives issued before it on this rank
  std::string last;         // the last of them, described ("" when none)
  std::string op;           // the send or receive itself, described
  bool batched = false;     // issued inside a batch (batch_isend_irecv): on the group's communicator, not the pair's
};
std::string encode_position(const P2PPosition& p);
// "" when the receiver's position matches what the sender published, else the one-line deadlock report: issued
// after different numbers of the group's collectives, or one inside a batch and the other outside one.
std::string compare_positions(const std::string& group, int src, int dst, const std::string& sent,
                              const P2PPosition& mine);

// ---- point-to-point batches and the order of a pair's unbatched operations (pair_order.cpp) --------
// The one work endCoalescing returns for a batch (batch_isend_irecv), as NCCL's: waits each of ``works`` once,
// however often it is itself waited.
c10::intrusive_ptr<c10d::Work> batch_work(std::vector<c10::intrusive_ptr<c10d::Work>> works);
// The store key of the ``place``-th unbatched operation between ``rank`` and ``peer`` (either way round).
std::string pair_key(int rank, int peer, int64_t place);
struct PairClaim {
  bool first = false;  // the peer has not issued its operation at this place yet: wait() awaits it
  std::string report;  // "" or the one-line report (two sends or two receives; tags, dtypes or counts that differ)
};
// What a send and its receive must agree on besides the tag: ``dtype=Float count=8`` (NCCL's datatype and count).
std::string payload_of(const std::vector<at::Tensor>& ts);
// Publish this rank's operation (``op``, described; ``tag``; ``payload``) at ``key``, or compare it with the
// peer's already there.
PairClaim claim_pair_place(c10d::Store& store, const std::string& key, const std::string& group, int rank,
                           bool send, int tag, const std::string& payload, const std::string& op);
// The ``k``-th batched send of one rank to the other or receive from it (``send``; ``payload``): published, or
// compared with the peer's operation at the same place, which NCCL pairs it with whatever the tags; "" or the
// one-line report of tags, or datatypes or counts, that differ. Before the operation is launched, so gloo never pairs
// the two otherwise than NCCL.
PairClaim claim_batched_place(c10d::Store& store, const std::string& group, int rank, int peer, bool send, int64_t k,
                              int tag, const std::string& payload, const std::string& op);
// The store key of the ``k``-th batched send of ``src`` to ``dst`` and of ``dst``'s receive from it: held by the
// first of the two until the second claims its place (claim_batched_place).
std::string batched_key(int src, int dst, int64_t k);
// For the first of the two: wait (at most ``bound``) until the peer issued a matching operation at ``key``, or
// ``broken()`` returns a report (the peer found a deadlock), which is returned; "" to go on waiting in gloo.
std::string await_pair_place(c10d::Store& store, const std::string& key, std::chrono::milliseconds bound,
                             const std::function<std::string()>& broken);
// Drop the connections to ``store`` that blocked waits opened (await_pair_place): at its group's release.
void drop_waiters(const c10d::Store& store);

// ---- the order of a communicator's point-to-point groups (group_order.cpp) ------------------------
// One batch (batch_isend_irecv) of a rank, restricted to its operations with one peer.
struct PairGroup {
  int64_t sends = 0, recvs = 0;  // sends to and receives from the peer posted in batches up to this one's end
  int64_t batch = -1;            // the batch's number among the rank's batches on the group
  std::string site;              // where it was issued
};
// One pair's batches on a communicator, replayed as NCCL runs them: this rank's, and the peer's read from the store.
struct PairQueue {
  std::deque<PairGroup> mine, theirs;  // not yet completed in the replay, the running one first
  PairGroup mine_done, theirs_done;    // the last completed of each (where the running one's operations start)
  size_t posted = 0, read = 0;         // this rank's published, the peer's read
  int64_t sends = 0, recvs = 0;        // this rank's batched operations with the peer so far
  std::deque<PairGroup> seen;          // the peer's batches read, kept for the replay of all ranks (cycle.cpp)
  // Publish this rank's next batch with the peer in the group's store.
  void post(c10d::Store& store, int rank, int peer, PairGroup g);
  // Read every batch the peer has published since the last read (into ``theirs`` and ``seen``).
  void read_available(c10d::Store& store, int rank, int peer);
  // Run the replay as far as both ranks' batches are known: "" or the one-line deadlock report.
  std::string replay(c10d::Store& store, const std::string& group, int rank, int peer);
};

// ---- cycles of batches through three or more ranks (cycle.cpp) ------------------------------------
// One batch of this rank with operations to other ranks: per peer, its operations with it and the totals at its end.
struct BatchOps {
  int64_t sends = 0, recvs = 0;  // in this batch
  int64_t total_sends = 0, total_recvs = 0;  // in this rank's batches up to this one's end
};
struct GlobalBatch {
  int64_t batch = 0;
  std::string site;
  std::map<int, BatchOps> peers;
};
struct CycleReport {
  std::string report;      // "" or the one-line report of a cycle through this rank
  std::vector<int> ranks;  // the cycle's ranks (of the group)
};
// This rank's batches replayed as NCCL runs all ranks' (the pair replay's rule over every peer at once), its head
// published in the group's store, and the batches of later ranks it waits for.
struct GlobalReplay {
  std::deque<GlobalBatch> pending;  // not completed in the replay, the running one first
  int64_t head = 0, published_head = 0;  // this rank's batches completed, and as last published
  std::map<int, int64_t> heads;     // the peers' heads as last read
  std::string published_wait;       // this rank's wait record as last published
  // Advance as far as the peers' published batches and heads allow and publish the head; ``search``: when the
  // running batch waits for batches that peers posted behind the ones they run, publish those waits and look for
  // a cycle of three or more ranks through this rank, reported by its lowest rank only (of two: the pair replay).
  CycleReport step(c10d::Store& store, const std::string& group, int rank, std::map<int, PairQueue>& pairs,
                   bool search);
};

// ---- the pace of a blocked wait's searches (collective_wait.cpp, wait_cycle.cpp) ------------------------
// A wait blocked in a legal long wait (rank 0 writing a checkpoint while the others sit in an all-reduce) must not
// flood the job's store: every record change bumps a version counter in the store, a search runs only when the
// version moved since the last one began (the records it follows are then as they were: the same answer), and the
// polls back off from kFirst to kMost while nothing moves (back to kFirst when something does).
struct SearchPace {
  static constexpr std::chrono::milliseconds kFirst{100}, kMost{1000};
  std::chrono::milliseconds interval = kFirst;
  int64_t searched = -1;  // the version read before the last search
  // Whether a search is due now, given the ``version`` just read; advances the backoff when it is not.
  bool due(int64_t version);
};
// ``store`` wrapped so that every operation on it (and on its clones) is counted (counted_store.cpp); every
// simccl communicator's store is one. store_ops(): the count in this process (tests bound the traffic of a legal
// long wait with it).
c10::intrusive_ptr<c10d::Store> counted_store(c10::intrusive_ptr<c10d::Store> store);
int64_t store_ops();

// ---- cycles closed by wait() (wait_cycle.cpp) ------------------------------------------------------
// A wait() on an unbatched operation issued before its peer's counterpart (await_pair_place): polled while it is
// blocked, it publishes what it waits for after a while and looks for a cycle of such waits through this rank.
class BlockedWait {
 public:
  BlockedWait(c10::intrusive_ptr<c10d::Store> store, std::string group, int rank, int peer, std::string key,
              std::string op);
  void enter();  // the wait begins
  // At each poll: the report of a cycle of blocked wait() calls through this rank (by its lowest rank), or none.
  CycleReport poll();
  void leave();  // the wait is over: its record withdrawn

 private:
  std::string peer_gone();  // "" or the report of a peer stuck or gone before posting the counterpart (stuck.cpp)
  c10::intrusive_ptr<c10d::Store> store_;
  std::string group_;
  int rank_, peer_;
  std::string key_, op_, record_;  // record_: as published ("" before)
  std::chrono::steady_clock::time_point since_, searched_;
  SearchPace pace_;
  std::mutex mu_;  // poll() runs on the watchdog for batched waits while the issuing thread may leave()
  bool left_ = false;  // leave() ran: a later poll() publishes nothing
};

// ---- cycles of wait() on collectives across groups (collective_wait.cpp) ------------------------------
// This process issued the ``k``-th collective of ``group`` (counted for the records of blocked waits).
void note_collective_issued(const std::string& group, int64_t k);
// The job's store under a group's prefix stores (counted): where the ranks' records of blocked waits meet.
c10::intrusive_ptr<c10d::Store> job_store(c10::intrusive_ptr<c10d::Store> store);
// Publish this rank's global rank (``global``) as member ``rank`` of the group whose store ``group_store`` is.
void publish_member(c10d::Store& group_store, int rank, int global);
// Member ``rank`` (``global`` in the job) of ``group`` (``size`` members) released it (destroy_process_group, or the
// end of its process) after issuing ``issued`` of its collectives: a member's wait() blocked on a later one of the
// group is then reported at its next search. A report told to this rank about the group and never raised is
// dropped; the last member to release deletes the group's records (members, releases): none outlive the group.
void publish_released(const c10::intrusive_ptr<c10d::Store>& group_store, const std::string& group, int rank, int size,
                      int global, int64_t issued);
// A wait() on the ``k``-th collective of a group (``size`` members; this rank ``global`` in the job): polled while
// it is blocked, it publishes what it waits for after a while and looks for a cycle of such waits through groups.
class CollectiveWait {
 public:
  // ``rank``: this rank in the group (``size`` members).
  CollectiveWait(c10::intrusive_ptr<c10d::Store> group_store, std::string group, int rank, int size, int global,
                 int64_t k, std::string op);
  // At each poll of the blocked wait (the first starts the clock): "" or the report of a cycle through this rank,
  // found here (by the cycle's lowest rank; the members of its groups told) or told by the rank that found it
  // about this wait's group at this wait's collective or an earlier one (never another group's).
  std::string poll();
  void leave();  // the wait is over: its record withdrawn
  // ``report`` (another check's, e.g. the deadlock bound's on this rank) told to every other member of the group,
  // whose blocked wait() on this collective of the group or a later one raises it at its next poll: on NCCL they
  // hang behind this rank there (and nowhere else). Any thread.
  void tell(const std::string& report) const;

 private:
  bool publish();  // false while a member has not published its global rank
  std::string released_member() const;  // "" or the report of a member that released the group before issuing k_
  std::string told() const;  // "" or a report told to this rank about this wait's collective (taken)
  c10::intrusive_ptr<c10d::Store> group_store_, store_;
  std::string group_, op_, record_;
  int rank_, size_, global_;
  int64_t k_;
  bool started_ = false;
  std::chrono::steady_clock::time_point since_, searched_;
  SearchPace pace_;
};


// ---- members that never issue again: stuck behind a report, or gone (stuck.cpp) ----------------------
// A rank whose device broke with a report (a deadlock found, or told to it: its communicator aborted, as NCCL's)
// raises that report from every later operation on the device, so it never issues another; on NCCL it hangs where
// the report was found. A member that released a group issues nothing more on it either. Each is published in the
// group's store under gone_key(rank), so a peer's wait() blocked on an operation it never issues (a receive whose
// sender is stuck in a collective on another group; a collective it never issued) raises instead of waiting for the
// timeout. Both version counters are bumped with it, so a blocked wait's next search reads it.
constexpr char kBlockedVersion[] = "simccl/blocked/version";   // the group's store (wait_cycle.cpp)
constexpr char kCollectiveVersion[] = "simccl/cwait/version";  // the job's store (collective_wait.cpp)
std::string gone_key(int rank);
// This process's member ``rank`` of the group whose store ``store`` is (its name ``group``; ``completed``: how many
// of its collectives its device completed so far, read when it is published stuck), until forget_member(owner).
void remember_member(const void* owner, c10::intrusive_ptr<c10d::Store> store, std::string group, int rank,
                     std::function<int64_t()> completed);
void forget_member(const void* owner);
// Device ``index`` broke with ``report``: published once, in every group this process is a member of. Any thread,
// off every lock (store operations). publish_broken_devices(): every broken device's (at a communicator's release).
void publish_stuck(int index, const std::string& report);
void publish_broken_devices();
// Member ``rank`` released the group whose store ``store`` is: published unless it was published stuck.
void publish_gone(c10d::Store& store, int rank);
// What member ``rank`` published (never blocks): stuck (after issuing ``issued`` of the group's collectives, with
// its ``report``), released, or neither.
struct Gone {
  bool stuck = false, released = false;
  int64_t completed = 0;  // stuck: how many of the group's collectives its device completed (none completes after)
  std::string report;
};
Gone member_gone(c10d::Store& store, int rank);
// Whether a report left for this process by a peer (a point-to-point deadlock, a cycle) waits unread under the
// report key of a group it watches (comm_queue.cpp): the watchdog breaks the device with that report itself, the
// same failure a stuck peer's report would say again, so a stuck peer is not reported meanwhile.
bool report_left_unread();

}  // namespace sim
