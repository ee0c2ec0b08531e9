"""``omnitron bench``: every subcommand at tiny sizes writes a valid report of positive, finite figures; the bus
bandwidth follows nccl-tests' definition (checked by hand); ``compare`` renders three reports' tables and plots
and refuses missing or mismatched files in one line."""
from __future__ import annotations

import json
import math

import pytest

from omnitron.bench import comm
from omnitron.bench.report import ROW_FIELDS, ReportError, load, new_report, validate
from omnitron.cli import main
from omnitron.testing.musa_double import requires_double


def test_bus_bandwidth_by_hand():
    # nccl-tests: busbw = algbw x 2(n-1)/n for all-reduce, x (n-1)/n for all-gather / reduce-scatter /
    # all-to-all, x 1 for broadcast and p2p. 8 MiB in 2 ms at 4 ranks: algbw 8388608 / 0.002 = 4.194304 GB/s
    assert comm.bus_factor("all_reduce", 4) == 1.5 and comm.bus_factor("all_gather", 4) == 0.75
    assert comm.bus_factor("reduce_scatter", 8) == 0.875 and comm.bus_factor("broadcast", 8) == 1.0
    assert comm.bus_factor("all_reduce", 1) == 0.0 and comm.bus_factor("p2p", 2) == 1.0
    algbw = 8388608 / 2e-3 / 1e9
    assert algbw * comm.bus_factor("all_reduce", 4) == pytest.approx(6.291456, rel=1e-12)
    assert comm.sizes(1024, 1 << 20, 32) == [1024, 32768, 1048576]


def _figures_ok(rep: dict, *keys: str) -> None:
    assert rep["rows"], rep["kind"]
    for row in rep["rows"]:
        for k in keys:
            assert row[k] is not None and math.isfinite(row[k]) and row[k] > 0, (rep["kind"], k, row)


def test_subcommands_write_valid_reports(tmp_path, capsys):
    out = {k: str(tmp_path / f"{k}.json") for k in ("gemm", "memory", "attention", "comm", "elementwise")}
    assert main(["bench", "gemm", "--backend", "cpu", "--sizes", "64", "--model", "gpt2_tiny", "--tokens", "32",
                 "--dtypes", "fp32", "bf16", "fp8-tensor", "fp8-block", "--rounds", "3", "--json", out["gemm"]]) == 0
    assert main(["bench", "memory", "--backend", "cpu", "--max-bytes", "1M", "--json", out["memory"]]) == 0
    assert main(["bench", "attention", "--backend", "cpu", "--seqs", "32", "--heads", "2", "--head-dim", "16",
                 "--dtype", "fp32", "--json", out["attention"]]) == 0
    assert main(["bench", "comm", "--backend", "cpu", "--nproc-per-node", "2", "--max-bytes", "64K", "--factor",
                 "8", "--rounds", "3", "--json", out["comm"]]) == 0
    assert main(["bench", "elementwise", "--backend", "cpu", "--sizes", "1024", "4096", "--width", "64",
                 "--json", out["elementwise"]]) == 0
    reps = {k: load(p) for k, p in out.items()}
    _figures_ok(reps["gemm"], "ms", "tflops")
    from omnitron.bench import elementwise

    ew = {(r["op"], r["mode"], r["elements"]) for r in reps["elementwise"]["rows"]}
    modes = {"adamw": ("step",), "ring_merge": ("fwd",)}
    host = elementwise.HOST_LAYER["tokens"] * elementwise.HOST_LAYER["hidden"]
    assert ew == {(op, mode, n) for op in elementwise.OPS for mode in modes.get(op, ("fwd", "bwd"))
                  for n in ((1024, 4096) if op != "host_layer" else (host,))}
    assert all(r["ms"] >= 0 for r in reps["elementwise"]["rows"])
    assert {r["dtype"] for r in reps["gemm"]["rows"]} == {"fp32", "bf16", "fp8-tensor", "fp8-block"}
    assert {r["shape"] for r in reps["gemm"]["rows"]} >= {"square:64", "gpt2_tiny:qkv", "gpt2_tiny:fc1-wgrad"}
    _figures_ok(reps["memory"], "ms", "gbs")
    _figures_ok(reps["attention"], "ms", "tflops")
    ring = {(r["causal"], r["dropout"]) for r in reps["attention"]["rows"] if r["impl"] == "ring_block"}
    assert ring == {(True, 0.0), (True, 0.1), (False, 0.0), (False, 0.1)}
    engine = {r["dropout"] for r in reps["attention"]["rows"] if r["impl"].startswith("op:")}
    assert engine == {0.0, 0.1}  # the engine's attention without and with --attention-dropout
    host = [r for r in reps["comm"]["rows"] if r["op"] in comm.HOST_OPS]
    reps["comm"]["rows"] = [r for r in reps["comm"]["rows"] if r["op"] not in comm.HOST_OPS]
    _figures_ok(reps["comm"], "ms", "algbw_gbs", "busbw_gbs")
    assert {r["op"] for r in reps["comm"]["rows"]} == set(comm.OPS)
    assert {r["op"] for r in host} == set(comm.HOST_OPS)
    for row in host:  # at once / alone, both positive
        assert row["ms"] > 0 and row["alone_ms"] > 0 and row["slowdown"] == pytest.approx(row["ms"] / row["alone_ms"])
    for row in reps["comm"]["rows"]:  # the report's figures follow the definition (float64 both ways: ~1e-16)
        assert row["algbw_gbs"] == pytest.approx(row["bytes"] / (row["ms"] * 1e-3) / 1e9, rel=1e-9)
        assert row["busbw_gbs"] == pytest.approx(row["algbw_gbs"] * comm.bus_factor(row["op"], 2), rel=1e-9)
        assert row["group"] == "world" and row["devices"] == ["cpu:0", "cpu:0"] and 1 <= row["iters"] <= 3
    m = reps["comm"]["machine"]
    assert m["backend"] == "cpu" and m["world_size"] == 2 and m["torch"] and m["cpu_count"] >= 1


def _train_row(tmp_path, layout: str) -> dict:
    assert main(["bench", "train", "--backend", "cpu", "--model", "gpt2_tiny", "--layout", layout, "--iterations",
                 "3", "--json", str(tmp_path / "t.json"), "--", "--mock-data", "--tokenizer-type", "NullTokenizer",
                 "--vocab-size", "500", "--num-workers", "0", "--seq-length", "32", "--max-position-embeddings",
                 "32"]) == 0
    (row,) = load(str(tmp_path / "t.json"))["rows"]
    _figures_ok({"kind": "train", "rows": [row]}, "step_ms", "tokens_per_s", "tflops_per_device", "compute_ms")
    # causal-halved: only the attention-score term shrinks, so the figure is below Megatron's but not by half
    assert 0.5 * row["tflops_per_device"] < row["tflops_per_device_causal"] < row["tflops_per_device"]
    return row


def test_train_row_has_megatron_and_causal_figures(tmp_path):
    row = _train_row(tmp_path, "tp1")  # one process; the 2-rank layout below is slow
    assert row["layout"] == "single" and row["world_size"] == 1


@pytest.mark.slow
def test_train_row_of_a_two_rank_layout(tmp_path):
    row = _train_row(tmp_path, "tp2")
    assert row["layout"] == "tp2" and row["world_size"] == 2


def _fake(kind: str, device: str, rows: list[dict], **extra) -> dict:
    from omnitron.backends import get_backend

    rep = new_report(kind, get_backend("cpu"), rows, **extra)
    rep["machine"]["device_name"] = device
    return rep


def test_compare_three_reports_tables_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    paths = []
    for i, dev in enumerate(("A", "B", "C")):
        g = _fake("gemm", dev, [{"dtype": d, "shape": "square:64", "m": 64, "n": 64, "k": 64, "ms": 1.0 / (i + 1),
                                 "tflops": 2.0 * (i + 1)} for d in ("fp32", "bf16")])
        c = _fake("comm", dev, [{"op": "all_reduce", "bytes": b, "ranks": 2, "ms": 1.0, "algbw_gbs": b / 1e6,
                                 "busbw_gbs": b / 1e6 * (i + 1)} for b in (1024, 4096)])
        k = _fake("kernels", dev, [{"op": "rms_norm", "dtype": "float32", "mode": "fwd", "impl": "cpp", "ms": 2.0,
                                    "gbs": 5.0}], copy_gbs=10.0 * (i + 1))
        for rep in (g, c, k):
            paths.append(str(tmp_path / f"{dev}-{rep['kind']}.json"))
            json.dump(rep, open(paths[-1], "w"))
    assert main(["bench", "compare", *paths, "--plots", str(tmp_path / "png")]) == 0
    text = capsys.readouterr().out
    assert "== gemm" in text and "== comm" in text and "== kernels" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("fp32 square:64"))
    assert "(1.00x)" in line and "(2.00x)" in line and "(3.00x)" in line  # TFLOP/s 2, 4, 6 against the first
    for png in ("comm_busbw.png", "gemm_tflops.png", "kernels_pct_copy.png"):
        assert (tmp_path / "png" / png).stat().st_size > 1000


def test_bad_reports_are_one_line(tmp_path, capsys):
    (tmp_path / "x.json").write_text("{\"rows\": []}")
    (tmp_path / "bad.json").write_text("{not json")
    for args, words in (([str(tmp_path / "missing.json")], "no such report file"),
                        ([str(tmp_path / "x.json")], "not an omnitron bench report"),
                        ([str(tmp_path / "bad.json")], "not JSON")):
        assert main(["bench", "compare", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1
    g = _fake("gemm", "A", [])
    m = _fake("memory", "B", [])
    json.dump(g, open(tmp_path / "g.json", "w")), json.dump(m, open(tmp_path / "m.json", "w"))
    assert main(["bench", "compare", str(tmp_path / "g.json"), str(tmp_path / "m.json")]) == 2
    assert "every report is of another kind" in capsys.readouterr().err
    with pytest.raises(ReportError, match="row 0 of a memory report lacks gbs"):
        validate({**m, "rows": [{"op": "copy", "bytes": 1, "ms": 1.0}]}, "m.json")
    assert set(ROW_FIELDS) == {"gemm", "comm", "memory", "kernels", "attention", "elementwise", "train"}


@requires_double()
def test_gemm_and_memory_on_the_musa_double():
    from omnitron.bench import gemm, memory
    from omnitron.testing import musa_double

    with musa_double.installed():
        be = musa_double.MUSADoubleBackend()
        rows = gemm.run(be, sizes=[32], dtypes=["fp32", "bf16"], rounds=3, budget_s=0.1, log=lambda *_: None)
        rows += memory.run(be, byte_sizes=[1 << 12], rounds=3, budget_s=0.1, log=lambda *_: None)
        rep = new_report("gemm", be, [r for r in rows if "tflops" in r])
    assert rep["machine"]["backend"] == "musa-double" and all(r["ms"] > 0 for r in rows)


def test_the_single_layout_parses_as_one_device():
    """`bench all` on an accelerator trains at layout "single" (the name its rows give a one-device run); on
    the H200 (2026-12-04) the parser refused it and the train report was lost."""
    from omnitron.bench.train import parse_layout

    assert parse_layout("single") == ({"tp": 1, "pp": 1, "cp": 1, "ep": 1, "dp": 1}, 1)
    assert parse_layout("tp2,dp2") == ({"tp": 2, "pp": 1, "cp": 1, "ep": 1, "dp": 2}, 4)
    with pytest.raises(ValueError, match="not tpN"):
        parse_layout("singular")
