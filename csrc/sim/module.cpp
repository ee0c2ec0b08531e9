// Python bindings of omnitron._sim: device count and index, memory statistics, RNG state, the
// host-sync counter and its hook, uncounted host copies, and the "simccl" collective backend.
#include "comm.h"
#include "compat.h"
#include "sim.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/python.h>

namespace sim {
c10::intrusive_ptr<c10d::Backend> collective_backend(c10::intrusive_ptr<c10d::Store> store,
                                                     c10::intrusive_ptr<c10d::Backend> gloo, bool sync_returns_none,
                                                     int global_rank, int64_t incarnation);
void set_site_hook(std::function<Site()> hook);
}

namespace {

py::object* g_py_hook = nullptr;  // leaked on exit on purpose: no Python object outlives the interpreter here
py::object* g_py_site = nullptr;

// fn() -> (call site, thread name, engine) of a collective being issued, for simccl's messages and checks.
void set_py_site_hook(py::object fn) {
  sim::set_site_hook(nullptr);
  delete g_py_site;
  g_py_site = nullptr;
  if (fn.is_none()) return;
  g_py_site = new py::object(std::move(fn));
  sim::set_site_hook([]() -> sim::Site {
    py::gil_scoped_acquire gil;
    auto [where, thread, engine] = (*g_py_site)().cast<std::tuple<std::string, std::string, bool>>();
    return {where, thread, engine};
  });
}

void set_py_sync_hook(py::object fn) {
  sim::set_sync_hook(nullptr);
  delete g_py_hook;
  g_py_hook = nullptr;
  if (fn.is_none()) return;
  g_py_hook = new py::object(std::move(fn));
  sim::set_sync_hook([](const std::string& kind, const std::string& op) {
    py::gil_scoped_acquire gil;
    (*g_py_hook)(kind, op);
  });
}

template <typename F>
auto with_generator(c10::DeviceIndex index, F&& f) {
  at::Generator gen = sim::default_generator(index);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return f(gen);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "The sim accelerator: a PrivateUse1 device over host memory (see csrc/sim).";
  m.def("device_count", [] { return int(sim::device_count()); });
  m.def("set_device_count", &sim::set_device_count);
  m.def("current_device", [] { return int(sim::current_device()); });
  m.def("set_device", [](int i) { sim::set_current_device(static_cast<c10::DeviceIndex>(i)); });
  m.def("memory_stats", [](int i) {
    auto s = sim::memory_stats(static_cast<c10::DeviceIndex>(i));
    return py::dict(py::arg("allocated") = s.allocated, py::arg("peak") = s.peak,
                    py::arg("allocations") = s.allocations, py::arg("reserved") = s.reserved,
                    py::arg("peak_reserved") = s.peak_reserved, py::arg("inactive_split") = s.inactive_split,
                    py::arg("cached_blocks") = s.cached_blocks);
  });
  m.def("empty_cache", &sim::empty_cache, "Return every cached free block to the host.");
  m.def("synchronize", [](int i) {
    py::gil_scoped_release nogil;
    sim::synchronize_collectives();
    sim::device_synchronize(static_cast<c10::DeviceIndex>(i));
  }, "Block until the device's streams, async copies and collectives are done.");
  m.def("shutdown", [] {
    py::gil_scoped_release nogil;
    sim::stop_collective_workers();
    sim::stop_async_workers();
  }, "Join the device's background threads (communicators, async copies) after their queued work; at exit.");
  m.def("check_deferred", &sim::check_deferred, "Raise an error found in a deleter (a tensor freed unsafely).");
  m.def("set_site_hook", &set_py_site_hook,
        "fn() -> (call site, thread, issued by the engine's collective layer) of an issued collective (None: stop).");
  m.def("flight_records", &sim::comm_records,
        "simccl's record of every operation (issue, completion on the communicator, the host's wait), oldest first.");
  m.def("race_stats", [] {
    auto [accesses, ordered] = sim::race_stats();
    return py::dict(py::arg("accesses") = accesses, py::arg("ordered_conflicts") = ordered);
  }, "The race detector's counts: device memory accesses recorded, cross-stream conflicts found ordered.");
  m.def("store_ops", &sim::store_ops,
        "Store operations simccl issued in this process, every one counted (their traffic, bounded by tests).");
  m.def("reset_peak", [](int i) { sim::reset_peak(static_cast<c10::DeviceIndex>(i)); });
  m.def("set_poison", &sim::set_poison, "Fill fresh device memory with 0xff bytes (NaN): uninitialised reads show.");
  m.def("sync_count", &sim::sync_count, py::arg("kind") = "");
  m.def("reset_sync_count", &sim::reset_sync_count);
  m.def("set_sync_hook", &set_py_sync_hook, "Call fn(kind, op) at every counted host sync (None: stop).");
  m.def("host_copy", &sim::host_copy, "A device-to-host copy that is not counted as a sync.");
  m.def("manual_seed", [](int i, uint64_t seed) {
    with_generator(i, [seed](at::Generator& g) { g.set_current_seed(seed); return 0; });
  });
  m.def("seed", [](int i) { return with_generator(i, [](at::Generator& g) { return g.seed(); }); });
  m.def("initial_seed", [](int i) { return with_generator(i, [](at::Generator& g) { return g.current_seed(); }); });
  m.def("get_rng_state", [](int i) { return with_generator(i, [](at::Generator& g) { return g.get_state(); }); });
  m.def("set_rng_state", [](int i, const at::Tensor& state) {
    with_generator(i, [&state](at::Generator& g) { g.set_state(state); return 0; });
  });
  m.def("build_features", [] {
    return py::dict(py::arg("torch") = TORCH_VERSION, py::arg("backend_set_timeout") = bool(SIM_BACKEND_HAS_SET_TIMEOUT),
                    py::arg("autograd_fallback") = bool(SIM_REGISTERS_AUTOGRAD_FALLBACK),
                    py::arg("sync_returns_none") = bool(SIM_OPTIONS_HAVE_ASYNC_OP));
  }, "The torch this extension was compiled against and the version-dependent paths compiled (compat.h).");
  m.def("collective_backend", &sim::collective_backend, py::arg("store"), py::arg("gloo"), py::arg("sync_returns_none") = false,
        py::arg("global_rank") = -1, py::arg("incarnation") = 1,
        "Wrap a gloo backend as the sim device's collectives (sync_returns_none: synchronous calls return no work; "
        "global_rank: this rank in the job, -1 for the group's rank; incarnation: 1 for the first group made under "
        "its name in this process, n for the n-th, whose store must be that incarnation's own).");
}
