// The happens-before race detector of the sim device: every access of a kernel to device memory is
// checked for the order a GPU would require, though the kernel itself runs when issued.
//
// Kernels run at issue on the host (deterministic: data is final at once), so a GPU race never shows
// in the numbers here; it is found by order instead. Each allocation block keeps the accesses made
// to it: (byte span, stream, the kernel's point on that stream, read or write, op). A kernel on
// stream s conflicts with an earlier access on another stream t to an overlapping span -- its read
// with t's write (read-after-write), its write with t's write or read (write-after-write,
// write-after-read) -- unless s is ordered after that access: stream s's vector clock (Event.wait,
// wait_stream, a collective's work.wait()) or the host's (synchronize, a blocking copy to the host,
// a query that said done) covers t's point (stream.cpp). A conflict raises one line from the op
// naming both kernels, both streams and the fix. Compute never completes on its own, so a missing
// wait is found every time, not when the race happens to lose.
//
// Granularity: the byte extent of each tensor within its block (a strided view spans its first to
// its last element), so disjoint slices of one block used on two streams are not reported, while
// interleaved strided views (x[0::2] on one stream, x[1::2] on another) overlap in extent and are.
// A write drops the records it covers (they are ordered before it, or it raised); a read drops the
// same stream's reads it covers. Past kPrune records a block drops those the host has observed
// (every later kernel is ordered after them); past kCoalesce the rest are merged per (stream, kind)
// into one span at the latest point, which may then report disjoint spans (never seen in the tests).
// Missed: a race between two communicators sharing a stream slot (sim.h), and one between kernels
// that two host threads issue at once (each checks before the other records).
#include "sim.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>
#include <sstream>

namespace sim {

struct Record {
  uint64_t lo, hi, point;
  const char* op;
  int stream;
  Use use;
  size_t freed = 0;   // > 0: a use of a freed tensor of this many bytes whose memory this block may be
  int freed_on = 0;   // that tensor's allocation stream
};

struct History {
  std::vector<Record> records;
  size_t limit = 0;  // prune when the records pass it (0: kPrune)
};

namespace {

constexpr size_t kPrune = 64, kCoalesce = 4096;
std::atomic<int64_t> g_accesses{0}, g_ordered{0};  // accesses recorded; cross-stream conflicts found ordered
std::mutex g_mutex;  // every block's history (taken before a device's stream lock, never after)
std::mutex g_names_mutex;
std::string g_comm_names[kMaxDevices][kCommStreams];

std::string stream_name(c10::DeviceIndex index, int s) {
  std::ostringstream os;
  if (s >= kFirstComm) {
    std::lock_guard<std::mutex> lock(g_names_mutex);
    os << "the communicator stream of group '" << g_comm_names[index][s - kFirstComm] << "'";
  } else {
    os << "stream " << s << (s == 0 ? " (the default stream)" : "");
  }
  return os.str();
}

const char* verb(Use u) { return u == Use::read ? "reads" : "writes"; }
const char* past(Use u) { return u == Use::read ? "read" : "wrote"; }

bool host_read(const char* op) {
  return std::strcmp(op, "item()") == 0 || std::strcmp(op, "a blocking copy to the host") == 0;
}

std::string fix(int s, int t, const std::string& sn, const std::string& tn, const char* op, Use use) {
  if (t >= kFirstComm)
    return "call work.wait() on that collective before touching its tensors (it makes the current stream wait for "
           "the communicator; another stream must then wait for that one: wait_stream)";
  if (s >= kFirstComm)
    return "make the stream that issues the collective wait for " + tn +
           " first (current_stream().wait_stream(stream) or event.wait()): a collective waits only for the issuing "
           "thread's current stream";
  std::string f = "add " + sn + ".wait_stream(" + tn + ") (or an event recorded on " + tn + " and event.wait() on " + sn +
                  ") between them";
  if (use == Use::write) f += ", or, for a tensor freed and reused, tensor.record_stream(" + tn + ")";
  if (host_read(op))
    f = "a blocking copy to the host waits only for the current stream: synchronize " + tn + " or " + f;
  return f;
}

// A kernel on stream ``s`` touches memory allocated after a tensor ``r`` names was freed while stream r.stream may
// still have been using it: the caching allocator may have given this allocation that tensor's bytes.
std::string freed_message(c10::DeviceIndex index, int s, const char* op, Use use, const Record& r) {
  std::ostringstream os;
  os << "sim: a tensor (" << r.freed << " bytes, allocated on stream " << r.freed_on << " of sim:" << int(index)
     << ") was freed while " << stream_name(index, r.stream) << " may still be using it (" << r.op
     << " ran on it there at its point " << r.point << "; no record_stream), and " << op << " " << verb(use) << " on "
     << stream_name(index, s) << " memory allocated on stream " << r.freed_on
     << " after that free (the caching allocator may have given it that tensor's bytes) with nothing ordering it "
     << "after that use: call tensor.record_stream(stream) after using it on another stream, or make stream " << s
     << " wait for stream " << r.stream << " (wait_stream) before using memory allocated after the free";
  return os.str();
}

// ``[lo, hi)``: the access's bytes (the message names those both touch).
std::string message(c10::DeviceIndex index, int s, const char* op, Use use, const Record& r, uint64_t lo, uint64_t hi,
                    size_t nbytes) {
  if (r.freed) return freed_message(index, s, op, use, r);
  const char* kind = use == Use::read ? "read-after-write" : r.use == Use::write ? "write-after-write" : "write-after-read";
  std::string sn = stream_name(index, s), tn = stream_name(index, r.stream);
  std::string ss = "stream " + std::to_string(s), ts = "stream " + std::to_string(r.stream);  // short, for the fix
  std::ostringstream os;
  os << "sim: race (" << kind << ") on sim:" << int(index) << " memory (bytes [" << std::max(lo, r.lo) << ", " << std::min(hi, r.hi) << ") of a "
     << nbytes << "-byte block): " << op << " " << verb(use) << " it on " << sn << " while " << r.op << " "
     << past(r.use) << " it on " << tn << " at its point " << r.point << ", with nothing ordering " << sn
     << " after that: " << fix(s, r.stream, ss, ts, op, use);
  return os.str();
}

bool overlaps(const Record& r, uint64_t lo, uint64_t hi) { return r.lo < hi && lo < r.hi; }

// Merge the records of each (stream, kind) into one (lock held): a conservative bound on the history.
void coalesce(History& h) {
  std::vector<Record> merged;
  for (const Record& r : h.records) {
    auto it = std::find_if(merged.begin(), merged.end(), [&](const Record& m) { return m.stream == r.stream && m.use == r.use; });
    if (it == merged.end()) {
      merged.push_back(r);
      continue;
    }
    it->lo = std::min(it->lo, r.lo);
    it->hi = std::max(it->hi, r.hi);
    if (r.point >= it->point) {
      it->point = r.point;
      it->op = r.op;
    }
  }
  h.records.swap(merged);
}

// Drop the records the host has observed, then coalesce if still too many (lock held).
void prune(History& h, c10::DeviceIndex index) {
  Clock observed = host_clock(index);
  h.records.erase(std::remove_if(h.records.begin(), h.records.end(),
                                 [&](const Record& r) { return observed.v[r.stream] >= r.point; }),
                  h.records.end());
  if (h.records.size() > kCoalesce) coalesce(h);
  h.limit = std::max(kPrune, 2 * h.records.size());
}

}  // namespace

std::pair<int64_t, int64_t> race_stats() { return {g_accesses.load(), g_ordered.load()}; }

void drop_history(History* h) { delete h; }  // the block is gone: no kernel holds it

void name_comm_stream(c10::DeviceIndex index, int stream, const std::string& group) {
  std::lock_guard<std::mutex> lock(g_names_mutex);
  g_comm_names[index][stream - kFirstComm] = group;
}

void note_freed_use(History** slot, size_t nbytes, int stream, uint64_t point, const char* op, size_t freed,
                    int freed_on) {
  if (!slot || !nbytes) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!*slot) *slot = new History();
  // a write: any access by a kernel not ordered after the stale use conflicts with it
  (*slot)->records.push_back({0, nbytes, point, op, stream, Use::write, freed, freed_on});
}

void Kernel::use(const at::Tensor& t, Use u) {
  if (!t.defined() || !t.is_privateuseone() || !t.has_storage() || t.numel() == 0) return;
  History** slot = history_slot(t.storage());
  if (!slot) return;
  int64_t extent = 1;
  for (int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * t.stride(d);
  uint64_t lo = static_cast<uint64_t>(t.storage_offset()) * t.element_size();
  accesses_.push_back({slot, lo, lo + static_cast<uint64_t>(extent) * t.element_size(), t.storage().nbytes(), u});
}

void Kernel::check() {
  if (checked_ == accesses_.size()) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  std::optional<Clock> after;  // loaded at the first conflict candidate: most kernels never need it
  for (size_t i = checked_; i < accesses_.size(); ++i) {
    const Access& a = accesses_[i];
    const History* h = *a.slot;
    if (!h) continue;
    for (const Record& r : h->records) {
      if (r.stream == stream_ || !overlaps(r, a.lo, a.hi) || (r.use == Use::read && a.use == Use::read)) continue;
      if (!after) after = stream_clock(index_, stream_);
      TORCH_CHECK(after->v[r.stream] >= r.point, message(index_, stream_, op_, a.use, r, a.lo, a.hi, a.nbytes));
      g_ordered.fetch_add(1, std::memory_order_relaxed);
    }
  }
  checked_ = accesses_.size();
}

void Kernel::forget(History** slot) {
  size_t kept = 0, checked = 0;
  for (size_t i = 0; i < accesses_.size(); ++i) {
    if (accesses_[i].slot == slot) continue;
    checked += i < checked_;
    accesses_[kept++] = accesses_[i];
  }
  accesses_.resize(kept);
  checked_ = checked;
}

void Kernel::commit() {
  if (accesses_.empty()) return;
  g_accesses.fetch_add(static_cast<int64_t>(accesses_.size()), std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(g_mutex);
  for (const Access& a : accesses_) {
    History*& h = *a.slot;
    if (!h) h = new History();
    auto& rs = h->records;
    // A write covers every record inside its span (each is ordered before it: check() passed); a read covers
    // its own stream's reads there.
    rs.erase(std::remove_if(rs.begin(), rs.end(),
                            [&](const Record& r) {
                              return r.lo >= a.lo && r.hi <= a.hi &&
                                     (a.use == Use::write || (r.stream == stream_ && r.use == Use::read));
                            }),
             rs.end());
    rs.push_back({a.lo, a.hi, point_, op_, stream_, a.use});
    if (rs.size() > std::max(kPrune, h->limit)) prune(*h, index_);
  }
}

}  // namespace sim
