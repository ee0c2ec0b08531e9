"""C++ CPU kernels (``csrc/cpu``): OpenMP, vectorised loops, bf16-aware, float accumulation.

The extension is ``omnitron._C`` when the package was installed with a compiler present;
otherwise, in a source checkout, it is built on first use with ``torch.utils.cpp_extension.load``
into ``$OMNITRON_CACHE`` (default ``~/.cache/omnitron``)/ext-<hash of the sources> (about 30 s
once, 0.1 s after). ``OMNITRON_JIT_BUILD=0`` turns the build off. Without the extension every
op here reports itself unavailable and the registry runs the next implementation.

Each op is wrapped in an ``autograd.Function`` (forward and backward in C++) and registered
under the name ``"cpp"`` for the CPU backend, with a ``supports`` check naming what it declines.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

from omnitron.kernels import sources
from omnitron.kernels.reference.cross_entropy_shard import whole_vocab_cross_entropy
from omnitron.kernels.reference.rope import rope_call_problem
from omnitron.kernels.registry import register

log = logging.getLogger("omnitron.kernels")

NAME = "cpp"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_CSRC = Path(__file__).resolve().parents[2] / "csrc"
BACKENDS = ("cpu",)
"""The backends these kernels register for."""
_lock = threading.Lock()
_state: dict[str, object] = {}


def _jit_build():
    from torch.utils import cpp_extension

    digest = hashlib.sha256(torch.__version__.encode())
    for path in sources.kernel_sources(_CSRC):
        digest.update(path.read_bytes())
    cache = Path(os.environ.get("OMNITRON_CACHE", Path.home() / ".cache" / "omnitron"))
    build_dir = cache / f"ext-{digest.hexdigest()[:16]}"
    build_dir.mkdir(parents=True, exist_ok=True)
    if not (build_dir / "omnitron_C.so").exists():
        log.info("building omnitron C++ kernels into %s (once; about 30-60 s)", build_dir)
    return cpp_extension.load(
        name="omnitron_C", sources=[str(p) for p in sources.compiled_sources(_CSRC)],
        build_directory=str(build_dir), extra_ldflags=["-fopenmp"], verbose=False,
        extra_cflags=["-O3", "-g0", "-fopenmp", "-march=native", "-fno-math-errno", sources.cxx_std(torch.__version__),
                      sources.digest_define(_CSRC)])


def signature(backend=None) -> str:
    """The C++ kernels this process runs, for the nodes' comparison: ``sources #DIGEST`` of the sources an installed
    ``omnitron._C`` was built from, or of those a source checkout builds (or built) on first use; an installed build
    older than its digest: ``N ops #digest`` of its functions' names and signatures; or "not installed". How and
    where a build was made (wheel or JIT, its path, ``-march``) does not count. A source checkout whose build
    failed runs the reference kernels, not those sources: ``reference (build failed)``; with ``backend`` one whose
    kernel table would take these kernels, the build is tried first (it would be at the first kernel call), so a
    node that cannot build them is told apart before training."""
    import importlib

    try:
        module = importlib.import_module("omnitron._C")
    except ImportError:
        if os.environ.get("OMNITRON_JIT_BUILD", "1") == "0" or not (_CSRC / "bindings.cpp").exists():
            return "not installed"
        if backend is not None and _would_use(backend):
            extension()
        if "module" in _state and _state["module"] is None:
            return "reference (build failed)"
        return f"sources #{sources.source_digest(_CSRC)}"
    built_from = getattr(module, "source_digest", None)
    if built_from:
        return f"sources #{str(built_from).removeprefix(sources.DIGEST_PREFIX)}"
    return sources.interface_digest(module)


def _would_use(backend) -> bool:
    """Whether ``backend``'s kernel table tries these kernels (by its preference, or an ``OMNITRON_KERNELS`` pin)."""
    table = backend.kernels
    return backend.name in BACKENDS and (NAME in table.preference or NAME in table.pins.values())


def extension():
    """The loaded extension module, or None (the reason is in :func:`available`)."""
    if "module" in _state:  # loaded (or refused) once: no lock, which also keeps torch.compile from breaking here
        return _state["module"]
    with _lock:
        if "module" not in _state:
            module, why = None, ""
            try:
                from omnitron import _C as module  # type: ignore[attr-defined]
            except ImportError as err:
                if os.environ.get("OMNITRON_JIT_BUILD", "1") == "0":
                    why = f"omnitron._C not installed ({err}) and OMNITRON_JIT_BUILD=0"
                elif not (_CSRC / "bindings.cpp").exists():
                    why = f"omnitron._C not installed and no sources at {_CSRC}"
                else:
                    try:
                        module = _jit_build()
                    except Exception as build_err:  # compiler missing or failing: fall back, say why
                        why = f"building the C++ kernels failed: {str(build_err).splitlines()[0][:300]}"
                        log.warning("omnitron C++ kernels unavailable: %s", why)
            _state["module"], _state["why"] = module, why
        return _state["module"]


def available() -> tuple[bool, str]:
    """(extension usable, reason when not)."""
    ok = extension() is not None
    return ok, "" if ok else str(_state.get("why"))


def _check(*tensors, dtypes=_DTYPES) -> str | None:
    """None when every given tensor is a CPU tensor of a supported dtype, else the reason."""
    for t in tensors:
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            return f"expected a tensor, got {type(t).__name__}"
        if t.device.type != "cpu":
            return f"tensor on {t.device.type}; the C++ kernels run on CPU tensors"
        if t.dtype not in dtypes:
            return f"dtype {t.dtype} not in {[str(d) for d in dtypes]}"
    return None


# ---------------------------------------------------------------- norms
class _Norm(torch.autograd.Function):
    """RMSNorm (``bias`` is ignored, ``rms=True``) or LayerNorm over the last dim; with a
    ``residual`` it returns ``(norm(h), h)`` for ``h = x + residual`` computed in the same pass."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, rms):
        ctx.set_materialize_grads(False)
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        r2 = None if residual is None else residual.reshape(x2.shape).contiguous()
        if rms:
            y, rstd, h = extension().rms_norm_fwd(x2, weight, float(eps), r2)
            mean = rstd  # unused placeholder
        else:
            y, mean, rstd, h = extension().layer_norm_fwd(x2, weight, bias, float(eps), r2)
        src = x2 if residual is None else h
        ctx.save_for_backward(src, weight, mean, rstd)
        ctx.rms, ctx.has_res = rms, residual is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        return (y.view(x.shape), h.view(x.shape)) if ctx.has_res else y.view(x.shape)

    @staticmethod
    def backward(ctx, dy, dh=None):
        src, weight, mean, rstd = ctx.saved_tensors
        dy2 = torch.zeros_like(src) if dy is None else dy.reshape(src.shape).contiguous()
        dres = None if dh is None else dh.reshape(src.shape).contiguous()
        if ctx.rms:
            dx, dw = extension().rms_norm_bwd(dy2, src, weight, rstd, dres)
            db = None
        else:
            has_bias = ctx.bias_dtype is not None
            dx, dw, db = extension().layer_norm_bwd(dy2, src, weight, mean, rstd, has_bias, dres)
            db = db.to(ctx.bias_dtype) if has_bias else None
        shape = (dy if dy is not None else dh).shape
        dx = dx.view(shape)
        return dx, (dx if ctx.has_res else None), dw, db, None, None


def _float32_inside(t, what: str) -> str | None:
    """The reason a float64 call goes to the reference where the C++ kernel computes ``what`` in float32 (a float64
    model is the suite's exact reference: tests/kernels/test_float64_fast_kernels.py), else None."""
    if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
        return f"float64 runs on the reference: the C++ kernel's {what} is float32 (~1e-7 relative)"
    return None


def _norm_supports(x, weight, bias=None, eps=1e-5, residual=None) -> str | None:
    why = _check(x, weight, bias, residual) or _float32_inside(x, "mean/rstd kept for the backward")
    if why:
        return why
    if x.dim() == 0 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        return f"weight shape {tuple(weight.shape)} does not match x's last dim {x.shape[-1] if x.dim() else None}"
    if bias is not None and bias.shape != weight.shape:
        return f"bias shape {tuple(bias.shape)} differs from weight shape {tuple(weight.shape)}"
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        return f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}"
    return None


@register("rms_norm", NAME, available=available, backends=BACKENDS,
          supports=lambda x, weight, eps=1e-5: _norm_supports(x, weight))
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Fused RMSNorm (see the reference); one pass per row, float32 statistics."""
    return _Norm.apply(x, None, weight, None, eps, True)


@register("layer_norm", NAME, available=available, backends=BACKENDS, supports=_norm_supports)
def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5) -> torch.Tensor:
    """Fused LayerNorm (see the reference); float32 mean/rstd kept for the backward."""
    return _Norm.apply(x, None, weight, bias, eps, False)


@register("add_rms_norm", NAME, available=available, backends=BACKENDS,
          supports=lambda x, residual, weight, eps=1e-5: _norm_supports(x, weight, residual=residual))
def add_rms_norm(x, residual, weight, eps: float = 1e-5):
    """Fused ``h = x + residual; (rms_norm(h), h)`` in one pass over each row."""
    return _Norm.apply(x, residual, weight, None, eps, True)


@register("add_layer_norm", NAME, available=available, backends=BACKENDS,
          supports=lambda x, residual, weight, bias, eps=1e-5: _norm_supports(x, weight, bias, residual=residual))
def add_layer_norm(x, residual, weight, bias, eps: float = 1e-5):
    """Fused ``h = x + residual; (layer_norm(h), h)`` in one pass over each row."""
    return _Norm.apply(x, residual, weight, bias, eps, False)


# ---------------------------------------------------------------- gated activations
class _GLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, kind):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        ctx.save_for_backward(x2)
        ctx.kind = kind
        return extension().glu_fwd(x2, kind).view(*x.shape[:-1], x.shape[-1] // 2)

    @staticmethod
    def backward(ctx, dy):
        (x2,) = ctx.saved_tensors
        dx = extension().glu_bwd(dy.reshape(x2.shape[0], -1).contiguous(), x2, ctx.kind)
        return dx.view(*dy.shape[:-1], x2.shape[-1]), None


def _glu_supports(x, bias=None, approximate="tanh") -> str | None:
    why = _check(x, bias)
    if why:
        return why
    if x.dim() == 0 or x.shape[-1] % 2:
        return f"last dim {x.shape[-1] if x.dim() else None} must be even ([a | b] halves)"
    if approximate != "tanh":
        return f"approximate={approximate!r}; the C++ GeGLU implements the tanh form only"
    return None


@register("swiglu", NAME, available=available, backends=BACKENDS,
          supports=lambda x, bias=None: _glu_supports(x, bias))
def swiglu(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Fused SwiGLU ``silu(a) * b``; a bias is added first (by torch, then the fused kernel)."""
    return _GLU.apply(x if bias is None else x + bias, 0)


def _geglu_supports(x, bias=None, approximate="tanh") -> str | None:
    return _float32_inside(x, "sqrt(2/pi), 0.044715 pair") or _glu_supports(x, bias, approximate)


@register("geglu", NAME, available=available, backends=BACKENDS, supports=_geglu_supports)
def geglu(x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "tanh") -> torch.Tensor:
    """Fused GeGLU ``gelu_tanh(a) * b``; a bias is added first."""
    return _GLU.apply(x if bias is None else x + bias, 1)


# ---------------------------------------------------------------- rope
class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, freqs, interleaved):
        half = freqs.shape[-1]
        shape = (*t.shape[:3], half)
        cos, sin = freqs.float().cos().expand(shape), freqs.float().sin().expand(shape)
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return extension().rope_apply(t.contiguous(), cos, sin, interleaved)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return extension().rope_apply(dy.contiguous(), cos, -sin, ctx.interleaved), None, None


def _rope_supports(t, freqs, interleaved=False) -> str | None:
    return _check(t) or _check(freqs) or _float32_inside(t, "cos/sin") or rope_call_problem(t, freqs, "C++")


@register("rope", NAME, available=available, backends=BACKENDS, supports=_rope_supports)
def rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Fused rotary embedding on ``[s, b, h, d]`` / ``[b, s, h, d]`` (interleaved or not, partial)."""
    return _Rope.apply(t, freqs, interleaved)


# ---------------------------------------------------------------- cross-entropy
_CROSS_ENTROPY = whole_vocab_cross_entropy(lambda *a: extension().cross_entropy_stats(*a),
                                           lambda *a: extension().cross_entropy_grad(*a, None))


def _ce_supports(logits, target, label_smoothing=0.0) -> str | None:
    why = _check(logits)
    if why:
        return why
    if logits.dtype == torch.float64:  # the kernels' statistics are float32; the reference's stay float64
        return "float64 logits run on the reference (float64 loss and statistics)"
    if target.dtype.is_floating_point or target.device.type != "cpu":
        return f"target must be an integer CPU tensor (got {target.dtype} on {target.device.type})"
    if logits.dim() == 0 or tuple(target.shape) != tuple(logits.shape[:-1]):
        return f"target shape {tuple(target.shape)} does not match logits[..., V] {tuple(logits.shape)}"
    return None


@register("softmax_cross_entropy", NAME, available=available, backends=BACKENDS, supports=_ce_supports)
def softmax_cross_entropy(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Fused per-token cross-entropy (float32); no float32 copy of the logits is made."""
    return _CROSS_ENTROPY(logits, target, label_smoothing)


@register("cross_entropy_shard_stats", NAME, available=available, backends=BACKENDS,
          supports=lambda logits, target, start, valid, vocab: _ce_supports(logits, target))
def cross_entropy_shard_stats(logits, target, start: int, valid: int, vocab: int) -> torch.Tensor:
    """Shard statistics ``[4, ...]`` (see the reference) in one read of the logits."""
    x2 = logits.reshape(-1, logits.shape[-1]).contiguous()
    stats = extension().cross_entropy_stats(x2, target.reshape(-1).long().contiguous(), int(start), int(valid),
                                            int(vocab))
    return stats.view(4, *logits.shape[:-1])


@register("cross_entropy_shard_grad", NAME, available=available, backends=BACKENDS,
          supports=lambda dloss, logits, target, lse, *a, **k: _ce_supports(logits, target))
def cross_entropy_shard_grad(dloss, logits, target, lse, start: int, valid: int, vocab: int,
                             label_smoothing: float = 0.0, out: torch.Tensor | None = None) -> torch.Tensor:
    """d loss / d logits for a shard (see the reference), written in one pass in the logits' dtype, into ``out``
    where given (contiguous; it may be ``logits`` itself)."""
    x2 = logits.reshape(-1, logits.shape[-1]).contiguous()
    o2 = None if out is None else out.view(x2.shape)
    dx = extension().cross_entropy_grad(dloss.reshape(-1).float().contiguous(), x2,
                                        target.reshape(-1).long().contiguous(), lse.reshape(-1).float().contiguous(),
                                        int(start), int(valid), int(vocab), float(label_smoothing), o2)
    return dx.view(logits.shape)


# ---------------------------------------------------------------- optimizer
def _adamw_supports(params, grads, exp_avgs, exp_avg_sqs, **_) -> str | None:
    if not (len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs)):
        return "params, grads, exp_avgs and exp_avg_sqs differ in length"
    for group in (params, exp_avgs, exp_avg_sqs):
        for t in group:
            if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
                return "params and moments must be contiguous float32 CPU tensors"
    for p, g in zip(params, grads):
        if g.device.type != "cpu" or g.dtype not in _DTYPES[:3] or not g.is_contiguous() or g.numel() != p.numel():
            return "grads must be contiguous fp32/bf16/fp16 CPU tensors sized like their params"
    return None


@register("adamw_step", NAME, available=available, backends=BACKENDS, supports=_adamw_supports)
def adamw_step(params, grads, exp_avgs, exp_avg_sqs, *, step: int, lr: float, beta1: float, beta2: float, eps: float,
               weight_decay: float) -> None:
    """Multi-tensor AdamW, in place, one pass over p, g, m, v (chunks of 32K elements across threads)."""
    extension().adamw_step(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), int(step), float(lr),
                           float(beta1), float(beta2), float(eps), float(weight_decay))


@register("grad_norm_sq", NAME, available=available, backends=BACKENDS,
          supports=lambda tensors: next((w for w in (_check(t) for t in tensors) if w), None))
def grad_norm_sq(tensors) -> torch.Tensor:
    """Sum of squares of all elements (float32 scalar; chunk partials summed in float64)."""
    return extension().grad_norm_sq([t.contiguous() for t in tensors])
