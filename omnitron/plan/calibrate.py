"""``omnitron bench calibrate``: the machine's measured rates over its device profile's datasheet figures and over
the profile's achieved-efficiency curves (:mod:`omnitron.plan.profile`), from ``omnitron bench`` reports measured
on it (``bench all``'s folder, or gemm / memory / comm reports).

Per row:

- GEMM (a dtype the profile has a peak for; the peak of the row's ``math`` where it has one): ``TFLOP/s / peak``
  (the achieved fraction of the datasheet), and
  ``/ (peak x gemm(2 m n k))`` (measured over what the profile predicts for that size; FP8 rows over its
  ``gemm_fp8`` curve where it has one);
- memory ``copy`` / ``read`` / ``write``: ``GB/s / bandwidth`` and ``/ (bandwidth x memory(bytes moved))``;
- collectives inside one node (all-reduce, all-gather, reduce-scatter, all-to-all): ``busbw / intra_gbs`` and the
  machine model's time over the measured one (:meth:`omnitron.plan.machine.Machine.collective`), so above 1 means
  the model is slower than the machine, as in the other two.

The summary is each kind's median of the measured-over-profile ratios (GEMMs per dtype): bf16's (else fp16's) is
what a profile ``based_on`` this one would carry as ``[stack] kernel_rate`` for this machine's software stack
(as ``a100-80gb-sxm-2021`` does for 2021's), printed with the command's output and written with ``--json``.
"""
from __future__ import annotations

import json
import statistics

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
_DTYPES = {"fp32": "fp32", "tf32": "tf32", "bf16": "bf16", "fp16": "fp16"}


def _gemm_rows(profile, rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        # ``math``: the arithmetic the GEMM ran in (an fp32 row of a backend running float32 GEMMs in TF32: tf32)
        peak_name = "fp8" if str(r["dtype"]).startswith("fp8") else _DTYPES.get(r.get("math") or r["dtype"])
        if peak_name not in profile.peak or not r.get("tflops"):
            continue
        flops = 2.0 * r["m"] * r["n"] * r["k"]
        peak = profile.peak[peak_name]
        curve = profile.gemm_fp8 if peak_name == "fp8" and profile.gemm_fp8 is not None else profile.gemm
        out.append({"kind": f"gemm {r['dtype']}", "what": f"{r['m']}x{r['n']}x{r['k']}", "measured": r["tflops"],
                    "unit": "TFLOP/s", "of_datasheet": r["tflops"] * 1e12 / peak,
                    "of_profile": r["tflops"] * 1e12 / (peak * curve(flops))})
    return out


def _memory_rows(profile, rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        moved = r["gbs"] * 1e9 * r["ms"] * 1e-3
        out.append({"kind": "memory", "what": f"{r['op']} {r['bytes']} B", "measured": r["gbs"], "unit": "GB/s",
                    "of_datasheet": r["gbs"] * 1e9 / profile.memory_bw,
                    "of_profile": r["gbs"] * 1e9 / (profile.memory_bw * profile.memory(moved))})
    return out


def _comm_rows(profile, rows: list[dict], gpus_per_node: int) -> list[dict]:
    from omnitron.plan.machine import Machine, Span

    m, out = Machine(profile.links, gpus_per_node), []
    for r in rows:
        if r["op"] not in COLLECTIVES or r.get("nodes", 1) != 1 or r.get("group", "world") == "inter":
            continue
        model_s = m.collective(r["op"], r["bytes"], Span(r["ranks"], r["ranks"], 1))[0]
        out.append({"kind": "comm", "what": f"{r['op']} {r['ranks']} ranks {r['bytes']} B", "measured": r["busbw_gbs"],
                    "unit": "busbw GB/s", "of_datasheet": r["busbw_gbs"] * 1e9 / profile.links.intra_bw,
                    "of_profile": model_s / (r["ms"] * 1e-3)})
    return out


def calibrate(profile, reports: list[dict], gpus_per_node: int | None = None) -> dict:
    """``{"device", "rows", "summary"}`` of ``reports`` (loaded ``omnitron bench`` reports) against ``profile``."""
    rows = []
    for rep in reports:
        if rep["kind"] == "gemm":
            rows += _gemm_rows(profile, rep["rows"])
        elif rep["kind"] == "memory":
            rows += _memory_rows(profile, rep["rows"])
        elif rep["kind"] == "comm":
            rows += _comm_rows(profile, rep["rows"], gpus_per_node or profile.gpus_per_node)
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    summary = {k: statistics.median(r["of_profile"] for r in rows if r["kind"] == k) for k in kinds}
    return {"device": profile.name, "rows": rows, "summary": summary}


def kernel_rate(summary: dict) -> tuple[str, float] | None:
    """(the GEMM dtype, its median measured / profile ratio) a profile of this stack would scale its kernels by:
    bf16's, else fp16's (the training dtypes the profile's one GEMM curve is of); None without either."""
    for kind in ("gemm bf16", "gemm fp16"):
        if kind in summary:
            return kind, summary[kind]
    return None


def format_calibration(result: dict) -> str:
    lines = [f"{'kind':16s} {'what':30s} {'measured':>10s} {'unit':10s} {'/datasheet':>10s} {'/profile':>9s}"]
    lines += [f"{r['kind']:16s} {r['what']:30s} {r['measured']:10.4g} {r['unit']:10s} {r['of_datasheet']:10.3f} "
              f"{r['of_profile']:9.3f}" for r in result["rows"]]
    for kind, ratio in result["summary"].items():
        lines.append(f"median measured / profile, {kind}: {ratio:.3f}")
    rate = kernel_rate(result["summary"])
    if rate is not None:
        lines.append(f"a profile of this stack: based_on = \"{result['device']}\", [stack] kernel_rate = {rate[1]:.3f} "
                     f"(the {rate[0]} median)")
    return "\n".join(lines)


def write_json(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
