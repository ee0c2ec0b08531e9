"""Device profiles (omnitron/plan/devices/*.toml): each loads, is internally consistent, and is shipped with the
package (setup.py's package_data names the folder)."""
from __future__ import annotations

import math

import pytest

from omnitron.plan.profile import DEVICES_DIR, _read, available, load

REQUIRED = {"a100-80gb-sxm", "h100-sxm", "h200", "b200", "mi300x", "mtt-s4000"}


def test_required_profiles_ship():
    assert REQUIRED <= set(available())
    import pathlib

    setup = (pathlib.Path(DEVICES_DIR).parents[2] / "setup.py").read_text()
    assert "plan/devices/*.toml" in setup


@pytest.mark.parametrize("name", available())
def test_profile_is_consistent(name):
    """Peaks positive (fp8 twice bf16 where present, bf16 = fp16), efficiencies in (0, 1] and non-decreasing
    with size (achieved never above peak; the FP8 cast-transpose's fraction of the copy rate in (0, 1]), capacity as the
    runtime reports it at most the datasheet's, and every value's source cited in the file (a comment per section)."""
    p = load(name)
    assert p.name == name and p.gpus_per_node >= 1
    assert p.peak["bf16"] > 0 and p.peak["bf16"] == p.peak["fp16"]
    if "fp8" in p.peak:
        assert math.isclose(p.peak["fp8"], 2 * p.peak["bf16"], rel_tol=1e-3)
    for curve in (p.gemm, p.attention, p.memory) + ((p.gemm_fp8,) if p.gemm_fp8 is not None else ()):
        ys = [y for _, y in curve.points]
        assert all(0 < y <= 1 for y in ys) and ys == sorted(ys)
        assert curve(1e30) == ys[-1] and curve(1e-30) == ys[0]
    assert 0 < p.links.intra_eff <= 1 and 0 < p.links.nic_eff <= 1
    assert p.fp8_cast_transpose is None or 0 < p.fp8_cast_transpose <= 1  # the cast-transpose under the copy rate
    assert p.links.intra_bw >= p.links.p2p_bw > 0 and p.links.nic_bw > 0
    assert 0 < p.memory_bytes <= _read(p.path)["memory"]["capacity_gb"] * 1e9
    text = open(p.path).read()
    sections = [s for s in text.split("\n[")[1:]]
    assert all("#" in s for s in sections), "a section without its source"


def test_curve_interpolates_in_log_size():
    """Halfway in log(size) between two points gives the mean of their fractions."""
    p = load("a100-80gb-sxm")
    (x0, y0), (x1, y1) = p.gemm.points[1:3]
    assert math.isclose(p.gemm(math.sqrt(x0 * x1)), (y0 + y1) / 2)


def test_unknown_profile_names_the_shipped_ones():
    from omnitron.core.config.parallel import ConfigError

    with pytest.raises(ConfigError, match="h100-sxm"):
        load("h1000")


def test_profile_based_on_another_takes_its_tables_and_scales_kernel_rates(tmp_path):
    """A file with ``based_on`` gets every table of the base, its own keys override key by key, and
    ``[stack] kernel_rate`` scales the peaks and memory bandwidth only (links, curves, capacity as the base)."""
    import random

    base = load("h100-sxm")
    rate = random.uniform(0.5, 1.0)
    f = tmp_path / "h100-other.toml"
    f.write_text(f'name = "h100-other"\nbased_on = "h100-sxm"\n[stack]\n# test\nkernel_rate = {rate!r}\n'
                 '[links]\n# test\nnic_gbs = 12.5\n')
    p = load(str(f))
    assert p.name == "h100-other" and p.title == base.title
    assert all(math.isclose(p.peak[k], base.peak[k] * rate) for k in base.peak)
    assert math.isclose(p.memory_bw, base.memory_bw * rate) and p.memory_bytes == base.memory_bytes
    assert p.links.nic_bw == 12.5e9 and p.links.intra_bw == base.links.intra_bw
    assert p.gemm == base.gemm and p.attention == base.attention and p.memory == base.memory


def test_profiles_based_on_each_other_are_refused(tmp_path):
    from omnitron.core.config.parallel import ConfigError

    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text(f'based_on = "{b}"\n')
    b.write_text(f'based_on = "{a}"\n')
    with pytest.raises(ConfigError, match="based on each other"):
        load(str(a))


def test_gemm_curves_stay_under_the_published_maxima():
    """Each profile's GEMM curve against the published best-shape matmul rates it cites (Bekman's ML Engineering
    Open Book MAMF table, bf16: A100 SXM 271.2 TFLOP/s at 1024x10240x5120, H100 SXM 794.5 at 2048x2048x13312,
    B200 SXM 1,745.0 at 1792x16128x3072; AMD's ROCm blog "Measuring Max-Achievable FLOPs - Part 2": MI300X bf16
    708 at 4096x4864x32896): a best shape found by search is the most a device reached there, so the curve may
    not exceed it at any size; and at that shape it is no lower than the 0.85 of it that the H200's own measured
    FP8 curve keeps under its published maximum less that curve's 7% shape spread (0.925 - 0.07). MI300X is
    also held at or above Bekman's PyTorch figure (668.4 at 10240x15360x8192): the path the engine runs."""
    rows = {"a100-80gb-sxm": (271.2, (1024, 10240, 5120)), "h100-sxm": (794.5, (2048, 2048, 13312)),
            "b200": (1745.0, (1792, 16128, 3072)), "mi300x": (708.0, (4096, 4864, 32896))}
    sizes = [10 ** (e / 4) for e in range(28, 60)]
    for name, (tflops, (m, n, k)) in rows.items():
        p = load(name)
        rate = lambda f: p.peak["bf16"] * p.gemm(f) / 1e12  # noqa: E731
        assert all(rate(f) <= tflops * 1.0005 for f in sizes), name  # the profile's 4-digit fractions
        assert rate(2.0 * m * n * k) >= 0.855 * tflops, name
    mi = load("mi300x")
    assert mi.peak["bf16"] * mi.gemm(2.0 * 10240 * 15360 * 8192) / 1e12 >= 668.4


def test_at_scale_rate_is_the_recorded_fit():
    """``h100-sxm-at-scale`` is h100-sxm with every kernel rate (peaks, memory bandwidth) times the constant that
    ``benchmarks/plan_published_h100.py --fit`` recorded (stated in the file to three decimals: within 5e-4),
    links and memory unchanged; fitted under ``--assume-overlap megatron`` (the published runs' --tp-comm-overlap),
    the overlap the profile's file tells users to price it with."""
    import json
    import pathlib

    results = pathlib.Path(DEVICES_DIR).parents[2] / "benchmarks/results/plan_published"
    recorded = json.loads((results / "h100-mcore-r0.8-2026-12-07-megatron.json").read_text())
    f = recorded["fit"]["f"]
    assert recorded["overlap"] == "megatron"
    assert "--assume-overlap megatron" in (pathlib.Path(DEVICES_DIR) / "h100-sxm-at-scale.toml").read_text()
    base, at = load("h100-sxm"), load("h100-sxm-at-scale")
    assert all(abs(at.peak[k] / base.peak[k] - f) < 5e-4 for k in base.peak)
    assert abs(at.memory_bw / base.memory_bw - f) < 5e-4
    assert at.links == base.links and at.memory_bytes == base.memory_bytes
