// simccl's process-group-level checks and flight record (declared in comm.h).
//
// The engine's Collectives layer records and, in strict mode, checks the collectives it issues; FSDP2,
// DCP and plain torch.distributed calls bypass it. Their collectives still reach the process-group
// backend, so simccl records every operation here (issue, completion on the communicator, the host's
// wait) and, in strict mode, exchanges the fingerprint of each collective the engine did not check
// itself with the group's other ranks before it runs, as the engine's own check does.
#include "comm.h"

#include <chrono>
#include <cstring>
#include <cstdlib>
#include <ctime>
#include <deque>
#include <iomanip>
#include <mutex>
#include <sstream>

namespace sim {
namespace {

using WallClock = std::chrono::system_clock;

struct Record {
  int64_t id;
  std::string op, group, detail, where, thread, error;
  WallClock::time_point issued, finished, waited;
  bool is_finished = false, is_waited = false;
};

std::mutex g_record_mutex;
std::deque<Record> g_records;
int64_t g_next_record = 0;

size_t record_capacity() {
  static const size_t n = [] {
    const char* s = std::getenv("OMNITRON_FLIGHT_RECORDER_SIZE");
    return static_cast<size_t>(s ? std::atoi(s) : 256);
  }();
  return n;
}

Record* find_record(int64_t id) {  // lock held; records leave the ring oldest first, so ids stay sorted
  if (g_records.empty() || id < g_records.front().id) return nullptr;
  size_t i = static_cast<size_t>(id - g_records.front().id);
  return i < g_records.size() ? &g_records[i] : nullptr;
}

std::string stamp(WallClock::time_point t) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count();
  std::time_t secs = static_cast<std::time_t>(ms / 1000);
  std::tm tm{};
  localtime_r(&secs, &tm);
  std::ostringstream os;
  os << std::put_time(&tm, "%H:%M:%S") << '.' << std::setw(3) << std::setfill('0') << ms % 1000;
  return os.str();
}

constexpr int64_t kHeaderBytes = 512;  // one encoded fingerprint, as omnitron/backends/flight.py's

at::Tensor encode(const std::string& text) {
  auto buf = at::zeros({kHeaderBytes}, at::kByte);
  std::memcpy(buf.data_ptr(), text.data(), std::min<size_t>(text.size(), kHeaderBytes));
  return buf;
}

std::string decode(const at::Tensor& buf) {
  const char* p = static_cast<const char*>(buf.data_ptr());
  return std::string(p, strnlen(p, kHeaderBytes));
}

}  // namespace

std::string fingerprint(const std::vector<at::Tensor>& ts, const std::string& extra) {
  std::ostringstream os;
  if (ts.empty()) {
    os << "no tensors";
  } else {
    os << "shape=" << ts[0].sizes() << " dtype=" << ts[0].scalar_type();
    if (ts.size() > 1) os << " x" << ts.size();
  }
  if (!extra.empty()) os << " " << extra;
  return os.str();
}

std::string reduce_name(const c10d::ReduceOp& op) {
  static const char* names[] = {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"};
  auto i = static_cast<size_t>(op.op_);
  return std::string("op=") + (i < sizeof(names) / sizeof(names[0]) ? names[i] : "UNUSED");
}

// ---- the flight record ---------------------------------------------------------------------------
int64_t record_issue(const std::string& op, const std::string& group, const std::string& detail, const Site& site) {
  if (record_capacity() == 0) return -1;
  std::lock_guard<std::mutex> lock(g_record_mutex);
  Record r;
  r.id = g_next_record++;
  r.op = op, r.group = group, r.detail = detail, r.where = site.where, r.thread = site.thread;
  r.issued = WallClock::now();
  g_records.push_back(std::move(r));
  while (g_records.size() > record_capacity()) g_records.pop_front();
  return g_records.back().id;
}

void record_finish(int64_t id, const std::string& error) {
  std::lock_guard<std::mutex> lock(g_record_mutex);
  if (Record* r = find_record(id); r && !r->is_finished) {
    r->finished = WallClock::now();
    r->is_finished = true;
    r->error = error;
  }
}

void record_wait(int64_t id) {
  std::lock_guard<std::mutex> lock(g_record_mutex);
  if (Record* r = find_record(id); r && !r->is_waited) {
    r->waited = WallClock::now();
    r->is_waited = true;
  }
}

std::vector<std::string> comm_records() {
  std::lock_guard<std::mutex> lock(g_record_mutex);
  std::vector<std::string> out;
  for (const auto& r : g_records) {
    std::ostringstream os;
    os << "simccl #" << r.id << " " << stamp(r.issued) << " " << r.op << " group='" << r.group << "' " << r.detail
       << " at " << r.where << " (thread " << r.thread << ")";
    os << (r.is_finished ? (r.error.empty() ? " completed " : " failed ") + stamp(r.finished) : " not completed");
    if (r.is_waited) os << " waited " << stamp(r.waited);
    out.push_back(os.str());
  }
  return out;
}

// ---- strict mode ---------------------------------------------------------------------------------
bool strict_enabled() {  // read at each collective, as the engine's layer does (tests flip it)
  const char* s = std::getenv("OMNITRON_STRICT_COLLECTIVES");
  if (s == nullptr) return false;
  std::string v(s);
  return !(v.empty() || v == "0" || v == "false" || v == "False");
}

namespace {

std::vector<int64_t> parse_counts(const std::string& s) {  // "a,b,c"
  std::vector<int64_t> out;
  std::istringstream is(s);
  std::string field;
  while (std::getline(is, field, ',')) out.push_back(std::stoll(field));
  return out;
}

// An all_to_all's counts (``in=..`` to each rank, ``out=..`` from each) paired across the ranks: "" when rank i's
// count to j is j's count from i for every pair, else the one-line report of the first pair that differs.
std::string pair_counts(const std::string& group, const std::vector<std::pair<std::string, std::string>>& seen,
                        const std::vector<std::string>& counts) {
  size_t n = counts.size();
  std::vector<std::vector<int64_t>> to(n), from(n);
  for (size_t i = 0; i < n; ++i) {
    auto space = counts[i].find(" out=");
    if (counts[i].rfind("in=", 0) != 0 || space == std::string::npos) return "";  // cut short by the header's size
    to[i] = parse_counts(counts[i].substr(3, space - 3));
    from[i] = parse_counts(counts[i].substr(space + 5));
    if (to[i].size() != n || from[i].size() != n) return "";
  }
  for (size_t i = 0; i < n; ++i)
    for (size_t j = 0; j < n; ++j) {
      if (to[i][j] == from[j][i]) continue;
      std::ostringstream os;
      os << "sim strict: the ranks of group '" << group << "' issued an all_to_all whose counts do not pair: rank "
         << i << " (of the group) sends " << to[i][j] << " elements to rank " << j << " (" << seen[i].first << " at "
         << seen[i].second << "), which receives " << from[j][i] << " from it (" << seen[j].first << " at "
         << seen[j].second << "); NCCL moves each rank's split to its peer as is, so the receiver gets part of it or "
         << "waits for more: each rank's output split from a peer must be that peer's input split to it";
      return os.str();
    }
  return "";
}

}  // namespace

std::string exchange_fingerprints(c10d::Backend& gloo, const std::string& group, const std::string& key,
                                  const std::string& site) {
  int n = gloo.getSize();
  std::vector<at::Tensor> mine{encode(key + "\t" + site)};
  std::vector<std::vector<at::Tensor>> all(1);
  for (int i = 0; i < n; ++i) all[0].push_back(at::empty({kHeaderBytes}, at::kByte));
  gloo.allgather(all, mine)->wait();
  bool same = true;
  std::vector<std::pair<std::string, std::string>> seen;
  std::vector<std::string> counts;  // an all_to_all's, per rank
  for (const auto& t : all[0]) {
    std::string text = decode(t);
    auto tab = text.find('\t');
    seen.emplace_back(text.substr(0, tab), tab == std::string::npos ? "?" : text.substr(tab + 1));
    auto mark = seen.back().first.find(kCountsMark);
    if (mark != std::string::npos) {
      counts.push_back(seen.back().first.substr(mark + sizeof(kCountsMark) - 1));
      seen.back().first.resize(mark);
    }
    same = same && seen.back().first == key.substr(0, key.find(kCountsMark));
  }
  if (same && counts.size() == static_cast<size_t>(n)) return pair_counts(group, seen, counts);
  if (same) return "";
  std::ostringstream os;
  os << "sim strict: the ranks of group '" << group << "' issued different collectives:";
  for (size_t i = 0; i < seen.size(); ++i)
    os << (i ? ";" : "") << " rank " << i << " (of the group) " << seen[i].first << " at " << seen[i].second;
  os << " (every rank must issue a group's collectives in the same order, FSDP2's and DCP's included)";
  return os.str();
}

// ---- point-to-point order ------------------------------------------------------------------------
std::string encode_position(const P2PPosition& p) {
  return std::to_string(p.collectives) + "\t" + (p.batched ? "B" : "U") + p.last + "\t" + p.op;
}

std::string compare_positions(const std::string& group, int src, int dst, const std::string& sent,
                              const P2PPosition& mine) {
  auto a = sent.find('\t');
  auto b = sent.find('\t', a + 1);
  if (a == std::string::npos || b == std::string::npos) return "";
  int64_t theirs = std::stoll(sent.substr(0, a));
  bool batched = sent[a + 1] == 'B';
  std::string op = sent.substr(b + 1), last = sent.substr(a + 2, b - a - 2);
  if (batched != mine.batched) {  // ProcessGroupNCCL's communicator for each: the group's, or the pair's own
    const char* in = " inside a batch_isend_irecv";
    const char* out = " outside a batch";
    std::ostringstream os;
    os << "sim: point-to-point deadlock on group '" << group << "': rank " << src << " (of the group) issued " << op
       << (batched ? in : out) << ", but rank " << dst << " issued " << mine.op << (batched ? out : in)
       << ": ProcessGroupNCCL runs a batch on the group's communicator and an unbatched send or receive on the "
          "pair's own (torch's default, lazy initialization), so the two never match; batch both or neither";
    return os.str();
  }
  if (theirs == mine.collectives) return "";
  auto after = [](int64_t k, const std::string& last) {
    return std::to_string(k) + " of the group's collectives" + (k ? " (the last: " + last + ")" : "");
  };
  std::ostringstream os;
  os << "sim: point-to-point deadlock on group '" << group << "': rank " << src << " (of the group) issued "
     << op << " after " << after(theirs, last) << ", but rank " << dst
     << " issued " << mine.op << " after " << after(mine.collectives, mine.last)
     << ": NCCL runs a communicator's collectives and point-to-point operations in the order issued, so each "
        "waits for the other; issue the send and the receive at the same point among the group's collectives";
  return os.str();
}

}  // namespace sim
