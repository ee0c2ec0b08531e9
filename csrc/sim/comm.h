// What simccl checks and records at the process-group level (comm_check.cpp): every collective and
// point-to-point operation of a sim communicator passes here, whoever issued it -- the engine's
// Collectives, FSDP2 (fully_shard), DCP or a plain torch.distributed call.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdint>
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
// runs; returns "" when every rank issued the same one, else a one-line report naming each rank's.
std::string exchange_fingerprints(c10d::Backend& gloo, const std::string& group, const std::string& key,
                                  const std::string& site);

// ---- point-to-point order against the group's collectives ----------------------------------------
// NCCL runs a communicator's collectives and point-to-point operations in the order issued, so a send
// issued after k of the group's collectives must be received after k of them on the peer too.
struct P2PPosition {
  int64_t collectives = 0;  // the group's collectives issued before it on this rank
  std::string last;         // the last of them, described ("" when none)
  std::string op;           // the send or receive itself, described
};
std::string encode_position(const P2PPosition& p);
// "" when the receiver's position matches what the sender published, else the one-line deadlock report.
std::string compare_positions(const std::string& group, int src, int dst, const std::string& sent,
                              const P2PPosition& mine);

}  // namespace sim
