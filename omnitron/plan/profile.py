"""Device profiles: datasheet peaks, link bandwidths and achieved-efficiency curves of the accelerators users plan
for, as data files (``omnitron/plan/devices/*.toml``, each value's source cited beside it).

``omnitron plan --device NAME`` prices a layout with a profile when no ``omnitron bench`` report of the machine
exists (:class:`omnitron.plan.device_rates.DeviceRates`). A profile holds:

- ``peak_tflops``: dense FLOP/s per dtype (``fp32`` non-tensor, ``tf32``, ``bf16``, ``fp16``, ``fp8`` where the
  device has it);
- ``memory``: capacity (``usable_gib``: what the runtime reports) and bandwidth (GB/s);
- ``links``: intra-node bandwidth per GPU and direction (``intra_gbs``), the fraction collectives reach of it,
  one NIC's bandwidth per GPU (``nic_gbs``) and its fraction, per-step latencies; ``p2p_gbs`` where one peer
  gets less than the aggregate (a mesh without a switch); ``nvls_efficiency`` where the switch reduces
  (NVLink SHARP on NVSwitch 3 and later: H100, H200, B200);
- ``efficiency``: curves of the achieved fraction of peak by size: ``gemm`` (by FLOPs), ``attention`` (fused,
  by FLOPs), ``memory`` (memory-bound kernels, by bytes moved); interpolated linearly in log(size), clamped;
  ``gemm_fp8`` (optional, by FLOPs, a fraction of the ``fp8`` peak): FP8 GEMMs where they were measured to fall
  short of ``gemm`` at the doubled peak (H200, H100); without it FP8 GEMMs take the ``gemm`` curve (noted);
- ``fp8``: ``block_gemm`` (``native`` or ``emulated``), how block-scaled FP8 GEMMs run on the device's recorded
  software stack (:mod:`omnitron.plan.fp8`); unset: emulated (noted). ``cast_transpose``: the per-tensor
  cast-transpose kernel's measured rate (bf16 read, the FP8 operand and its transpose written) as a fraction of a
  device copy's measured in the same run, applied over the ``memory`` curve; unset: the copy rate (noted).

A profile may describe the same hardware under another software stack: ``based_on = "NAME"`` takes every
table of profile NAME and overrides what this file gives, and ``[stack] kernel_rate`` scales every kernel
rate (peaks and memory bandwidth; links unchanged) by the stack's measured rate relative to the base's.
"""
from __future__ import annotations

import bisect
import math
import os
import tomllib
from dataclasses import dataclass

from omnitron.core.config.parallel import ConfigError

DEVICES_DIR = os.path.join(os.path.dirname(__file__), "devices")


@dataclass(frozen=True)
class Curve:
    """Achieved fraction by size: points ``(size, fraction)`` sorted by size."""

    points: tuple[tuple[float, float], ...]

    def __call__(self, size: float) -> float:
        xs = [math.log(p[0]) for p in self.points]
        x = math.log(max(size, 1e-30))
        i = bisect.bisect_left(xs, x)
        if i == 0:
            return self.points[0][1]
        if i == len(xs):
            return self.points[-1][1]
        (x0, y0), (x1, y1) = (xs[i - 1], self.points[i - 1][1]), (xs[i], self.points[i][1])
        return y0 + (x - x0) * (y1 - y0) / (x1 - x0)


@dataclass(frozen=True)
class Links:
    """A node's links, per GPU and direction (bytes/s), with the fractions collectives reach and step latencies."""

    intra: str
    intra_bw: float
    intra_eff: float
    intra_latency: float
    nic: str
    nic_bw: float
    nic_eff: float
    inter_latency: float
    p2p_bw: float
    """One peer's share of the intra-node links (``intra_bw`` behind a switch; one link in a mesh)."""
    nvls_eff: float = 0.0
    """NVLink SHARP (NVLS): the fraction of ``intra_bw`` an all-reduce reduced in the switch reaches
    (:meth:`omnitron.plan.machine.Machine.nvls`); 0 where the switch does not reduce (no NVLS)."""


@dataclass(frozen=True)
class DeviceProfile:
    """One accelerator's datasheet peaks, memory, links and efficiency curves (module docstring)."""

    name: str
    title: str
    path: str
    gpus_per_node: int
    peak: dict[str, float]
    """Dense FLOP/s per dtype name (``bf16``, ``fp16``, ``fp8``, ``tf32``, ``fp32``)."""
    memory_bytes: int
    memory_bw: float
    links: Links
    gemm: Curve
    attention: Curve
    memory: Curve
    gemm_fp8: Curve | None = None
    """FP8 GEMMs' fraction of the ``fp8`` peak by FLOPs; None: the ``gemm`` curve (module docstring)."""
    fp8_block_gemm: str | None = None
    """``[fp8] block_gemm``: ``native`` or ``emulated``, how block-scaled FP8 GEMMs run; None: unknown (emulated)."""
    fp8_cast_transpose: float | None = None
    """``[fp8] cast_transpose``: the per-tensor cast-transpose's rate over a copy's of the same bytes; None: 1
    (noted)."""

    def peak_of(self, dtype: str) -> float:
        """Dense FLOP/s of ``dtype``; fp32 GEMMs run as TF32 where the device has it (noted by the caller)."""
        if dtype in self.peak:
            return self.peak[dtype]
        raise ConfigError(f"device profile {self.name} has no {dtype} peak; use --bf16 or --fp16, or another device")


def available() -> list[str]:
    """Names of the shipped profiles."""
    return sorted(f[:-5] for f in os.listdir(DEVICES_DIR) if f.endswith(".toml"))


def _curve(table: dict, key: str) -> Curve:
    xs, ys = table[key], table["fraction"]
    if len(xs) != len(ys) or not xs:
        raise ValueError(f"{key} and fraction differ in length")
    return Curve(tuple(sorted(zip(map(float, xs), map(float, ys)))))


def _block_gemm(value):
    if value not in (None, "native", "emulated"):
        raise ValueError(f"fp8.block_gemm {value!r} is not 'native' or 'emulated'")
    return value


def _fraction(value, key: str):
    if value is not None and not 0 < float(value) <= 1:
        raise ValueError(f"{key} {value} outside (0, 1]")
    return None if value is None else float(value)


def _path(name: str) -> str:
    path = name if name.endswith(".toml") else os.path.join(DEVICES_DIR, f"{name.lower()}.toml")
    if not os.path.isfile(path):
        raise ConfigError(f"--device {name!r}: no such device profile; shipped: {', '.join(available())} "
                          "(or give a path to a .toml of the same form)")
    return path


def _read(path: str, seen: tuple = ()) -> dict:
    """The file's tables, over those of the profile it is ``based_on`` (table by table, key by key)."""
    with open(path, "rb") as f:
        d = tomllib.load(f)
    base = d.pop("based_on", None)
    if base is None:
        return d
    if base in seen:
        raise ConfigError(f"--device {path}: profiles based on each other ({' -> '.join(seen + (base,))})")
    merged = _read(_path(base), seen + (base,))
    for key, value in d.items():
        merged[key] = merged.get(key, {}) | value if isinstance(value, dict) else value
    return merged


def load(name: str) -> DeviceProfile:
    """The profile ``name`` (a shipped one, or a path to a ``.toml`` of the same form); ConfigError naming the
    shipped ones when there is none."""
    path = _path(name)
    d = _read(path)
    try:
        rate = float(d.get("stack", {}).get("kernel_rate", 1.0))
        if not 0 < rate <= 1.5:
            raise ValueError(f"stack.kernel_rate {rate} outside (0, 1.5]")
        ln, eff = d["links"], d["efficiency"]
        links = Links(ln["intra"], ln["intra_gbs"] * 1e9, ln["intra_efficiency"], ln["intra_latency_us"] * 1e-6,
                      ln["nic"], ln["nic_gbs"] * 1e9, ln["nic_efficiency"], ln["inter_latency_us"] * 1e-6,
                      ln.get("p2p_gbs", ln["intra_gbs"]) * 1e9, float(ln.get("nvls_efficiency", 0.0)))
        return DeviceProfile(d["name"], d["title"], path, int(d["gpus_per_node"]),
                             {k: v * 1e12 * rate for k, v in d["peak_tflops"].items()},
                             int(d["memory"]["usable_gib"] * 2**30), d["memory"]["bandwidth_gbs"] * 1e9 * rate, links,
                             _curve(eff["gemm"], "flops"), _curve(eff["attention"], "flops"),
                             _curve(eff["memory"], "bytes"),
                             _curve(eff["gemm_fp8"], "flops") if "gemm_fp8" in eff else None,
                             _block_gemm(d.get("fp8", {}).get("block_gemm")),
                             _fraction(d.get("fp8", {}).get("cast_transpose"), "fp8.cast_transpose"))
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"--device {path}: malformed profile ({type(err).__name__}: {err}); compare with "
                          f"{os.path.join(DEVICES_DIR, 'h100-sxm.toml')}") from None
