"""The backend plug-in contract of docs/backends.md, enforced as a vendor meets it: a plug-in missing one of
``Backend``'s methods, a kernel module that fails to import, or a kernel (or its ``supports``) that cannot take
its op's reference calls is refused by ``omnitron info`` / ``omnitron train`` in one line naming the fix, before
any worker starts (each was a traceback, the first after ``info`` had called the backend usable, the others from
every worker at its first layer); so are a malformed ``OMNITRON_EXTRA_BACKENDS`` entry and an ``OMNITRON_KERNELS``
pin naming nothing or a kernel that cannot run here (a traceback, and a silent reference run; a call the pinned
kernel declines now raises); ``omnitron bench kernels`` times a plug-in's own kernels (it timed only omnitron's)
and refuses an unusable backend in a line; and neither ``omnitron info`` nor ``bench gemm`` reports an FP8 GEMM
path on a device without FP8."""
from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import broken_plugins
from omnitron.backends import registry
from omnitron.kernels import registry as kernels
from omnitron.kernels.registry import REFERENCE, Implementation, implementations, ops
from omnitron.testing.faults import tiny_train_args

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.fixture
def plugins(monkeypatch):
    """The plug-ins findable here and in processes started from here; their kernels removed afterwards."""
    monkeypatch.setenv(registry.EXTRA_ENV_VAR, broken_plugins.TARGETS)
    monkeypatch.delenv("OMNITRON_KERNELS", raising=False)
    registry.reset_cache()
    yield
    registry.reset_cache()
    for impls in kernels._OPS.values():
        impls.pop(broken_plugins.KERNEL, None)


def _train(tmp_path, backend: str, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "omnitron", "train", "--backend", backend, "--train-iters", "1",
                           *extra, *tiny_train_args(tmp_path)], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)


def _refused(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """The refusal's first line, after checking it is a configuration error (exit 2) without a traceback."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out, out[-3000:]
    first = out.strip().splitlines()[0]
    assert first.startswith("omnitron train: error: "), out[-3000:]
    for needle in needles:
        assert needle in first, first
    return first


def test_missing_methods_are_named_not_called_usable(plugins, tmp_path):
    ok, why = registry.probe_all()["plugin-missing"]
    assert not ok and "does not implement capabilities, collectives, current_device" in why, why
    with pytest.raises(registry.BackendUnavailableError, match="implement every abstract method"):
        registry.get_backend("plugin-missing")
    _refused(_train(tmp_path, "plugin-missing"), "MissingMethods does not implement", "docs/backends.md")


def test_kernel_module_import_error_is_one_line_before_the_workers(plugins, tmp_path):
    line = _refused(_train(tmp_path, "plugin-badimport", "--nproc-per-node", "2", "--tensor-model-parallel-size", "2"),
                    "register_kernels() failed", "plugin_vendor_kernels_not_installed")
    assert "rank" not in line  # refused by the launcher, not by each worker


def test_kernel_without_the_references_parameters_is_refused(plugins, tmp_path, capsys):
    line = _refused(_train(tmp_path, "plugin-wrongsig", "--nproc-per-node", "2", "--tensor-model-parallel-size", "2"),
                    "'plugin_test' of 'rms_norm'", "no parameter 'eps'", "rms_norm(x, weight, eps=1e-05)")
    assert "OMNITRON_KERNELS=rms_norm=reference" in line
    from omnitron.cli import main

    assert main(["info", "--backend", "plugin-wrongsig"]) == 1
    assert "error: kernel 'plugin_test' of 'rms_norm'" in capsys.readouterr().out


def _ref(op: str) -> Implementation:
    return implementations(op)[REFERENCE]


def signature_problem(impl: Implementation, reference: Implementation) -> str | None:
    from omnitron.kernels.registry import signature_problem as check  # imported here: the file's other tests
    return check(impl, reference)                                      # run where it does not exist


def _impl(op: str, fn) -> Implementation:
    return Implementation(op, "vendor", fn)


def test_signature_problem_names_each_mismatch():
    ref = _ref("rms_norm")
    cases = {  # each way a vendor's rms_norm can break a call the reference takes, and the reason given
        "it has no parameter 'eps'": lambda x, weight: x,
        "it has no parameter 'weight'": lambda x, w, eps=1e-5: x,
        "'x' is not its parameter 1": lambda weight, x, eps=1e-5: x,
        "the default of 'eps' is 1e-06, the reference's 1e-05": lambda x, weight, eps=1e-6: x,
        "the default of 'eps' is none, the reference's 1e-05": lambda x, weight, eps: x,
        "it requires 'stream', which the reference does not take": lambda x, weight, eps=1e-5, *, stream: x,
    }
    for want, fn in cases.items():
        assert signature_problem(_impl("rms_norm", fn), ref) == want
    for fn in (lambda x, weight, eps=1e-5, *, fast=True: x, lambda *args, **kwargs: None):
        assert signature_problem(_impl("rms_norm", fn), ref) is None
    block = _ref("attention_block_forward")  # keyword-only parameters may arrive through **kwargs
    assert signature_problem(_impl("attention_block_forward", lambda q, k, v, *, causal, scale, **kw: q), block) is None
    assert signature_problem(_impl("attention_block_forward", lambda q, k, v, *, causal, scale, drop=None: q),
                             block) == "it has no parameter 'mask'"


def builtin_problems() -> tuple[int, list]:
    """(implementations seen, those whose function or ``supports`` cannot take the reference's calls) among every
    implementation registered in this process."""
    seen, bad = 0, []
    for op in ops():
        for name, impl in implementations(op).items():
            for fn in (impl.fn, impl.supports) if name != REFERENCE else ():
                seen += fn is impl.fn
                why = None if fn is None else signature_problem(_impl(op, fn), _ref(op))
                bad += [(op, name, fn.__name__, why)] if why else []
    return seen, bad


def test_every_builtin_implementation_takes_the_references_calls():
    """The check refuses none of omnitron's own kernels or their ``supports`` (cpu's flash blocks had no ``mask``
    before it; the Triton cast-transpose-from-amax's ``supports`` named its ``amax`` ``scale``)."""
    import omnitron.backends.cpu.kernels  # noqa: F401 - registered by the cpu backend's register_kernels
    from omnitron.backends.musa.kernels import register_musa_kernels

    register_musa_kernels()
    seen, bad = builtin_problems()
    assert seen >= 15 and not bad, bad
    code = ("import omnitron.kernels.triton_kernels as t, test_plugin_contract as c; assert t.triton is not None; "
            "print(c.builtin_problems())")  # Triton's kernels register only with the interpreter set before import
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen, bad = eval(proc.stdout.strip().splitlines()[-1])
    assert seen >= 30 and not bad, bad  # the cpp kernels and twenty-odd Triton ones


def test_cpu_flash_block_declines_a_mask_to_the_reference():
    """A masked block given to the cpu backend's table runs the reference's masked softmax, checked against
    float64 attention written here. Tolerance: fp32 inputs, a softmax over 24 keys and a 24-term sum of
    O(1) values: rounding ~24 * 2^-24 relative, far inside 1e-5."""
    from omnitron.backends import get_backend

    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    q, k, v = (torch.randn(1, 2, 24, 8) for _ in range(3))
    mask = torch.rand(24, 24) < 0.7
    mask[:, 0] = True  # every row keeps a key
    out, lse = get_backend("cpu").kernels.attention_block_forward(q, k, v, causal=False, scale=0.3, mask=mask)
    s = (q.double() @ k.double().transpose(-1, -2) * 0.3).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(out.double(), torch.softmax(s, -1) @ v.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), rtol=1e-5, atol=1e-5)


def test_memory_conformance_takes_counts_the_device_cannot_say(plugins, monkeypatch):
    """docs/backends.md lets ``memory_stats`` say None where the device cannot say; the conformance suite's memory
    test took the first None and failed with a TypeError (``None + float``) on such a plug-in. It still fails one
    that says a count in one call and not in the next, or whose ``allocated`` misses a 64 MiB buffer."""
    from test_backend_device import test_memory_stats

    be = registry.get_backend("plugin-nomemory")
    test_memory_stats(be)
    for allocated in ([None, 1 << 20, 1 << 20], [1 << 20] * 3):  # said once and not before; blind to the buffer
        said = iter(allocated)
        monkeypatch.setattr(be, "memory_stats", lambda: {**NO_COUNTS, "allocated": next(said)})
        with pytest.raises(AssertionError, match="allocated"):
            test_memory_stats(be)


@pytest.mark.parametrize("wrong, says", [({"peak_flops": {"fp32": 1e12, "bfloat16": 4e12}}, "keys ['bfloat16']"),
                                         ({"fp8_recipes": ("tensorwise", "current")}, "a subset of"),
                                         ({"fp8_gemm": "scaled_mm"}, "does not run on the device")])
def test_capability_conformance_catches_a_claim_the_engine_cannot_use(plugins, monkeypatch, wrong, says):
    """Capabilities a plug-in can get wrong that the suite passed: a peak under a name ``Capabilities.peak`` never
    looks up (MFU and % of peak silently missing), an FP8 recipe no provider runs, and ``fp8_gemm="scaled_mm"`` on a
    device where ``torch._scaled_mm`` does not run (docs/backends.md: claimed only where the probe GEMM ran)."""
    from test_backend_device import test_capabilities_are_consistent_facts as check

    import omnitron.backends.fp8 as fp8
    import test_backend_device

    be = registry.get_backend("plugin-counting")
    check(be)  # the plug-in as written passes
    if fp8.scaled_mm_runs(be.device()):
        monkeypatch.setattr(test_backend_device, "scaled_mm_runs", lambda device: False)  # as on a device without
    right = be.capabilities()
    monkeypatch.setattr(be, "capabilities", lambda: dataclasses.replace(right, **wrong))
    with pytest.raises(AssertionError, match=re.escape(says)):
        check(be)


NO_COUNTS = dict.fromkeys(("allocated", "reserved", "peak_allocated", "peak_reserved", "free", "total"))


def test_bench_kernels_times_the_plugins_own_kernel(plugins):
    """``omnitron bench kernels --backend NAME`` (docs: every implementation of every op) includes the kernels the
    backend registers itself, and its rows time that kernel (its calls are counted)."""
    from omnitron.kernels.benchmark import run

    be = registry.get_backend("plugin-counting")
    before = broken_plugins.CALLS["swiglu"]
    report = run(be, ops=["swiglu"], dtypes=[torch.float32], size="tiny", compile_=False, rounds=2, budget_s=0.01,
                 log=lambda *_: None)
    timed = {(r["mode"], r["impl"]) for r in report["rows"] if r["ms"] is not None}
    assert {("fwd", broken_plugins.KERNEL), ("fwd+bwd", broken_plugins.KERNEL)} <= timed, timed
    assert broken_plugins.CALLS["swiglu"] > before


@pytest.mark.parametrize("backend, flag, says", [
    ("plugin-bf16only", "--fp16", "--fp16: the plugin-bf16only backend's device has no fp16 (its dtypes: float32, "
                                  "bfloat16); use --bf16 or fp32 (neither flag)"),
    ("plugin-nofp8", "--bf16", None)])
def test_a_half_precision_the_device_lacks_is_refused(plugins, tmp_path, backend, flag, says):
    """``--fp16`` on a device whose capabilities list no float16 trained in float16 anyway (``--bf16`` was refused,
    and its refusal offered ``--fp16`` whether or not the device had it); a dtype the device lists still trains."""
    proc = _train(tmp_path, backend, flag)
    if says is None:
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    else:  # (after --fp16's notice on NaN checks, printed while the flags are parsed)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2 and "Traceback" not in out, out[-3000:]
        assert f"omnitron train: error: {says}" in out.splitlines(), out[-3000:]


def test_info_names_no_fp8_path_on_a_device_without_fp8(plugins, capsys):
    """``omnitron info`` printed "per-tensor GEMM path emulated" for a backend whose capabilities list no FP8 format,
    where ``--fp8-format`` is refused: a path that never runs there."""
    from omnitron.cli import main

    assert main(["info", "--backend", "plugin-nofp8"]) == 0
    out = capsys.readouterr().out
    assert "FP8 on backend plugin-nofp8: none (formats: none; recipes: none): --fp8-format is refused" in out, out
    assert "GEMM path" not in out


def test_a_malformed_extra_backend_entry_is_one_line(monkeypatch, capsys):
    """``OMNITRON_EXTRA_BACKENDS=mychip`` (no ``=module:Class``) was a ValueError traceback from every command."""
    from omnitron.cli import main

    monkeypatch.setenv(registry.EXTRA_ENV_VAR, "mychip")
    registry.reset_cache()
    assert main(["info"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("omnitron info: error: OMNITRON_EXTRA_BACKENDS entry 'mychip' is not name=module:Class (for example "
                   "mychip=mychip_omnitron.backend:MyChipBackend): correct it or unset it"), err


def test_bench_on_a_backend_that_cannot_run_says_why(plugins, capsys):
    """``omnitron bench kernels --backend NAME`` for a backend that is not usable here: the registry's reason, not a
    traceback (as ``train`` and ``info`` say it)."""
    from omnitron.cli import main

    assert main(["bench", "kernels", "--backend", "plugin-missing", "--size", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("omnitron bench: error: backend 'plugin-missing' cannot run here: "), err
    assert "Traceback" not in err


def test_bench_gemm_reports_no_fp8_rows_on_a_device_without_fp8(plugins):
    """``omnitron bench gemm`` timed "fp8-tensor" / "fp8-row" / "fp8-block" GEMMs (emulated) on a device whose
    capabilities list no FP8 format, where FP8 training is refused: rows for a path that never runs there."""
    from omnitron.bench.gemm import DTYPES, run

    rows = run(registry.get_backend("plugin-nofp8"), sizes=[16], dtypes=list(DTYPES), rounds=1, budget_s=0.01,
               log=lambda *_: None)
    assert {r["dtype"] for r in rows} == {"fp32", "bf16", "fp16"}, rows


@pytest.mark.parametrize("pin, says", [("rmsnorm=plugin_test", "there is no op 'rmsnorm'"),
                                       ("swiglu=plugin_tset", "swiglu has no implementation 'plugin_tset' here")])
def test_a_kernel_pin_naming_nothing_is_refused(plugins, monkeypatch, tmp_path, pin, says):
    """``OMNITRON_KERNELS=op=name`` with a typo in either name ran the reference silently."""
    monkeypatch.setenv("OMNITRON_KERNELS", pin)
    line = _refused(_train(tmp_path, "plugin-counting"), f"OMNITRON_KERNELS: {pin}: {says}")
    assert line.startswith("omnitron train: error: OMNITRON_KERNELS"), line


def test_a_supports_without_the_references_parameters_is_refused(plugins, tmp_path):
    """A kernel's ``supports`` is called with the op's arguments before every call; one missing ``bias`` passed the
    table's check (only the kernel was checked) and raised a TypeError at the first MLP of every worker."""
    line = _refused(_train(tmp_path, "plugin-wrongsupports"),
                    "'supports' of kernel 'plugin_test' of 'swiglu'", "no parameter 'bias'", "swiglu(x, bias=None)")
    assert "rank" not in line


@pytest.mark.parametrize("backend, pin, says", [
    ("plugin-unavailable", "swiglu=plugin_test", "unavailable: mychip_lib is not loaded"),
    ("plugin-counting", "rms_norm=cpp", "registered for backend(s) cpu, not plugin-counting")])
def test_a_pin_on_a_kernel_that_cannot_run_here_is_refused(plugins, monkeypatch, tmp_path, backend, pin, says):
    """A pin naming a kernel registered here but unusable on this backend (its library absent, or another backend's
    kernel) ran the reference silently, the run the pin was set to avoid."""
    monkeypatch.setenv("OMNITRON_KERNELS", pin)
    _refused(_train(tmp_path, backend), f"OMNITRON_KERNELS: {pin}: ", says)


def test_a_pinned_kernel_declining_a_call_raises_instead_of_running_the_reference(plugins, monkeypatch):
    """Unpinned, a declined call runs the reference (by design); pinned, the same call ran the reference too, so a
    parity check pinning the vendor's kernel compared the reference with itself."""
    backend = "plugin-declining"
    kernels.register("swiglu", broken_plugins.KERNEL, broken_plugins.counting_swiglu, backends=(backend,),
                     supports=lambda x, bias=None: None if x.dtype == torch.float64 else "float64 only")
    x = torch.randn(3, 8)
    want = torch.nn.functional.silu(x.double()[:, :4]) * x.double()[:, 4:]
    table = kernels.KernelTable(backend, (broken_plugins.KERNEL, REFERENCE))
    torch.testing.assert_close(table.swiglu(x).double(), want)  # declined: the reference, float32
    assert table.swiglu.ran == {REFERENCE: 1}
    monkeypatch.setenv("OMNITRON_KERNELS", f"swiglu={broken_plugins.KERNEL}")
    pinned = kernels.KernelTable(backend, (REFERENCE,))
    torch.testing.assert_close(pinned.swiglu(x.double()), want, rtol=0, atol=0)  # float64 both: same operations
    with pytest.raises(kernels.KernelContractError, match="swiglu=plugin_test: 'plugin_test' declined a call "
                                                          r"\(float64 only\)"):
        pinned.swiglu(x)


def _installed_plugin(where: pathlib.Path, name: str, *requires: str, target: str = "broken_plugins:Counting") -> None:
    """The metadata pip writes for a plug-in package (``<dist>.dist-info``: its requirements and its entry point
    ``name`` in the group ``omnitron.backends``), over the correct ``plugin-counting`` class by default."""
    info = where / f"omnitron_{name.replace('-', '_')}-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: omnitron-" + name + "\nVersion: 0.3\n"
                                   + "".join(f"Requires-Dist: {r}\n" for r in requires))
    (info / "entry_points.txt").write_text(f"[omnitron.backends]\n{name} = {target}\n")


def test_a_plugin_made_for_another_omnitron_or_torch_is_refused_naming_the_package(monkeypatch, tmp_path, capsys):
    """A plug-in package whose recorded requirements exclude the running omnitron or torch (installed with
    ``--no-deps``, or left in place when either was upgraded under it) loaded and ran as if made for them. It is
    "not usable" now, with a line naming the package, its requirement, what is installed and the fix; requirements
    that hold, other packages' and ones under an extra's marker do not refuse it."""
    import omnitron
    from omnitron.cli import main

    monkeypatch.delenv(registry.EXTRA_ENV_VAR, raising=False)
    _installed_plugin(tmp_path, "plugin-stale", "numpy>=999", f"omnitron<{omnitron.__version__}")
    _installed_plugin(tmp_path, "plugin-oldtorch", "omnitron", "torch<2.0")
    _installed_plugin(tmp_path, "plugin-current", f"omnitron>={omnitron.__version__}", "torch>=2.0", "numpy>=999",
                      'torch<2.0; extra == "legacy"')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(HERE))
    registry.reset_cache()
    try:
        report = registry.probe_all()
        assert report["plugin-current"][0], report["plugin-current"]
        assert registry.get_backend("plugin-current").name == "plugin-counting"
        ok, why = report["plugin-oldtorch"]
        assert not ok and why.startswith(f"the plug-in package omnitron-plugin-oldtorch 0.3 requires torch<2.0, and "
                                         f"torch {torch.__version__} is installed: install a release of "), why
        assert main(["info", "--backend", "plugin-stale"]) == 1
        line = capsys.readouterr().out.split("error: ", 1)[1].splitlines()[0]
        assert line == (f"backend 'plugin-stale' cannot run here: the plug-in package omnitron-plugin-stale 0.3 "
                        f"requires omnitron<{omnitron.__version__}, and omnitron {omnitron.__version__} is installed: "
                        f"install a release of omnitron-plugin-stale made for omnitron {omnitron.__version__} (or "
                        f"omnitron<{omnitron.__version__} in an environment of its own)"), line
    finally:
        registry.reset_cache()


def test_a_plugin_that_raises_at_import_names_itself_and_the_way_out(monkeypatch, tmp_path):
    """A plug-in whose module raises on import (its vendor library absent) was "failed to load MODULE:CLASS: <the
    message>": no exception type, no package, no fix. Now the line names the exception, the package (installed by
    entry point) or the ``OMNITRON_EXTRA_BACKENDS`` entry, and how to fix or remove it; other backends stay usable."""
    (tmp_path / "plugin_raises.py").write_text('raise ImportError("libmychip.so.3: cannot open shared object file")\n')
    _installed_plugin(tmp_path, "plugin-raises", target="plugin_raises:MyChip")
    monkeypatch.setenv(registry.EXTRA_ENV_VAR, "plugin-raises-dev=plugin_raises:MyChip")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.reset_cache()
    try:
        report = registry.probe_all()
        assert report["cpu"][0], report["cpu"]
        cause = "ImportError: libmychip.so.3: cannot open shared object file; install what it needs, or "
        assert report["plugin-raises"] == (False, f"failed to load plugin_raises:MyChip: {cause}uninstall the "
                                                  "plug-in (pip uninstall omnitron-plugin-raises)")
        assert report["plugin-raises-dev"] == (False, f"failed to load plugin_raises:MyChip: {cause}remove "
                                                      "plugin-raises-dev=plugin_raises:MyChip from "
                                                      "OMNITRON_EXTRA_BACKENDS")
        with pytest.raises(registry.BackendUnavailableError, match="pip uninstall omnitron-plugin-raises"):
            registry.get_backend("plugin-raises")
    finally:
        registry.reset_cache()


def test_info_and_the_start_line_name_the_backend_as_chosen(plugins, monkeypatch, tmp_path, capsys):
    """An ``OMNITRON_EXTRA_BACKENDS`` entry may name a class under a name of its own: the training start line and
    ``omnitron info`` said the class's ``name`` (what its kernels register for), not the name the user chose; and
    the backends list of ``info`` lost its columns at names longer than 6 characters."""
    from omnitron.cli import main

    chosen = "my-renamed-chip"  # broken_plugins.Counting's own name is plugin-counting
    monkeypatch.setenv(registry.EXTRA_ENV_VAR, f"{broken_plugins.TARGETS},{chosen}=broken_plugins:Counting")
    registry.reset_cache()
    assert main(["info", "--backend", chosen]) == 0
    out = capsys.readouterr().out
    assert f"\nselected: {chosen} (class name 'plugin-counting') (device type 'cpu'," in out, out
    listed = out.split("backends:\n")[1].split("\n\n")[0].splitlines()
    names = [line.split()[0] for line in listed]
    assert {"cpu", chosen, "plugin-counting"} <= set(names), names
    # the state column ("usable" / "not usable") starts at one place on every line, after the longest name
    width = max(map(len, names))
    assert all(line[3 + width:].startswith(("usable     ", "not usable ")) for line in listed), listed
    proc = _train(tmp_path, chosen)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    start = [line for line in (proc.stdout + proc.stderr).splitlines() if "micro-batches/step | backend" in line]
    assert len(start) == 1 and start[0].endswith(f"| backend {chosen} (class name 'plugin-counting')"), start


def test_compare_sets_what_each_backend_runs_side_by_side(plugins, tmp_path, capsys):
    """``bench compare`` gave each implementation its own row, so a plug-in's swiglu and cpu's ``cpp`` one never sat
    side by side; its "kernels as run" table has a row per case with what each machine's engine runs by default.
    Checked against the kernel each backend's table dispatches the benchmark's own case to."""
    from omnitron.cli import main
    from omnitron.kernels.cases import cases

    names = ("cpu", "plugin-counting")
    for name in names:
        assert main(["bench", "kernels", "--backend", name, "--ops", "swiglu", "--dtypes", "float32", "--size", "tiny",
                     "--rounds", "2", "--budget", "0.01", "--json", str(tmp_path / f"{name}.json")]) == 0
    capsys.readouterr()
    assert main(["bench", "compare", *(str(tmp_path / f"{name}.json") for name in names)]) == 0
    table = capsys.readouterr().out.split("== kernels as run (")[1].split("\n\n")[0].splitlines()[2:]
    ran = []
    for name in names:
        dispatch = registry.get_backend(name).kernels.get("swiglu")
        (case,) = cases("swiglu", torch.device("cpu"), torch.float32, "tiny")
        before = dict(dispatch.ran)
        dispatch(*case.args, **case.kwargs)
        (impl,) = [k for k, n in dispatch.ran.items() if n != before.get(k)]
        ran.append("eager" if impl == REFERENCE else impl)
    assert ran[1] == broken_plugins.KERNEL, ran
    line = next(line for line in table if line.startswith("swiglu float32 fwd size tiny |"))
    assert [cell.split()[1] for cell in line.split(" | ")[1:]] == ran, table
