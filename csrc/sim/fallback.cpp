// The boxed fallback: every aten op without a sim kernel runs on the CPU kernel, over CPU views of
// device memory (no copies: device memory is host memory).
//
// Arguments: device tensors become CPU views (one alias storage per device storage, so the CPU
// kernel sees views of one buffer as one buffer); a sim Device becomes cpu; a missing or sim
// Generator becomes the device generator's own CPU generator. Afterwards: an argument the kernel
// resized (out=) keeps the new memory; results that view an argument become device views of it;
// fresh results have their host memory adopted as device memory (counted, not copied).
// Real-device rules are kept: a host tensor with dimensions beside device tensors, or a CPU
// generator for a device op, is an error; data-dependent output shapes count as host syncs.
// Each call is a kernel on the current stream for the race detector (race.cpp): an argument annotated
// ``Tensor(a!)`` is written, a view op's aliased input is not accessed, any other is read, and a fresh
// result is written; the accesses are checked before the CPU kernel runs.
#include "sim.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

namespace sim {
namespace {

// Ops that wait for device data to size their result (counted as "shape" syncs).
const std::unordered_set<std::string> kDataDependent = {
    "aten::nonzero", "aten::masked_select", "aten::_unique", "aten::_unique2", "aten::unique_dim",
    "aten::unique_consecutive", "aten::unique_dim_consecutive", "aten::bincount", "aten::repeat_interleave"};
// Ops that take host index tensors beside device tensors on real devices.
const std::unordered_set<std::string> kHostIndices = {"aten::index", "aten::index_put_", "aten::_index_put_impl_",
                                                      "aten::index_put"};

struct StorageAlias {
  c10::Storage device, host;
  const void* data;
};

// Per-call state of one fallback: the device tensors replaced and their alias storages.
struct Call {
  std::vector<StorageAlias> storages;
  std::vector<std::pair<at::Tensor, at::Tensor>> tensors;  // (device, cpu view)
  std::vector<const c10::StorageImpl*> host_inputs;
  c10::DeviceIndex device = -1;
  bool host_tensor = false, bool_index = false;
  const char* op = "";
  uint64_t point = 0;  // this kernel's point on its stream
  std::optional<Kernel> kernel;  // its accesses, for the race detector

  Kernel& race_kernel() {
    if (device < 0) device = current_device();
    if (point == 0) point = note_kernel(device);
    if (!kernel) kernel.emplace(device, static_cast<int>(current_stream(device).id()), point, op);
    return *kernel;
  }

  c10::Storage alias(const c10::Storage& st) {
    for (auto& s : storages)
      if (s.device.unsafeGetStorageImpl() == st.unsafeGetStorageImpl()) return s.host;
    storages.push_back({st, cpu_alias_storage(st), st.data()});
    return storages.back().host;
  }

  // ``use``: how the kernel accesses the tensor's memory (none: a view op's aliased input).
  at::Tensor to_cpu(const at::Tensor& t, std::optional<Use> use) {
    if (!t.defined()) return t;
    if (!t.is_privateuseone()) {
      if (t.dim() > 0) host_tensor = true;
      if (t.has_storage()) host_inputs.push_back(t.storage().unsafeGetStorageImpl());
      if (t.scalar_type() == at::kBool || t.scalar_type() == at::kByte) bool_index = true;
      return t;
    }
    if (device < 0) device = t.device().index();
    Kernel& k = race_kernel();
    check_not_in_flight(t, op);
    note_use(t.storage(), point, op);
    if (use) k.use(t, *use);
    if (t.scalar_type() == at::kBool || t.scalar_type() == at::kByte) bool_index = true;
    auto cpu = at::detail::make_tensor<c10::TensorImpl>(alias(t.storage()), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                        t.dtype());
    cpu.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
    if (t.is_conj()) cpu._set_conj(true);
    if (t.is_neg()) cpu._set_neg(true);
    tensors.emplace_back(t, cpu);
    return cpu;
  }

  c10::IValue arg_to_cpu(const c10::IValue& v, std::optional<Use> use) {
    if (v.isTensor()) return to_cpu(v.toTensor(), use);
    if (v.isTensorList()) {
      c10::List<at::Tensor> out;
      for (const at::Tensor& t : v.toTensorList()) out.push_back(to_cpu(t, use));
      return out;
    }
    if (v.isList()) {
      auto in = v.toList();
      c10::impl::GenericList out(in.elementType());
      for (const c10::IValue& e : in) out.push_back(e.isTensor() ? c10::IValue(to_cpu(e.toTensor(), use)) : e);
      return out;
    }
    if (v.isDevice() && v.toDevice().type() == kSim) {
      if (device < 0) device = v.toDevice().has_index() ? v.toDevice().index() : current_device();
      return c10::Device(c10::kCPU);
    }
    return v;
  }

  // After the CPU kernel: memory it reallocated for an argument becomes that argument's device memory,
  // and new sizes/strides it gave an argument are given to the device tensor. The old block is freed here, so the
  // kernel's accesses recorded against it are dropped first (commit() would write into the freed block), and the
  // new memory is recorded as written by this kernel: a later kernel on another stream reading it is checked.
  void write_back() {
    std::vector<const c10::StorageImpl*> moved;
    for (auto& s : storages) {
      if (s.host.data() == s.data) continue;
      size_t nbytes = s.host.nbytes();
      if (kernel) kernel->forget(history_slot(s.device));
      c10::DataPtr host = s.host.set_data_ptr(c10::DataPtr(nullptr, c10::Device(c10::kCPU)));
      s.device.set_data_ptr_noswap(adopt(std::move(host), nbytes, s.device.device().index()));
      s.device.set_nbytes(nbytes);
      s.data = s.device.data();
      moved.push_back(s.device.unsafeGetStorageImpl());
    }
    for (auto& [dev, cpu] : tensors) {
      if (dev.sizes() != cpu.sizes() || dev.strides() != cpu.strides() || dev.storage_offset() != cpu.storage_offset())
        dev.unsafeGetTensorImpl()->set_sizes_and_strides(cpu.sizes(), cpu.strides(), cpu.storage_offset());
      if (std::count(moved.begin(), moved.end(), dev.storage().unsafeGetStorageImpl()))
        race_kernel().use(dev, Use::write);
    }
  }

  at::Tensor to_device(const at::Tensor& t, size_t outputs) {
    if (!t.defined() || !t.is_cpu()) return t;
    for (auto& [dev, cpu] : tensors)
      if (cpu.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) return dev;  // in place / out=: the argument itself
    const c10::StorageImpl* st = t.storage().unsafeGetStorageImpl();
    for (auto& s : storages)
      if (s.host.unsafeGetStorageImpl() == st) return wrap_storage(s.device, t);  // a view of an argument
    c10::DeviceIndex index = device < 0 ? current_device() : device;
    bool shared = t.storage().use_count() > outputs;
    for (auto* h : host_inputs) shared = shared || h == st;
    if (shared) {  // memory someone else holds: copy it into fresh device memory
      c10::Storage fresh(c10::Storage::use_byte_size_t(), t.storage().nbytes(), allocator(), true);
      std::memcpy(fresh.mutable_data(), t.storage().data(), t.storage().nbytes());
      return written(wrap_storage(std::move(fresh), t));
    }
    size_t nbytes = t.storage().nbytes();
    c10::Storage host = t.storage();
    c10::DataPtr data = host.set_data_ptr(c10::DataPtr(nullptr, c10::Device(c10::kCPU)));
    c10::Storage adopted(c10::Storage::use_byte_size_t(), nbytes, adopt(std::move(data), nbytes, index), allocator(),
                         true);
    storages.push_back({adopted, host, nullptr});  // later results over the same memory share it
    return written(wrap_storage(std::move(adopted), t));
  }

  // A fresh result: written by this kernel on its stream.
  at::Tensor written(at::Tensor t) {
    race_kernel().use(t, Use::write);
    return t;
  }
};

// How an op accesses an argument (its schema's alias annotation): written (``Tensor(a!)``), not at all
// (``Tensor(a)``: a view op's input, which its result aliases), else read.
std::optional<Use> use_of(const c10::Argument& arg) {
  const c10::AliasInfo* info = arg.alias_info();
  if (!info) return Use::read;
  if (info->isWrite()) return Use::write;
  for (const auto& contained : info->containedTypes())
    if (contained.isWrite()) return Use::write;
  return std::nullopt;
}

bool is_optional_generator(const c10::Argument& arg) {
  auto type = arg.type();
  if (auto opt = type->cast<c10::OptionalType>()) type = opt->getElementType();
  return type->kind() == c10::TypeKind::GeneratorType;
}

void substitute_generators(const c10::FunctionSchema& schema, torch::jit::Stack* stack, size_t begin,
                           c10::DeviceIndex device) {
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    if (!is_optional_generator(schema.arguments()[i])) continue;
    c10::IValue& v = (*stack)[begin + i];
    if (v.isNone()) {
      v = cpu_generator_of(default_generator(device < 0 ? current_device() : device));
    } else if (v.isGenerator()) {
      v = cpu_generator_of(v.toGenerator());  // a CPU generator for a device op is an error, as on CUDA
    }
  }
}

size_t count_output_tensors(torch::jit::Stack* stack, size_t begin) {
  size_t n = 0;
  for (size_t i = begin; i < stack->size(); ++i) {
    const auto& v = (*stack)[i];
    n += v.isTensor() ? 1 : v.isTensorList() ? v.toTensorList().size() : 0;
  }
  return n;
}

void sim_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const std::string& name = schema.name();
  const size_t nargs = schema.arguments().size(), begin = stack->size() - nargs;
  check_deferred();
  Call call;
  call.op = name.c_str();
  for (size_t i = begin; i < stack->size(); ++i)
    (*stack)[i] = call.arg_to_cpu((*stack)[i], use_of(schema.arguments()[i - begin]));
  TORCH_CHECK(!call.host_tensor || call.tensors.empty() || kHostIndices.count(name),
              "Expected all tensors to be on the same device, but found at least two devices, sim:",
              int(call.device), " and cpu! (when checking arguments for ", name, ")");
  substitute_generators(schema, stack, begin, call.device);
  if (kDataDependent.count(name)) count_sync("shape", name.c_str());
  if (name == "aten::equal") count_sync("compare", name.c_str());
  // index_put_ with a boolean mask sizes its work from device data (aten::index turns masks into
  // nonzero before it gets here, and nonzero is counted).
  if (kHostIndices.count(name) && name != "aten::index" && call.bool_index) count_sync("shape", name.c_str());
  if (call.kernel) call.kernel->check();  // before the kernel runs: a race leaves the data as it was
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  call.write_back();
  const size_t rbegin = stack->size() - schema.returns().size();
  const size_t outputs = count_output_tensors(stack, rbegin);
  for (size_t i = rbegin; i < stack->size(); ++i) {
    c10::IValue& v = (*stack)[i];
    if (v.isTensor()) {
      v = call.to_device(v.toTensor(), outputs);
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> out;
      for (const at::Tensor& t : v.toTensorList()) out.push_back(call.to_device(t, outputs));
      v = out;
    }
  }
  if (call.kernel) {
    call.kernel->check();  // its fresh results: memory allocated after an unsafe free may hold that tensor's bytes
    call.kernel->commit();
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&sim_fallback>());
}

}  // namespace sim
