// Pinned host memory of the sim accelerator, and the guard pages that catch an early host read.
//
// Pinned blocks are whole pages (page-aligned, a multiple of the page size), so a non_blocking
// device-to-host copy into one can protect the pages it will write (mprotect PROT_NONE) until it
// lands: a host read or write there before the stream or event is synchronized faults, and the
// SIGSEGV handler prints which copy it was and where it was issued before the previous handler (or
// the default one) ends the process. Pages only partly covered by the destination stay readable and
// hold garbage (NaN) until the copy lands. OMNITRON_SIM_GUARD_PAGES=0 turns the protection off.
#include "sim.h"

#include <c10/core/CPUAllocator.h>

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

namespace sim {
namespace {

const size_t kPage = static_cast<size_t>(sysconf(_SC_PAGESIZE));

// ---- pinned allocator -----------------------------------------------------------------------------
std::mutex g_pinned_mutex;
std::map<uintptr_t, size_t> g_pinned;  // start -> bytes

void pinned_free(void* ptr) {
  if (!ptr) return;
  size_t n = 0;
  {
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    auto it = g_pinned.find(reinterpret_cast<uintptr_t>(ptr));
    if (it != g_pinned.end()) {
      n = it->second;
      g_pinned.erase(it);
    }
  }
  if (n) mprotect(ptr, n, PROT_READ | PROT_WRITE);  // a copy never waited for: free() writes here
  std::free(ptr);
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* ptr = nullptr;
    size_t n = (nbytes + kPage - 1) / kPage * kPage;
    if (n) {
      TORCH_CHECK(posix_memalign(&ptr, kPage, n) == 0, "sim: out of pinned host memory (", n, " bytes)");
      std::lock_guard<std::mutex> lock(g_pinned_mutex);
      g_pinned[reinterpret_cast<uintptr_t>(ptr)] = n;
    }
    return {ptr, ptr, &pinned_free, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &pinned_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    if (count) std::memcpy(dest, src, count);
  }
};

PinnedAllocator g_pinned_allocator;

// ---- guard pages --------------------------------------------------------------------------------------
constexpr int kGuards = 64;
constexpr size_t kMessage = 768;
struct Guard {
  std::atomic<uintptr_t> lo{0};
  uintptr_t hi = 0;
  char message[kMessage];
};
Guard g_guards[kGuards];
std::mutex g_guard_mutex;
struct sigaction g_previous;
std::once_flag g_handler_once;

void on_fault(int, siginfo_t* info, void*) {
  auto a = reinterpret_cast<uintptr_t>(info->si_addr);
  for (auto& g : g_guards) {
    uintptr_t lo = g.lo.load();
    if (lo && a >= lo && a < g.hi) {
      ssize_t ignored = write(2, g.message, strlen(g.message));
      (void)ignored;
      break;
    }
  }
  sigaction(SIGSEGV, &g_previous, nullptr);  // returning re-runs the access: the previous handler sees it
}

void install_handler() {
  struct sigaction sa {};
  sa.sa_sigaction = &on_fault;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &g_previous);
}

bool guards_on() {
  static const bool on = [] {
    const char* s = std::getenv("OMNITRON_SIM_GUARD_PAGES");
    return !(s && std::string(s) == "0");
  }();
  return on;
}

}  // namespace

c10::Allocator* pinned_allocator() { return &g_pinned_allocator; }

bool is_pinned(const void* ptr) {
  auto p = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(g_pinned_mutex);
  auto it = g_pinned.upper_bound(p);
  if (it == g_pinned.begin()) return false;
  --it;
  return p < it->first + it->second;
}

int guard_pages(void* data, size_t nbytes, const std::string& message) {
  if (!guards_on()) return -1;
  auto lo = (reinterpret_cast<uintptr_t>(data) + kPage - 1) / kPage * kPage;
  auto hi = (reinterpret_cast<uintptr_t>(data) + nbytes) / kPage * kPage;
  if (hi <= lo) return -1;
  std::call_once(g_handler_once, install_handler);
  std::lock_guard<std::mutex> lock(g_guard_mutex);
  for (int i = 0; i < kGuards; ++i) {
    Guard& g = g_guards[i];
    if (g.lo.load()) continue;
    std::snprintf(g.message, kMessage, "%s\n", message.c_str());
    g.hi = hi;
    if (mprotect(reinterpret_cast<void*>(lo), hi - lo, PROT_NONE) != 0) return -1;
    g.lo.store(lo);
    return i;
  }
  return -1;  // every guard in use: the destination is garbage until it lands, unguarded
}

void release_guard(int guard) {
  if (guard < 0) return;
  std::lock_guard<std::mutex> lock(g_guard_mutex);
  Guard& g = g_guards[guard];
  uintptr_t lo = g.lo.load();
  mprotect(reinterpret_cast<void*>(lo), g.hi - lo, PROT_READ | PROT_WRITE);
  g.lo.store(0);
}

}  // namespace sim
