"""A test double of torch_musa over the sim device: ``torch.device("musa")`` tensors without MUSA hardware.

No MUSA hardware is at hand, so the MUSA backend's own code runs against this stand-in. Installing it
names this process's PrivateUse1 device ``musa`` over ``omnitron._sim`` (csrc/sim, the simulated
accelerator): tensors live on ``torch.device("musa", i)``, ``torch.musa`` is the ``torch_musa`` module
(as in torch_musa, where the package is the runtime module), its memory statistics are the device
allocator's bytes and its generator is the device's own (``musa_runtime.py``), and ``mccl`` is registered
with ``torch.distributed.Backend.register_backend`` for ``musa`` tensors (gloo on host staging copies).
``torch.rope`` / ``torch.swish_glu`` are written here from torch_musa's documented semantics
(independently of omnitron's references). Results obtained this way are labelled **MUSA-double**, never MUSA.

The surface is built from torch_musa's documented API (names, signatures, defaults), not from what the
backend calls; ``manifest.txt`` lists it, and a test checks the two are equal and that the backend calls
nothing outside it. A process can name PrivateUse1 once, so a process that installed the double keeps a
``musa`` device (and ``Tensor.musa()``, and ``mccl``) after :func:`uninstall`, which removes ``torch_musa``,
``torch.musa`` and the added ops; the sim backend cannot load in that process (and vice versa).

The double is installed into ``sys.modules`` only by tests: ``with installed(): ...``, or by
constructing :class:`MUSADoubleBackend` (what spawned workers do through
``OMNITRON_EXTRA_BACKENDS=musa-double=omnitron.testing.musa_double:MUSADoubleBackend``).
It refuses to install over a real torch_musa.
"""
from __future__ import annotations

import contextlib
import pathlib
import sys
import types
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from omnitron.backends.musa.backend import MUSABackend
from omnitron.backends.sim import device as sim_device
from omnitron.testing import musa_runtime
from omnitron.testing.musa_runtime import DoubleConfig

LABEL = "MUSA-double"
MANIFEST = pathlib.Path(__file__).resolve().parents[1] / "backends" / "musa" / "manifest.txt"
TARGET = "musa-double=omnitron.testing.musa_double:MUSADoubleBackend"
"""Value for ``OMNITRON_EXTRA_BACKENDS`` that makes ``get_backend("musa-double")`` work in any process."""
DIST_BACKEND = "mccl"

__all__ = ["DoubleConfig", "LABEL", "MANIFEST", "TARGET", "MUSADoubleBackend", "install", "installed", "is_installed",
           "not_prepared", "prepare", "read_manifest", "requires_double", "surface", "uninstall", "unavailable"]


def read_manifest(path: pathlib.Path = MANIFEST) -> set[str]:
    """The names in ``manifest.txt`` (comments and blank lines dropped)."""
    return {line.split("#", 1)[0].strip() for line in path.read_text().splitlines()} - {""}


def unavailable() -> str | None:
    """None when the double can be installed in this process, else why not (loads nothing)."""
    if not sim_device.extension_built():
        return f"omnitron._sim is not built (the double runs over the sim device); {sim_device.BUILD_HINT}"
    if sim_device.claimed_name() not in ("privateuseone", musa_runtime.DEVICE):
        return f"PrivateUse1 is already the {sim_device.claimed_name()!r} device in this process"
    return None


def not_prepared() -> str | None:
    """None when this process has :func:`prepare`-d the double, else why it should not install it now
    (the test suite prepares it at start on ``--backend cpu`` / ``musa-double`` only: naming PrivateUse1
    makes it torch's accelerator, which would displace a real GPU backend's)."""
    why = unavailable()
    if why is None and sim_device.claimed_name() != musa_runtime.DEVICE:
        why = "the double was not prepared at the start of this process (pytest does it for cpu and musa-double)"
    return why


def requires_double():
    """``pytest.mark.skipif`` for tests that install the double in the pytest process."""
    import pytest

    why = not_prepared()
    return pytest.mark.skipif(why is not None, reason=f"MUSA double unavailable: {why}")


# ---- muDNN ops torch_musa adds to torch ----------------------------------------------------
def _rope(input: torch.Tensor, freq_cis: torch.Tensor, rotary_interleaved: bool, batch_first: bool,
          multi_latent_attention: bool = False) -> torch.Tensor:
    """torch_musa's RoPE: ``input`` [s,b,h,d] (or [b,s,h,d] when batch_first), ``freq_cis`` [s,d] of
    Megatron-style angles (each pair's angle twice); rotates every channel, fp32 inside."""
    if multi_latent_attention:
        raise NotImplementedError("MUSA-double: multi_latent_attention RoPE is not simulated")
    s = input.shape[1] if batch_first else input.shape[0]
    if input.dim() != 4 or tuple(freq_cis.shape) != (s, input.shape[-1]):
        raise RuntimeError(f"rope: freq_cis must be [seq, head_dim] = [{s}, {input.shape[-1]}], "
                           f"got {tuple(freq_cis.shape)}")
    f = freq_cis.float()[None, :, None, :] if batch_first else freq_cis.float()[:, None, None, :]
    x = input.float()
    if rotary_interleaved:
        rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    return (x * f.cos() + rotated * f.sin()).to(input.dtype)


def _swish_glu(input: torch.Tensor) -> torch.Tensor:
    """torch_musa's fused SwiGLU: ``silu(a) * b`` for ``[a, b] = input.chunk(2, -1)``, fp32 inside."""
    a, b = input.float().chunk(2, dim=-1)
    return (F.silu(a) * b).to(input.dtype)


def _fused_cross_entropy_loss_2d_forward(self: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                                         reduction: int = 1, ignore_index: int = -100,
                                         label_smoothing: float = 0.0) -> torch.Tensor:
    """torch_musa's fused 2-D cross-entropy: what its patched ``at::cross_entropy_loss`` returns in place of the
    stock path for the same arguments (LossNLL.cpp.patch), so ``F.cross_entropy`` semantics; fp32 inside,
    ``reduction`` as ``at::Reduction`` (0 none, 1 mean, 2 sum)."""
    if self.dim() != 2:
        raise RuntimeError("_fused_cross_entropy_loss_2d_forward: self must be [rows, classes], got "
                           f"{tuple(self.shape)}")
    mode = ("none", "mean", "sum")[reduction]
    loss = F.cross_entropy(self.float(), target, weight, ignore_index=ignore_index, reduction=mode,
                           label_smoothing=label_smoothing)
    return loss.to(self.dtype)


def _cross_entropy_loss_2d_choice(self: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                                  reduction: int = 1, ignore_index: int = -100, label_smoothing: float = 0.0) -> int:
    """Nonzero where the fused kernel takes the call: the double's takes every 2-D one."""
    return int(self.dim() == 2)


# ---- building and installing --------------------------------------------------------------
_module: types.ModuleType | None = None


def _build() -> types.ModuleType:
    """The ``torch_musa`` module, which is also ``torch.musa`` (torch_musa sets ``torch.musa`` to itself).

    Built once per process and kept as ``torch.musa`` for the process's life: torch caches device
    modules (``torch.get_device_module``) and its accelerator API asks ``torch.musa`` whenever
    PrivateUse1 is named, so uninstalling leaves the module in place, reporting no device."""
    global _module
    if _module is None:
        mod = types.ModuleType("torch_musa", f"{LABEL}: torch_musa's documented API over the sim device")
        for obj in musa_runtime.PUBLIC:
            setattr(mod, obj.__name__, obj)
        for name, fn in musa_runtime.PRIVATE.items():
            setattr(mod, name, fn)
        mod.amp = types.ModuleType("torch_musa.amp")
        mod.amp.autocast = musa_runtime.autocast
        mod.__version__ = "2.7.1+musa.double"  # the release whose source signatures it is checked against
        mod.__omnitron_double__ = True
        _module = mod
    return _module


_TORCH_ADDITIONS = {"rope": _rope, "swish_glu": _swish_glu,
                    "_fused_cross_entropy_loss_2d_forward": _fused_cross_entropy_loss_2d_forward,
                    "cross_entropy_loss_2d_choice": _cross_entropy_loss_2d_choice}
_MUDNN = types.ModuleType("torch_musa.core.mudnn", f"{LABEL}: torch.backends.mudnn")
_MUDNN.allow_tf32 = False
"""torch_musa v2.7.1 starts this switch True (float32 GEMMs as TF32); the double's GEMMs are the sim device's
full-precision float32 kernels whatever it says, so it starts False: the backend then reports ``fp32``, as
the double computes."""


def sync_returns_none() -> bool:
    """Whether the double's ``mccl`` returns no work for synchronous calls (the sim build can tell one)."""
    return bool(musa_runtime._State.ext is not None
                and musa_runtime._State.ext.build_features().get("sync_returns_none"))


def is_installed() -> bool:
    return getattr(sys.modules.get("torch_musa"), "__omnitron_double__", False)


def _configure(config: DoubleConfig) -> None:
    musa_runtime._State.config = config
    ext = musa_runtime._State.ext
    ext.set_device_count(max(1, config.device_count))  # the extension needs one device; the double may report none
    ext.set_device(0)


def prepare() -> None:
    """Name this process's PrivateUse1 ``musa`` and register ``torch.musa`` (reporting no device until
    :func:`install`). Call it before the process's first backward where the double may be installed
    later (the test suite does, at start): torch's autograd engine sizes its per-device queues once, at
    the first backward, and a device registered after that cannot run one (checked here)."""
    fresh = sim_device.claimed_name() != musa_runtime.DEVICE
    musa_runtime._State.ext = sim_device.claim(musa_runtime.DEVICE)
    if not hasattr(torch, musa_runtime.DEVICE):
        torch._register_device_module(musa_runtime.DEVICE, _build())  # torch.musa and sys.modules["torch.musa"]
    if fresh:
        x = torch.ones(1, device=musa_runtime.DEVICE, requires_grad=True)
        try:
            (x * 2).sum().backward()
        except RuntimeError as err:
            raise sim_device.SimUnavailableError(
                "this process ran a backward before the musa device existed, so autograd has no queue for it: "
                "call omnitron.testing.musa_double.prepare() before the first backward") from err


def install(config: DoubleConfig | None = None) -> None:
    """Name PrivateUse1 ``musa``, put the double into ``sys.modules`` / ``torch.musa`` and register ``mccl``
    (idempotent; refuses a real torch_musa; raises ``SimUnavailableError`` without omnitron._sim)."""
    if is_installed():
        if config is not None:
            _configure(config)
        return
    if "torch_musa" in sys.modules or getattr(torch, "musa", _module) is not _module:
        raise RuntimeError("a real torch_musa is loaded in this process; the MUSA test double will not replace it")
    prepare()
    _configure(config or DoubleConfig())
    sys.modules["torch_musa"] = _build()
    musa_runtime._State.installed = True
    for name, fn in _TORCH_ADDITIONS.items():
        setattr(torch, name, fn)
    torch.backends.mudnn = _MUDNN
    # as torch_musa's MCCL from v2.9.1: synchronous collectives run to completion and return no work
    sim_device.register_collectives(musa_runtime._State.ext, DIST_BACKEND, musa_runtime.DEVICE, sync_returns_none=True)


def uninstall() -> None:
    """Remove ``torch_musa`` and the added ops; ``torch.musa`` stays and reports no device. The ``musa``
    device name, ``Tensor.musa()`` and ``mccl`` stay too: torch can neither rename PrivateUse1 twice
    nor unregister a backend."""
    if not is_installed():
        return
    sys.modules.pop("torch_musa", None)
    for name in _TORCH_ADDITIONS:
        if hasattr(torch, name):
            delattr(torch, name)
    if hasattr(torch.backends, "mudnn"):
        del torch.backends.mudnn
    musa_runtime._State.installed = False
    musa_runtime._State.config = DoubleConfig()


@contextlib.contextmanager
def installed(config: DoubleConfig | None = None) -> Iterator[None]:
    """Install the double for the enclosed block only."""
    install(config)
    try:
        yield
    finally:
        uninstall()


def surface() -> set[str]:
    """The names the installed double provides, in manifest spelling (class methods included)."""
    if not is_installed():
        raise RuntimeError("install the double first")
    musa = sys.modules["torch.musa"]
    names = {"torch_musa.__version__"}
    names |= {f"torch.musa.amp.{a}" for a in vars(musa.amp) if not a.startswith("_")}
    for attr in (a for a in vars(musa) if not a.startswith("_") and a != "amp"):
        names.add(f"torch.musa.{attr}")
        obj = getattr(musa, attr)
        if isinstance(obj, type):
            names |= {f"torch.musa.{attr}.{m}" for m in vars(obj) if not m.startswith("_")}
    names |= {f"torch.{a}" for a in _TORCH_ADDITIONS if hasattr(torch, a)}
    names |= {f"torch.backends.mudnn.{a}" for a in vars(_MUDNN) if not a.startswith("_")}
    if DIST_BACKEND.upper() in dist.Backend._plugins:
        names.add(f"process_group:{DIST_BACKEND}")
    return names


class MUSADoubleBackend(MUSABackend):
    """The MUSA backend's code over the double: name ``musa-double``, tensors on ``torch.device("musa")``."""

    name = "musa-double"
    fp8_transport = False
    """Its ``mccl`` is gloo underneath, which carries no float8: the uint8-view path is used."""

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        if not (dist.is_available() and hasattr(dist.Backend, "register_backend")):
            return False, "this torch cannot register a custom process-group backend"
        why = unavailable()
        if why is not None:
            return False, why
        return True, f"{LABEL}: torch_musa test double over the sim device (not a MUSA device)"

    def __init__(self) -> None:
        install()
        super().__init__()

    def sync_count(self, kind: str = "") -> int:
        """Host synchronizations counted by the sim device underneath (see ``SimBackend.sync_count``)."""
        return musa_runtime._State.ext.sync_count(kind)
