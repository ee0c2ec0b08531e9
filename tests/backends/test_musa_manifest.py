"""The MUSA backend's torch_musa surface: manifest vs source, manifest vs test double, arch gating,
kernel preconditions. Everything here runs on the double (results are MUSA-double, not MUSA)."""
from __future__ import annotations

import inspect
import os
import pathlib
import re

import pytest
import torch

from omnitron.backends.musa import backend as musa_backend
from omnitron.backends.musa import kernels as musa_kernels
from omnitron.backends.musa.backend import MUSABackend, musa_capabilities
from omnitron.testing import musa_double, torch_musa_api
from omnitron.testing.musa_double import DoubleConfig, MUSADoubleBackend, requires_double

MUSA_DIR = pathlib.Path(musa_backend.__file__).resolve().parent
NAME = re.compile(r"\b(torch\.musa(?:\.[A-Za-z_]\w*)+|torch_musa(?:\.[A-Za-z_]\w*)+|torch\.[A-Za-z_]\w*)")


def names_in_source() -> set[str]:
    """torch_musa names spelled in the backend's sources: ``torch.musa.X``, ``torch_musa.X`` and
    ``torch.X`` where stock torch has no ``X`` (an op torch_musa adds)."""
    found = set()
    for path in MUSA_DIR.glob("*.py"):
        for name in NAME.findall(path.read_text()):
            if name.startswith(("torch.musa.", "torch_musa.")):
                found.add(name)
            elif not name.startswith("torch.musa") and not hasattr(torch, name.split(".", 1)[1]):
                found.add(name)
    return found


def test_backend_source_uses_only_manifest_names():
    assert not musa_double.is_installed() and not hasattr(torch, "rope"), "run without the double installed"
    used = names_in_source()
    assert {"torch.musa.memory_allocated", "torch.rope", "torch.swish_glu"} <= used  # the grep works
    missing = used - musa_double.read_manifest()
    assert not missing, f"add to omnitron/backends/musa/manifest.txt: {sorted(missing)}"


def test_backend_never_aliases_torch_musa():
    """Aliases (``m = torch.musa``) would hide names from the manifest check."""
    alias = re.compile(r"=\s*(torch\.musa|torch_musa)\s*$|getattr\(torch,\s*[\"']musa")
    hits = [f"{p.name}:{i}" for p in MUSA_DIR.glob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if alias.search(line)]
    assert not hits, hits


TAGS = torch_musa_api.shipped()


def test_a_torch_musa_list_is_shipped():
    assert "v2.7.1" in TAGS, "scripts/extract_torch_musa_api.py output for torch_musa v2.7.1 is missing"
    for tag, path in TAGS.items():
        assert torch_musa_api.header(path)["tag"] == tag


@pytest.mark.parametrize("tag", sorted(TAGS))
def test_manifest_names_exist_in_torch_musa_source(tag):
    api = torch_musa_api.load(TAGS[tag])
    missing = musa_double.read_manifest() - set(api)
    assert not missing, f"not in torch_musa {tag}'s source: {sorted(missing)}"


@pytest.mark.parametrize("tag", sorted(TAGS))
def test_backend_calls_match_torch_musa_signatures(tag):
    """Every call the backend spells to a torch_musa function binds to that function's signature in the source."""
    api = {k: v for k, v in torch_musa_api.load(TAGS[tag]).items() if v is not None}
    found = [c for p in MUSA_DIR.glob("*.py") for c in torch_musa_api.calls(p.read_text(), set(api))]
    assert {"torch.rope", "torch.musa.Event", "torch.musa.amp.autocast"} <= {c[0] for c in found}  # the walk works
    bad = [f"{name} line {line}: {why}" for name, n, kw, line in found
           if (why := torch_musa_api.accepts(api[name], n, kw)) is not None]
    assert not bad, bad


def _double_signature(name: str) -> inspect.Signature:
    """The double's signature for a manifest name (``torch.musa.Stream.query`` without ``self``, ``torch.rope``)."""
    import sys

    musa = name.startswith("torch.musa.")
    owner, obj = None, sys.modules["torch.musa"] if musa else torch
    for attr in name.split(".")[2 if musa else 1:]:
        owner, obj = obj, getattr(obj, attr)
    sig = inspect.signature(obj)
    if isinstance(owner, type):
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    return sig


@requires_double()
@pytest.mark.parametrize("tag", sorted(TAGS))
def test_double_signatures_match_torch_musa_source(tag):
    """The double takes the same parameters (names, kinds, defaults) as torch_musa's definitions."""
    api = torch_musa_api.load(TAGS[tag])
    checked, bad = 0, []
    with musa_double.installed():
        for name in sorted(musa_double.read_manifest()):
            if api.get(name) is None:
                continue  # a module, a C-extension binding or a fact: no Python signature to compare
            ours = _double_signature(name)
            if torch_musa_api.shape(ours) != torch_musa_api.shape(api[name]):
                bad.append(f"{name}: double {ours}, torch_musa {tag} {api[name]}")
            checked += 1
    assert checked >= 40 and not bad, "\n".join(bad)


@requires_double()
def test_double_provides_exactly_the_manifest():
    with musa_double.installed():
        assert musa_double.surface() == musa_double.read_manifest()
    # torch.musa stays (a process names PrivateUse1 once; torch caches device modules) but has no device
    assert not musa_double.is_installed() and not hasattr(torch, "rope") and not torch.musa.is_available()


@requires_double()
def test_probe_reasons():
    ok, why = MUSABackend.probe()
    assert not ok and "torch_musa is not installed" in why
    with musa_double.installed(DoubleConfig(device_count=0)):
        ok, why = MUSABackend.probe()
        assert not ok and "no MUSA device is visible" in why
    with musa_double.installed():
        assert MUSABackend.probe()[0]


@requires_double()
@pytest.mark.parametrize("cc, arch, bf16, fp8", [((2, 1), "mp_21", False, False), ((2, 2), "mp_22", True, False),
                                                 ((3, 1), "mp_31", True, True)])
def test_arch_gating_on_the_double(cc, arch, bf16, fp8):
    with musa_double.installed(DoubleConfig(capability=cc)):
        caps = MUSADoubleBackend().capabilities()
    assert caps.arch == arch
    assert (torch.bfloat16 in caps.dtypes) == bf16
    assert bool(caps.fp8_formats) == fp8 and (caps.fp8_gemm is not None) == fp8
    assert caps.device_name.startswith("MUSA-double")


def test_capabilities_facts():
    s4000 = musa_capabilities("MTT S4000", (2, 2), 48 * 2**30, True, True, True)
    assert s4000.arch == "mp_22" and not s4000.fp8_formats and s4000.peak("bf16") == 100e12
    s5000 = musa_capabilities("MTT S5000", (3, 1), 80 * 2**30, True, True, True)
    assert s5000.fp8_gemm == "scaled_mm" and s5000.fp8_collectives
    no_gemm = musa_capabilities("MTT S5000", (3, 1), 80 * 2**30, True, False, True)  # the probe GEMM failed
    assert no_gemm.fp8_gemm is None and not no_gemm.fp8_recipes
    assert s5000.peak("bf16") is None, "no datasheet figure in the table: None, not a guess"


def test_musa_kernel_preconditions():
    x = torch.randn(4, 8, 2, 64)
    assert musa_kernels.swiglu_supports(torch.randn(3, 8), torch.randn(8)) == "torch.swish_glu has no bias argument"
    assert musa_kernels.swiglu_supports(torch.randn(3, 8)) is None
    assert "one angle row per position" in musa_kernels.rope_supports(x, torch.randn(4, 2, 1, 32))
    assert musa_kernels.rope_supports(x, torch.randn(4, 1, 1, 32)) is None
    assert musa_kernels.rope_supports(x, torch.randn(1, 8, 1, 32)) is None
    assert "no gradient for freqs" in musa_kernels.rope_supports(x, torch.randn(4, 1, 1, 32, requires_grad=True))
    q = torch.randn(1, 2, 8, 32, dtype=torch.bfloat16)
    assert "head dim 32" in musa_kernels.attention_supports(q, q, q)
    assert "bf16/fp16" in musa_kernels.attention_supports(q.float(), q.float(), q.float())
    w = torch.ones(64)
    assert "differs" in musa_kernels.rms_norm_supports(x.bfloat16(), w)


@requires_double()
def test_musa_kernels_unavailable_without_torch_musa():
    musa_kernels.register_musa_kernels()
    from omnitron.kernels.registry import implementations

    ok, why = implementations("rope")["musa"].available()
    assert not ok and "torch_musa is not imported" in why
    with musa_double.installed():
        assert implementations("rope")["musa"].available()[0]


def test_double_refuses_a_real_torch_musa(monkeypatch):
    import sys
    import types

    monkeypatch.setitem(sys.modules, "torch_musa", types.ModuleType("torch_musa"))
    with pytest.raises(RuntimeError, match="real torch_musa"):
        musa_double.install()


@requires_double()
def test_double_resolves_through_the_registry_only_when_declared(monkeypatch):
    from omnitron.backends import BackendUnavailableError, get_backend, registry

    monkeypatch.delenv("OMNITRON_EXTRA_BACKENDS", raising=False)
    with pytest.raises(BackendUnavailableError, match="unknown backend 'musa-double'"):
        get_backend("musa-double")
    monkeypatch.setenv("OMNITRON_EXTRA_BACKENDS", musa_double.TARGET)
    try:
        be = get_backend("musa-double")
        assert isinstance(be, MUSADoubleBackend) and be.collectives.dist_backend == "mccl"
        assert be.kernels.resolved("swiglu") == ("reference" if os.environ.get("OMNITRON_KERNELS") == "reference"
                                                 else "musa")
    finally:
        registry.reset_cache()
        musa_double.uninstall()
    monkeypatch.setenv("OMNITRON_EXTRA_BACKENDS", "musa-double")
    with pytest.raises(BackendUnavailableError, match="not name=module:Class"):
        registry.known_backends()


@requires_double()
def test_mccl_settings_mirror_nccl_and_exist_in_torch_musa_source(monkeypatch):
    """The MUSA backend prepares for MCCL the watchdog settings the CUDA backend prepares for NCCL, under
    names torch_musa's C++ reads, without overriding what the user set."""
    from omnitron.backends.cuda.backend import CUDABackend

    mccl_env = MUSADoubleBackend().collectives.env
    nccl_env = CUDABackend().collectives.env
    musa_double.uninstall()
    assert {k.replace("TORCH_MCCL_", "") for k in mccl_env} == {k.replace("TORCH_NCCL_", "") for k in nccl_env}
    assert mccl_env["TORCH_MCCL_ASYNC_ERROR_HANDLING"] == "3" and int(mccl_env["TORCH_MCCL_TRACE_BUFFER_SIZE"]) > 0
    for tag, path in TAGS.items():
        unknown = {f"env:{k}" for k in mccl_env} - set(torch_musa_api.load(path))
        assert not unknown, f"torch_musa {tag} reads no {sorted(unknown)}"
    for name in mccl_env:
        monkeypatch.setenv(name, "")  # recorded, so the test leaves the environment as it found it
        monkeypatch.delenv(name)
    monkeypatch.setenv("TORCH_MCCL_DUMP_ON_TIMEOUT", "0")  # the user's choice stands
    collectives = musa_backend.Collectives("mccl", env=mccl_env)
    assert collectives.prepare_env() == {**mccl_env, "TORCH_MCCL_DUMP_ON_TIMEOUT": "0"}
    assert os.environ["TORCH_MCCL_TRACE_BUFFER_SIZE"] == mccl_env["TORCH_MCCL_TRACE_BUFFER_SIZE"]


@requires_double()
@pytest.mark.parametrize("strict", [False, True])
def test_mccl_heartbeat_follows_the_job_timeout_and_nan_check_follows_strict(monkeypatch, strict):
    """The library's monitor aborts a process whose watchdog thread stops beating for HEARTBEAT_TIMEOUT_SEC:
    it must not fire before omnitron's own watchdog reports (the job's collective timeout), nor earlier than
    the library's default. NAN_CHECK, a device kernel per collective, is on in strict (debugging) runs only.
    Both variables are read by torch_musa's C++ at the shipped tag, and NCCL's pair by torch's."""
    from omnitron.backends.cuda.backend import CUDABackend

    backends = {"TORCH_MCCL_": MUSADoubleBackend().collectives, "TORCH_NCCL_": CUDABackend().collectives}
    musa_double.uninstall()
    api = set(torch_musa_api.load(TAGS["v2.7.1"]))
    assert {"env:TORCH_MCCL_HEARTBEAT_TIMEOUT_SEC", "env:TORCH_MCCL_NAN_CHECK"} <= api
    monkeypatch.setenv("OMNITRON_STRICT_COLLECTIVES", "1" if strict else "0")
    timeout_s = float(torch.randint(1, 7200, ()).item()) + 0.5  # the job's, any length, not whole seconds
    for prefix, collectives in backends.items():
        for name in (f"{prefix}HEARTBEAT_TIMEOUT_SEC", f"{prefix}NAN_CHECK", *collectives.env):
            monkeypatch.setenv(name, "")  # recorded, so the test leaves the environment as it found it
            monkeypatch.delenv(name)
        env = collectives.prepare_env(timeout_s)
        heartbeat = int(env[f"{prefix}HEARTBEAT_TIMEOUT_SEC"])
        assert heartbeat >= timeout_s + 60 and heartbeat >= 480 and heartbeat <= max(480, timeout_s + 61)
        assert (env.get(f"{prefix}NAN_CHECK") == "1") is strict
        monkeypatch.setenv(f"{prefix}HEARTBEAT_TIMEOUT_SEC", "17")  # the user's choice stands
        assert collectives.prepare_env(timeout_s)[f"{prefix}HEARTBEAT_TIMEOUT_SEC"] == "17"


def test_fp32_gemm_precision_per_release():
    """v2.7.1's TF32 switch starts as its source says (so float32 GEMMs run as TF32 there); from v2.9 they run
    in FP32 unless the switch or the override variable asks for TF32 (release note: no v2.9 source to read)."""
    from omnitron.backends.musa.backend import musa_fp32_matmul, torch_musa_release

    api = torch_musa_api.load(TAGS["v2.7.1"])
    default = next(n.rsplit(":", 1)[1] for n in api if n.startswith("default:torch.backends.mudnn.allow_tf32:"))
    assert musa_fp32_matmul(torch_musa_release("2.7.1+0bc05bf"), default == "True", None) == "tf32"
    assert musa_fp32_matmul((2, 7), False, "1") == "fp32", "the mublas override is a v2.9 variable"
    assert musa_fp32_matmul(torch_musa_release("2.9.1"), False, None) == "fp32"
    assert musa_fp32_matmul((2, 9), False, "1") == musa_fp32_matmul((2, 11), True, None) == "tf32"
    assert musa_fp32_matmul(torch_musa_release("unknown"), True, None) is None


@requires_double()
def test_double_reports_the_fp32_gemms_it_computes():
    with musa_double.installed():
        assert MUSADoubleBackend().capabilities().fp32_matmul == "fp32"
        torch.backends.mudnn.allow_tf32 = True  # what v2.7.1 starts with
        try:
            assert MUSADoubleBackend().capabilities().fp32_matmul == "tf32"
        finally:
            torch.backends.mudnn.allow_tf32 = False


@requires_double()
def test_double_synchronous_collectives_return_no_work():
    """As torch_musa's MCCL from v2.9.1 ("comm operators in synchronous mode ... return nullptr"): a synchronous
    collective completes before it returns and returns no work; an asynchronous one returns its work. The
    engine's whole run on the double (test_musa_double_training.py) shows nothing waits on the former."""
    import torch.distributed as dist

    with musa_double.installed():
        if not musa_double.sync_returns_none():
            pytest.skip("this torch's collective options carry no asyncOp (before 2.9)")
        dist.init_process_group("mccl", store=dist.HashStore(), rank=0, world_size=1)
        try:
            backend = dist.group.WORLD._get_backend(torch.device("musa"))
            x = torch.randn(64, dtype=torch.float64)
            t = x.to("musa")
            opts = dist.AllreduceOptions()
            opts.asyncOp = False
            assert backend.allreduce([t], opts) is None
            assert torch.equal(t.cpu(), x), "one rank: the sum is the input, readable at once (no work to wait)"
            opts.asyncOp = True
            work = backend.allreduce([t], opts)
            assert work is not None
            work.wait()
            out = torch.empty(64, dtype=torch.float64, device="musa")
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch 2.13 renames it
            assert gather(out, t) is None and dist.broadcast(t, src=0) is None
            assert dist.barrier() is None and torch.equal(out.cpu(), x)
        finally:
            dist.destroy_process_group()


@requires_double()
def test_fused_cross_entropy_is_registered_where_torch_musa_takes_it(monkeypatch):
    """softmax_cross_entropy resolves to torch_musa's fused op on the double (its conformance against the
    reference runs in tests/backends/test_backend_kernels.py[musa-double]); label smoothing goes to the reference,
    as torch_musa's own F.cross_entropy sends it elsewhere."""
    monkeypatch.delenv("OMNITRON_KERNELS", raising=False)
    try:
        be = MUSADoubleBackend()
        assert be.kernels.resolved("softmax_cross_entropy") == "musa"
        logits = torch.randn(4, 3, 11, device="musa")
        target = torch.randint(0, 11, (4, 3), device="musa")
        assert musa_kernels.softmax_cross_entropy_supports(logits, target) is None
        assert "label smoothing" in musa_kernels.softmax_cross_entropy_supports(logits, target, 0.1)
        want = torch.nn.functional.cross_entropy(logits.cpu().double().reshape(-1, 11), target.cpu().reshape(-1),
                                                 reduction="none").reshape(4, 3)
        # fp32 log-softmax over 11 classes of |x| < ~5: error ~ 1e-6 relative; 1e-5 leaves a margin
        torch.testing.assert_close(musa_kernels.softmax_cross_entropy(logits, target).cpu().double(), want,
                                   rtol=1e-5, atol=1e-5)
    finally:
        musa_double.uninstall()
