// Python bindings of omnitron._sim: device count and index, memory statistics, RNG state, the
// host-sync counter and its hook, uncounted host copies, and the "simccl" collective backend.
#include "compat.h"
#include "sim.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/python.h>

namespace sim {
c10::intrusive_ptr<c10d::Backend> collective_backend(c10::intrusive_ptr<c10d::Backend> gloo);
}

namespace {

py::object* g_py_hook = nullptr;  // leaked on exit on purpose: no Python object outlives the interpreter here

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
                    py::arg("allocations") = s.allocations);
  });
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
                    py::arg("autograd_fallback") = bool(SIM_REGISTERS_AUTOGRAD_FALLBACK));
  }, "The torch this extension was compiled against and the version-dependent paths compiled (compat.h).");
  m.def("collective_backend", &sim::collective_backend, "Wrap a gloo backend as the sim device's collectives.");
}
