"""The speed model's rates from a device profile (:mod:`omnitron.plan.profile`) and a hierarchical machine
(:mod:`omnitron.plan.machine`), for planning a cluster no ``omnitron bench`` report exists of.

The same methods as :class:`omnitron.plan.rates.Rates` (the speed model calls either):

- a GEMM: ``2 m n k / (peak x gemm(FLOPs))``, or the time to move its operands and output at the memory-bound
  rate when longer (a roofline: thin GEMMs are bandwidth-bound);
- attention: without attention dropout the fused (flash) kernel, its FLOPs (the causal count) at
  ``peak x attention(FLOPs)``; with dropout the engine materialises the scores (so did Megatron-LM until
  flash attention): the two batched GEMMs over the whole ``s x s`` scores (the mask does not halve them) by
  the GEMM roofline, and the softmax's passes over the scores (forward: read, write; backward: read the
  probabilities and their gradient, write) at the memory-bound rate; the probabilities' dropout is priced
  as an element-wise op by the speed model;
- an element-wise op: its bytes (:data:`PASSES` x elements) at ``bandwidth x memory(bytes)``; the per-tensor FP8
  cast-transpose at that times its measured fraction (:meth:`DeviceRates.cast_transpose`);
- a collective: :meth:`omnitron.plan.machine.Machine.collective` over the group's span in the layout bound by
  :meth:`DeviceRates.bind` (``group``: tp, cp, dp, pp, ep, edp, emb).

The host's fixed cost per layer is not priced (an accelerator's host runs ahead of it).

``measured`` (``omnitron plan --device PROFILE --bench REPORT``): an ``omnitron bench`` report of the same
accelerator (:class:`omnitron.plan.rates.Rates`) replaces the profile where it has rows: GEMMs of a dtype it
measured, attention, element-wise ops it measured, the FP8 cast-transpose's rate over the copy's (a kernels
report's ``fp8_cast_transpose_amax`` row: :meth:`DeviceRates.cast_transpose`), and collectives of a group that
lies inside one node at a rank count it measured (intra-node rows). The profile keeps the rest: what spans nodes, and
what the report lacks (noted).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from omnitron.plan import fp8
from omnitron.plan.machine import Machine, span, strides

PASSES = {"add": (3, 3), "layer_norm": (2, 4), "rms_norm": (2, 4), "dropout": (2.5, 2.5), "gelu": (2, 3),
          "silu_mul": (3, 5), "softmax": (2, 3), "cross_entropy": (6, 4), "ring_merge": (4, 0),
          "block_dropout": (2, 4), "moe_dispatch": (6, 6), "copy": (2, 2)}
"""(forward, backward) bytes per element, in units of the activation's element size: reads plus writes of one
pass of the op (copy: a reorder's gather or its scatter back; dropout: the 1-byte mask as half a 2-byte element;
block_dropout, the cp blocks' hash mask: no mask stored or read, it is computed from positions, in the forward
applied to the probabilities and in the backward computed again and applied to them and to their gradient;
cross-entropy: fp32 logits, max, exp, sum and the target gather forward, the softmax gradient backward). The FP8
quantization's kernels write FP8 whatever the source's dtype: their bytes are :func:`omnitron.plan.fp8.op_bytes`'s."""
DEQUANT_BYTES = 5
"""Per operand element of an emulated block-wise FP8 GEMM: the FP8 code read, its fp32 dequantized value written
(the block's scale read is 1/128 or 1/16384 of that; compiled: ``to(float32)`` and the scale's multiply fused)."""
RESULT_BYTES = 6
"""Per output element of an emulated block-wise FP8 GEMM: the fp32 result read, the output dtype's value written."""
HASH_INT_OPS = 38
"""32-bit integer operations per visible score of a ring block with the hash dropout, forward + backward, in the fused
flash block (:mod:`omnitron.kernels.triton_kernels.flash_block`), which stores no mask and reads none: the element's
mix of its row and column keys (an xor, then 3 shifts, 3 xors and 2 multiplies), the unsigned compare, the select
and the ``1 / (1 - p)`` scale: 12 in the forward and in the dq kernel, 14 in the dk/dv kernel (select and scale of
both the probabilities and their gradient). The per-tile row and column keys (3 and 1 mixes per row or key of a
tile) are negligible beside them."""
INT32_PER_FP32_FLOP = 0.25
"""32-bit integer operations per second per (non-tensor) fp32 FLOP/s of a profile: NVIDIA's SMs since Volta issue
64 INT32 lanes beside 128 FP32 ones, whose FMA counts 2 FLOPs: a quarter. UNCERTAIN on other architectures."""
ADAMW_BYTES = 32
"""Per parameter of an AdamW step: fp32 master, gradient and two moments read, master and moments written
(28), and the half-precision parameter copy written (2 + 2 rounding)."""
_FLOAT = {"fp32": "tf32", "float32": "tf32"}


def _own(table: dict) -> int:
    """The host-thread count a report of an accelerator was measured with (its rows are the device's, whatever
    the host's threads: taken as they are, never rescaled by threads)."""
    return max(table) if table else 1


@dataclass
class DeviceRates:
    """Rates of one device profile on a machine of ``gpus_per_node`` devices per node."""

    profile: object
    gpus_per_node: int
    notes: list[str] = field(default_factory=list)
    memo: dict = field(default_factory=dict, repr=False)
    device_type: str = "accelerator"
    host_ranks: int = 1
    gemm: dict = field(default_factory=dict)
    elem: int = 2
    sizes: dict = field(default_factory=dict)
    world: int = 1
    measured: object = None
    """A bench report's :class:`omnitron.plan.rates.Rates` of the same accelerator (module docstring), or None."""
    expert_load: object = None
    """A routing histogram (:class:`omnitron.plan.routing.ExpertLoad`) MoE layers are priced at, or None: balanced."""

    def __post_init__(self):
        self.machine = Machine(self.profile.links, self.gpus_per_node)
        if self.measured is not None:
            self.measured.notes = self.notes  # one list of fallbacks, printed with the plan

    def _report_has(self, kind: str, **match) -> bool:
        """Whether the measured report holds a row of ``kind`` with the fields of ``match``."""
        if self.measured is None:
            return False
        table = getattr(self.measured, kind)
        rows = table if isinstance(table, list) else [r for rs in table.values() for r in rs]
        return any(all(r.get(k) == v for k, v in match.items()) for r in rows)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def bind(self, settings) -> None:
        """The layout whose groups the collectives span (called by the speed model per prediction)."""
        pc = settings.parallel
        tp, cp, pp = pc.tensor_model_parallel_size, pc.context_parallel_size, pc.pipeline_model_parallel_size
        self.world, self.elem = settings.world_size, settings.model.params_dtype.itemsize
        self.sizes = strides(tp, cp, settings.dp, pp, pc.expert_model_parallel_size, pc.etp)
        sizes = pc.cp_a2a_p2p_sizes
        self.sizes["cp_p2p"] = tp * int(sizes[0]) if sizes else tp  # a2a+p2p's ring: every A-th cp rank
        self.memo[("host_layer", 1)] = (0.0, 0.0)  # the host runs ahead of the device: not priced

    def _measured_inside_node(self, op: str, ranks: int) -> bool:
        """Whether the report measured ``op`` at ``ranks`` ranks inside one node."""
        return self.measured is not None and any(
            r["op"] == op and r["ranks"] == ranks and r.get("group", "world") != "inter" and r.get("nodes", 1) == 1
            for r in self.measured.comm)

    # ---- compute ---------------------------------------------------------------------------------------
    def _peak(self, dtype: str) -> float:
        if dtype in _FLOAT and "tf32" in self.profile.peak:
            self.note("fp32 GEMMs priced at the TF32 tensor-core peak")
            return self.profile.peak_of("tf32")
        return self.profile.peak_of({"float16": "fp16", "bfloat16": "bf16"}.get(dtype, dtype))

    def _stream_s(self, nbytes: float) -> float:
        p = self.profile
        return nbytes / (p.memory_bw * p.memory(nbytes)) if nbytes > 0 else 0.0

    def gemm_s(self, dtype: str, m: int, n: int, k: int, threads: int = 1, batch: int = 1) -> float:
        """Seconds of ``batch`` ``[m,k] @ [k,n]`` GEMMs (roofline of the GEMM curve and the memory-bound rate)."""
        if batch == 1 and self._report_has("gemm", dtype=dtype):
            return self.measured.gemm_s(dtype, m, n, k, _own(self.measured.gemm))
        if dtype == "fp8-block":
            return self._block_gemm_s(m, n, k)
        flops = 2.0 * m * n * k * batch
        if flops <= 0:
            return 0.0
        compute = flops / (self._peak(dtype) * self._gemm_curve(dtype)(flops))
        elem = 1 if dtype == "fp8" else (4 if dtype in _FLOAT else 2)
        return max(compute, self._stream_s(batch * elem * (m * k + k * n + m * n)))

    def _block_gemm_s(self, m: int, n: int, k: int) -> float:
        """A block-wise FP8 GEMM (:mod:`omnitron.plan.fp8`): native where the profile says ``[fp8] block_gemm =
        "native"`` (at the per-tensor FP8 rate); else emulated as the engine's provider runs it: both operands
        dequantized (:data:`DEQUANT_BYTES`), an fp32 GEMM at the non-tensor fp32 peak on the profile's GEMM curve
        (no TF32: ``allow_tf32`` is off), its result cast (:data:`RESULT_BYTES`)."""
        p = self.profile
        if p.fp8_block_gemm == "native":
            return self.gemm_s("fp8", m, n, k)
        if p.fp8_block_gemm is None:
            self.note(f"gemm: profile {p.name} does not say whether block-scaled FP8 GEMMs run natively ([fp8] "
                      "block_gemm); priced emulated, as the engine runs them where torch refuses the layout")
        flops = 2.0 * m * n * k
        gemm = max(flops / (p.peak_of("fp32") * p.gemm(flops)), self._stream_s(4 * (m * k + k * n + m * n)))
        return gemm + self._stream_s(DEQUANT_BYTES * m * k) + self._stream_s(DEQUANT_BYTES * k * n) + \
            self._stream_s(RESULT_BYTES * m * n)

    def _gemm_curve(self, dtype: str):
        """The profile's FP8 GEMM curve for ``fp8`` where it has one, else its GEMM curve (noted for fp8)."""
        p = self.profile
        if dtype != "fp8" or p.gemm_fp8 is not None:
            return p.gemm_fp8 if dtype == "fp8" else p.gemm
        self.note(f"gemm: profile {p.name} has no measured FP8 GEMM curve ([efficiency.gemm_fp8]); FP8 GEMMs at its "
                  "bf16 curve over the FP8 peak (optimistic: on the H200 that curve was 1.1-1.5x the measured rate)")
        return p.gemm

    def attention_s(self, dtype: str, flops: float, dropout: bool, threads: int = 1, local=None) -> float:
        """Seconds of one layer's core attention forward + backward worth ``flops`` (the bench's count: 3 x the
        causal forward); ``local``: the rank's shapes (:class:`omnitron.plan.work.Local`), needed on the
        materialised path (module docstring)."""
        if self.measured is not None and self.measured.attention:
            return self.measured.attention_s(dtype, flops, dropout, _own(self.measured.attention), local=local)
        if not dropout or local is None:
            return flops / (self._peak(dtype) * self.profile.attention(flops))
        x = local
        bh, q, d = x.batch * x.heads, x.seq // x.cp, x.head_dim
        gemm = self.gemm_s(dtype, q, x.seq, d, batch=bh)  # Q K^T over the whole scores; P V is alike
        scores = bh * q * x.seq * self.elem
        return 3 * 2 * gemm + self._stream_s(2 * scores) + self._stream_s(3 * scores)

    def fused_attention_dropout(self, threads: int = 1) -> bool:
        m = self.measured
        return m is not None and bool(m.attention) and m.fused_attention_dropout(_own(m.attention))

    def ring_block_s(self, dtype: str, flops: float, causal: bool, dropout: bool, threads: int = 1,
                     head_dim: int | None = None) -> float:
        """One ring-attention block worth ``flops`` (the bench's count, ``3 x 4 b h rows keys d``, halved when
        causal): the report's ``ring_block`` rows, else the fused attention rate; with attention dropout the fused
        flash block's hash on top (:meth:`hash_s` of the block's visible scores, ``flops / (12 head_dim)``; not
        without ``head_dim``)."""
        m = self.measured
        mine = m.ring_block_s(dtype, flops, causal, dropout, _own(m.attention)) if m is not None else None
        if mine is not None:
            return mine
        fused = flops / (self._peak(dtype) * self.profile.attention(flops))
        if not dropout or head_dim is None:
            return fused
        self.note("context parallelism: ring blocks with attention dropout priced as the fused flash block: the fused "
                  f"attention rate plus the hash mask's integer work ({HASH_INT_OPS} int32 ops per visible score at "
                  f"{INT32_PER_FP32_FLOP:g} x the fp32 peak; no mask stored); the Triton block itself ran 1.45-2.1x "
                  "ATen flash's time without dropout on the H200 (BENCHMARKS.md, 2026-12-04), not priced")
        return fused + self.hash_s(flops / (12 * head_dim))

    def hash_s(self, scores: float) -> float:
        """Seconds of the hash dropout's integer work over ``scores`` visible scores, forward + backward
        (:data:`HASH_INT_OPS` each at :data:`INT32_PER_FP32_FLOP` x the profile's fp32 peak)."""
        return HASH_INT_OPS * scores / (INT32_PER_FP32_FLOP * self.profile.peak_of("fp32"))

    def elementwise_s(self, op: str, mode: str, elements: float, threads: int = 1) -> float:
        """Seconds of element-wise ``op`` (fwd, bwd; ``adamw`` step) over ``elements`` at the memory-bound rate."""
        if self._report_has("elementwise", op=op, mode=mode):
            return self.measured.elementwise_s(op, mode, elements, _own(self.measured.elementwise))
        if op == "adamw":
            return self._stream_s(ADAMW_BYTES * elements)
        if op in fp8.WRITTEN:
            t = self._stream_s(fp8.op_bytes(op, self.elem) * elements)
            return t / self.cast_transpose() if op == fp8.CAST else t
        f, b = PASSES.get(op, (3, 3))
        return self._stream_s((f if mode == "fwd" else b) * self.elem * elements)

    def cast_transpose(self) -> float:
        """The per-tensor FP8 cast-transpose's rate over the copy rate of its bytes (:data:`omnitron.plan.fp8.CAST`):
        the bench report's where it has a kernels row of it, else the profile's ``[fp8] cast_transpose``, else 1
        (noted)."""
        m, p = getattr(self.measured, "cast_transpose", None), self.profile
        if m is not None:
            self.note(f"fp8: the cast-transpose at {m['fraction']:.3f} of the copy rate, the bench report's "
                      f"{m['impl']} kernel ({m['gbs']:.0f} of {m['copy_gbs']:.0f} GB/s)")
            return m["fraction"]
        if p.fp8_cast_transpose is not None:
            return p.fp8_cast_transpose
        self.note(f"fp8: profile {p.name} has no measured cast-transpose rate ([fp8] cast_transpose); the per-tensor "
                  "cast-transpose priced at the copy rate (a compiled layer's fused cast is unmeasured; on the H200 "
                  "the eager path's Triton kernel ran at 0.21 of it)")
        return 1.0

    def host_layer_s(self, mode: str, threads: int = 1) -> float:
        return 0.0  # the host runs ahead of the device (module docstring)

    def host_slowdown(self, op: str, busy: int):
        return None

    # ---- communication ---------------------------------------------------------------------------------
    def comm_s(self, op: str, nbytes: float, ranks: int, group: str | None = None) -> float:
        """Seconds of ``op`` over ``ranks`` ranks of the bound layout's ``group`` (stride 1 when None)."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        key = ("comm", op, nbytes, ranks, self.sizes.get(group, 1))
        if key not in self.memo:
            sp = span(ranks, key[-1], self.gpus_per_node)
            if sp.nodes == 1 and self._measured_inside_node(op, ranks):
                self.memo[key] = self.measured.comm_s(op, nbytes, ranks)
            elif op == "p2p":  # a ring's or a pipeline's neighbours: the slowest hop paces every step
                self.memo[key] = self.machine.p2p(nbytes, sp.nodes > 1)
            else:
                self.memo[key] = self.machine.collective(op, nbytes, sp)[0]
        return self.memo[key]
