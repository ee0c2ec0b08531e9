"""``omnitron bench compare``'s tables, checked against the reports they are made from: every row of every report
appears once under the measurement it names (no two rows of one report folded into one line: the attention
rows with and without dropout, each comm group, the comm report's host rows), with its own figure and the ratio
to the first report's computed here from the definition (higher-is-better figures: this / first; times and
slowdowns: first / this); rows of problems of another size (a kernels report's ``size``) are not set side by
side. Reports are made of fresh random figures each run. Also: the copy bandwidth the kernels are judged against
(the largest copy's), and corrupt reports refused in one line."""
from __future__ import annotations

import random

import pytest

from omnitron.bench import compare


def _report(kind: str, device: str, rows: list[dict], **extra) -> dict:
    return {"kind": kind, "machine": {"backend": "cpu", "device_name": device}, "rows": rows, "extra": extra}


def _fig(rng: random.Random) -> float:
    return rng.uniform(0.5, 50.0)


def _attention(rng):
    return [{"impl": impl, "dtype": "float32", "seq": s, "heads": 2, "head_dim": 16, "batch": 1, "causal": causal,
             "dropout": p, "ms": 1.0, "tflops": _fig(rng)}
            for impl in ("op:reference", "ring_block") for s in (32, 64) for causal in (True, False)
            for p in (0.0, 0.1)]


def _comm(rng):
    link = [{"op": op, "bytes": b, "ranks": n, "group": g, "ms": 1.0, "algbw_gbs": 1.0, "busbw_gbs": _fig(rng)}
            for op in ("all_reduce", "p2p") for b in (1024, 65536) for g, n in (("world", 4), ("intra", 2),
                                                                                ("inter", 2))]
    host = [{"op": op, "bytes": 0, "ranks": 4, "ms": _fig(rng), "alone_ms": 1.0, "slowdown": _fig(rng),
             "algbw_gbs": 0.0, "busbw_gbs": 0.0} for op in ("host_gemm", "host_stream")]
    return link + host


def _elementwise(rng):
    return [{"op": op, "mode": mode, "elements": n, "width": 64, "dtype": "float32", "ms": _fig(rng)}
            for op in ("gelu", "add") for mode in ("fwd", "bwd") for n in (1024, 4096)]


def _lines(text: str, name: str) -> dict[str, list[str]]:
    """{measurement: cells} of table ``name`` in ``text``."""
    block = text.split(f"== {name} (")[1].split("\n\n")[0].splitlines()[2:]
    return {cells[0]: cells[1:] for cells in (line.split(" | ") for line in block)}


def _expect(cell: str, v: float, base: float, higher: bool) -> None:
    ratio = v / base if higher else base / v
    assert cell == f"{v:.4g} ({ratio:.2f}x)", (cell, v, base)


@pytest.mark.parametrize("kind,make,table,keys,figure,higher", [
    ("attention", _attention, "attention",
     ("impl", "dtype", "seq", "heads", "head_dim", "batch", "causal", "dropout"), "tflops", True),
    ("comm", _comm, "comm", ("group", "op", "bytes", "ranks"), "busbw_gbs", True),
    ("comm", _comm, "comm host", ("op", "ranks"), "slowdown", False),
    ("elementwise", _elementwise, "elementwise", ("op", "mode", "elements", "width", "dtype"), "ms", False),
])
def test_every_row_once_with_its_figure_and_ratio(kind, make, table, keys, figure, higher):
    rng = random.Random()
    a, b = make(rng), make(rng)
    rng.shuffle(b)  # the second report's rows in another order: matched by what they measured
    text = compare.tables([_report(kind, "A", a), _report(kind, "B", b)])
    lines = _lines(text, table)
    host = ("host_gemm", "host_stream")
    mine = [r for r in a if (r["op"] in host) == (table == "comm host")] if kind == "comm" else a
    assert len(lines) == len(mine)  # one line per row: no row folded into another
    for row in mine:
        name = " ".join(str(row[k]) for k in keys)
        other = next(r for r in b if all(r.get(k) == row[k] for k in keys))
        _expect(lines[name][0], row[figure], row[figure], higher)
        _expect(lines[name][1], other[figure], row[figure], higher)


def test_kernels_of_another_size_are_not_side_by_side():
    rng = random.Random()
    rows = [{"op": "rms_norm", "dtype": "float32", "mode": "fwd", "impl": "cpp", "ms": _fig(rng), "gbs": 1.0}]
    small, large = _report("kernels", "A", rows, size="small"), _report("kernels", "B", rows, size="large")
    lines = _lines(compare.tables([small, large]), "kernels")
    assert lines == {"rms_norm float32 fwd cpp size small": [f"{rows[0]['ms']:.4g} (1.00x)", "-"],
                     "rms_norm float32 fwd cpp size large": ["-", f"{rows[0]['ms']:.4g}"]}
    same = _lines(compare.tables([small, _report("kernels", "B", rows, size="small")]), "kernels")
    assert list(same) == ["rms_norm float32 fwd cpp size small"] and same[list(same)[0]][1].endswith("(1.00x)")


def test_rows_of_older_reports_take_the_defaults():
    """Comm rows without ``group`` were the world's; attention rows without ``dropout`` / ``batch`` ran 0.0 / 1."""
    rng = random.Random()
    new = _attention(rng)
    old = [{k: v for k, v in r.items() if k not in ("dropout", "batch")} for r in new if r["dropout"] == 0.0]
    lines = _lines(compare.tables([_report("attention", "A", new), _report("attention", "B", old)]), "attention")
    for row in new:
        cells = lines[" ".join(str(row[k]) for k in ("impl", "dtype", "seq", "heads", "head_dim", "batch", "causal",
                                                    "dropout"))]
        assert (cells[1] == "-") == (row["dropout"] == 0.1)


def test_copy_bandwidth_is_the_largest_copys():
    """The kernels' % of copy bandwidth divides by the device memory's copy rate: the largest copy of a memory
    report (bytes read + written over its time), not a faster cache-sized one."""
    from omnitron.bench.memory import copy_gbs

    rng = random.Random()
    sizes = sorted(rng.sample([1 << p for p in range(12, 31)], 4))
    rows = [{"op": op, "bytes": b, "ms": rng.uniform(0.01, 5.0)} for b in sizes for op in ("copy", "read", "write")]
    for r in rows:
        r["gbs"] = (2 if r["op"] == "copy" else 1) * r["bytes"] / (r["ms"] * 1e-3) / 1e9
    rows[0]["gbs"] = max(r["gbs"] for r in rows) * 2  # the smallest copy, in a cache, fastest of all
    rng.shuffle(rows)
    last = next(r for r in rows if r["op"] == "copy" and r["bytes"] == sizes[-1])
    assert copy_gbs(rows) == pytest.approx(2 * sizes[-1] / (last["ms"] * 1e-3) / 1e9, rel=1e-12)
    assert copy_gbs([r for r in rows if r["op"] != "copy"]) is None


@pytest.mark.parametrize("change,words", [
    ({"rows": {"a": 1}}, "'rows' is not a JSON array"), ({"rows": None}, "'rows' is not a JSON array"),
    ({"rows": ["x"]}, "row 0 is not an object"), ({"machine": {}}, "the machine has no 'backend'"),
    ({"machine": []}, "'machine' is not a JSON object"), ({"extra": None}, "'extra' is not a JSON object"),
    ({"rows": [{"op": "copy", "bytes": 1, "ms": 1.0, "gbs": "fast"}]}, "row 0's gbs is 'fast', not a number"),
])
def test_a_corrupt_report_is_one_line(tmp_path, capsys, change, words):
    """Every part of a report that compare reads is checked on load: one line naming the file and the fault
    (these were tracebacks: a KeyError on the machine's name, a TypeError dividing strings or iterating None)."""
    import json

    from omnitron.backends import get_backend
    from omnitron.bench.report import new_report
    from omnitron.cli import main

    good = new_report("memory", get_backend("cpu"), [{"op": "copy", "bytes": 1024, "ms": 1.0, "gbs": 2.048e-3}])
    (tmp_path / "good.json").write_text(json.dumps(good))
    (tmp_path / "bad.json").write_text(json.dumps({**good, **change}))
    assert main(["bench", "compare", str(tmp_path / "bad.json"), str(tmp_path / "good.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bad.json" in err and words in err, err


def test_suite_kernels_report_names_its_size_and_memory_copy(tmp_path, monkeypatch):
    """``bench all``'s kernels report carries its problem size (what compare matches kernels by), the copy
    bandwidth of the same run's memory report at its largest size and the kernels the engine tries per op (the
    sub-benchmarks stubbed: only the wiring)."""
    from omnitron.backends import get_backend
    from omnitron.bench import attention, comm, elementwise, gemm, memory, suite, train
    from omnitron.bench.report import load

    rng = random.Random()
    copies = [{"op": "copy", "bytes": b, "ms": 1.0, "gbs": _fig(rng)} for b in suite.CPU["memory"]]
    kernel = {"op": "add", "dtype": "float32", "mode": "fwd", "impl": "cpp", "ms": 1.0, "gbs": 1.0}
    monkeypatch.setattr(memory, "run", lambda *a, **k: copies)
    resolved = {"add": rng.sample(["cpp", "vendor", "eager"], 2)}
    monkeypatch.setattr(suite, "_kernels", lambda *a, **k: ([kernel], {"resolved": resolved}))
    for mod in (gemm, comm, attention, elementwise):
        monkeypatch.setattr(mod, "run", lambda *a, **k: [])
    monkeypatch.setattr(train, "run", lambda *a, **k: 1 / 0)  # a kind that fails is left out
    written = suite.run_all(get_backend("cpu"), str(tmp_path), log=lambda *_: None)
    extra = load(written["kernels"])["extra"]
    assert extra == {"copy_gbs": copies[-1]["gbs"], "size": suite.CPU["kernels"], "resolved": resolved}
    assert "train" not in written


def test_gemm_plot_draws_no_bar_for_a_dtype_a_report_lacks(tmp_path, monkeypatch):
    """A CPU report has no tf32 row: its bar there is absent (NaN), not a 0 TFLOP/s measurement."""
    pytest.importorskip("matplotlib")
    import math

    from matplotlib.axes import Axes

    rng = random.Random()
    cpu = [{"dtype": d, "shape": "square:64", "tflops": _fig(rng)} for d in ("fp32", "bf16")]
    dev = [{"dtype": d, "shape": "square:64", "tflops": _fig(rng)} for d in ("fp32", "tf32", "bf16")]
    drawn, bar = [], Axes.bar

    def record(self, x, height, *a, **k):
        drawn.append(list(height))
        return bar(self, x, height, *a, **k)

    monkeypatch.setattr(Axes, "bar", record)
    compare.plots([_report("gemm", "A", cpu), _report("gemm", "B", dev)], str(tmp_path))
    (a, b) = drawn  # dtypes in order of first appearance: fp32, bf16, tf32
    assert a[:2] == [cpu[0]["tflops"], cpu[1]["tflops"]] and math.isnan(a[2])
    assert b == [dev[0]["tflops"], dev[2]["tflops"], dev[1]["tflops"]]


def test_comm_plot_has_a_panel_per_link_op_and_a_line_per_group(tmp_path, monkeypatch):
    """The host rows (no bytes, no bandwidth) draw no empty panel; each group of a report is its own line."""
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    titles, lines, plot, title = [], [], Axes.plot, Axes.set_title
    monkeypatch.setattr(Axes, "plot", lambda self, x, y, *a, **k: lines.append((k["label"], list(x))) or
                        plot(self, x, y, *a, **k))
    monkeypatch.setattr(Axes, "set_title", lambda self, t, *a, **k: titles.append(t) or title(self, t, *a, **k))
    compare.plots([_report("comm", "A", _comm(random.Random()))], str(tmp_path))
    assert titles == ["all_reduce", "p2p"]
    assert lines == [(name, [1024, 65536]) for _ in titles for name in ("cpu:A", "cpu:A intra", "cpu:A inter")]


def test_train_rows_of_other_flags_or_batches_are_not_side_by_side():
    """An FP8 run's row and a bf16 run's share model, layout and dtype (the parameters' bf16): the flags tell
    them apart; so do the batch and the sequence length."""
    rng = random.Random()

    def row(flags, gbs=16, seq=2048):
        return {"model": "gpt_1p3b", "layout": "single", "dtype": "bf16", "global_batch_size": gbs, "seq_length": seq,
                "iterations": 8, "step_ms": 1.0, "tokens_per_s": _fig(rng), "tflops_per_device": 1.0,
                "peak_memory_bytes": 1, "extra_flags": flags}

    a = [row("--bf16"), row("--bf16", gbs=32)]
    b = [row("--bf16 --fp8-format hybrid"), row("--bf16", seq=4096), row("--bf16")]
    lines = _lines(compare.tables([_report("train", "A", a), _report("train", "B", b)]), "train")
    assert len(lines) == 4  # a[0] and b[2] measured the same run
    same = [cells for cells in lines.values() if "-" not in cells]
    assert same == [[f"{a[0]['tokens_per_s']:.4g} (1.00x)",
                     f"{b[2]['tokens_per_s']:.4g} ({b[2]['tokens_per_s'] / a[0]['tokens_per_s']:.2f}x)"]]


def test_gemm_rows_of_a_layer_at_other_token_counts_are_not_side_by_side():
    """``--model gpt_1p3b --tokens 4096`` and ``--tokens 8192`` name their GEMMs alike ("gpt_1p3b:qkv"); the
    rows' m, n, k tell them apart."""
    rng = random.Random()
    a = [{"dtype": "bf16", "shape": "gpt_1p3b:qkv", "m": 4096, "n": 6144, "k": 2048, "ms": 1.0, "tflops": _fig(rng)}]
    b = [dict(a[0], m=8192, tflops=_fig(rng)), dict(a[0], tflops=_fig(rng))]
    lines = _lines(compare.tables([_report("gemm", "A", a), _report("gemm", "B", b)]), "gemm")
    assert lines["bf16 gpt_1p3b:qkv 8192 6144 2048"] == ["-", f"{b[0]['tflops']:.4g}"]
    _expect(lines["bf16 gpt_1p3b:qkv 4096 6144 2048"][1], b[1]["tflops"], a[0]["tflops"], True)


def _machine(rep: dict, **machine) -> dict:
    rep["machine"].update(machine)
    return rep


def _comm_of(world: int, rng) -> list[dict]:
    return [{"op": op, "bytes": b, "ranks": world, "ms": 1.0, "algbw_gbs": 1.0, "busbw_gbs": _fig(rng)}
            for op in ("all_reduce", "all_gather") for b in (1024, 65536)]


def test_comm_reports_of_other_world_sizes_say_why_nothing_lines_up():
    """Comm rows are matched by their ranks, so reports of 4 and 8 ranks share no row: the table's title says
    so in its line (it was a table of "-" beside each figure with no word why); reports that share rows say
    nothing."""
    rng = random.Random()
    worlds = rng.sample([2, 4, 8, 16], 2)
    reps = [_machine(_report("comm", f"M{w}", _comm_of(w, rng)), world_size=w) for w in worlds]
    title = compare.tables(reps).split("== comm (")[1].splitlines()[0]
    assert title.endswith(f": no row lines up, the world sizes differ: {worlds[0]}, {worlds[1]}"), title
    same = [_machine(_report("comm", f"M{i}", _comm_of(worlds[0], rng)), world_size=worlds[0]) for i in (1, 2)]
    assert "no row lines up" not in compare.tables(same)


def test_other_tables_name_the_keys_no_two_reports_share():
    """Any table whose reports share no measurement names the keys that differ (train runs of other sequence
    lengths), or, where every key has a value in common, that no whole measurement is in two reports."""
    rng = random.Random()
    seqs = rng.sample([16, 32, 64, 128], 2)
    row = {"model": "gpt_tiny", "layout": "single", "dtype": "float32", "global_batch_size": 4, "extra_flags": "",
           "iterations": 3, "step_ms": 1.0, "tflops_per_device": 1.0, "peak_memory_bytes": 1}
    reps = [_report("train", f"M{s}", [{**row, "seq_length": s, "tokens_per_s": _fig(rng)}]) for s in seqs]
    title = compare.tables(reps).split("== train (")[1].splitlines()[0]
    assert title.endswith(f": no row lines up, seq_length differs: {seqs[0]}, {seqs[1]}"), title
    crossed = [{**row, "seq_length": seqs[0], "dtype": "bfloat16"}, {**row, "seq_length": seqs[1]}]
    both = [_report("train", "A", [{**crossed[0], "tokens_per_s": 1.0}, {**crossed[1], "tokens_per_s": 1.0}]),
            _report("train", "B", [{**row, "seq_length": seqs[0], "tokens_per_s": 2.0},
                                   {**crossed[0], "seq_length": seqs[1], "tokens_per_s": 2.0}])]
    title = compare.tables(both).split("== train (")[1].splitlines()[0]
    assert "no row lines up, no measurement is in two reports" in title, title


def test_columns_are_whole_short_names_and_the_legend_has_the_machine():
    """Column names were the first 40 characters of "backend:device name" (``sim:sim (simulated accelerator
    over host``): now the backend and the device's model in whole words, without parentheses, clock or "CPU";
    two reports of one machine get two columns (#1, #2), and a legend above the tables gives each column's
    whole device name; a kind's reports are numbered among themselves (one machine is #1 in every table)."""
    import platform

    rng = random.Random()
    sim = f"sim (simulated accelerator over host memory, {platform.machine()})"  # the sim backend's device_name
    xeon = "Intel(R) Xeon(R) Platinum 8480+ CPU @ 2.00GHz"
    reps = [_machine(_report("memory", dev, [{"op": "copy", "bytes": 1024, "ms": 1.0, "gbs": _fig(rng)}]),
                     backend=backend, world_size=rng.randint(1, 8))
            for backend, dev in (("sim", sim), ("cpu", xeon), ("cpu", xeon))]
    text = compare.tables(reps)
    columns = text.split("== memory (")[1].splitlines()[1].split(" | ")[1:]
    assert columns == ["sim", "cpu:Intel Xeon Platinum 8480+ #1", "cpu:Intel Xeon Platinum 8480+ #2"], columns
    legend = text.split("\n\n")[0].splitlines()[1:]
    assert [line.strip() for line in legend] == [f"{col} = {r['machine']['backend']}: {r['machine']['device_name']}"
                                                 for col, r in zip(columns, reps)]
    gemm = [_machine(_report("gemm", xeon, [{"dtype": "fp32", "shape": "square:64", "tflops": _fig(rng)}]),
                     backend="cpu") for _ in range(2)]
    text = compare.tables(reps + gemm)
    assert text.split("== gemm (")[1].splitlines()[1].split(" | ")[1:] == columns[1:]
    # the gemm columns are the memory columns' machines: the legend names each once
    assert sorted(text.split("\n\n")[0].splitlines()[1:]) == sorted(legend)


def _stub_suite(monkeypatch, fails=(), invalid=()):
    """``bench all``'s sub-benchmarks stubbed: a kind in ``fails`` raises, one in ``invalid`` returns a row its
    report's schema refuses (no ``ms``), the others a valid row or none."""
    from omnitron.bench import attention, comm, elementwise, gemm, memory, suite, train

    def stub(kind, rows):
        bad = [{"op": "x"}] if kind in invalid else rows
        return lambda *a, **k: 1 / 0 if kind in fails else bad

    monkeypatch.setattr(memory, "run", stub("memory", [{"op": "copy", "bytes": 1, "ms": 1.0, "gbs": 1.0}]))
    monkeypatch.setattr(suite, "_kernels", stub("kernels", []))
    for kind, mod in (("gemm", gemm), ("comm", comm), ("attention", attention), ("elementwise", elementwise)):
        monkeypatch.setattr(mod, "run", stub(kind, []))
    row = dict.fromkeys(("model", "layout", "iterations", "step_ms", "tokens_per_s", "tflops_per_device",
                         "peak_memory_bytes"), 1)
    monkeypatch.setattr(train, "run", lambda *a, **k: 1 / 0 if "train" in fails else ({"op": "x"} if "train" in
                                                                                         invalid else row))


@pytest.mark.parametrize("fails,invalid", [((), ()), (("train",), ()), (("memory", "comm"), ()),
                                           ((), ("gemm",)), (("comm",), ("memory", "train"))])
def test_bench_all_exits_nonzero_naming_a_kind_that_failed(tmp_path, monkeypatch, capsys, fails, invalid):
    """``bench all`` exited 0 with a kind missing from the folder (its failure one log line among many), so the
    README's ``bench all --out DIR && bench compare ...`` went on to compare a folder short of it. The others are
    still written; the last line names what failed and the exit status is 1 (the sub-benchmarks stubbed). A kind
    whose rows the report schema refuses is that kind's failure too (it raised out of the suite, losing the kinds
    after it)."""
    from omnitron.bench import suite
    from omnitron.cli import main

    _stub_suite(monkeypatch, fails, invalid)
    rc = main(["bench", "all", "--backend", "cpu", "--out", str(tmp_path)])
    out = capsys.readouterr().out.strip().splitlines()
    failed = [k for k in suite.KINDS if k in fails + invalid]
    written = sorted(k for k in suite.KINDS if k not in failed)
    assert sorted(p.stem for p in tmp_path.glob("*.json")) == written
    ran = [line.split(":")[1].split()[0] for line in out if line.startswith("bench all: ")]
    assert ran == list(suite.KINDS), ran  # every kind of the report schema, in KINDS's order
    assert out[-1] == f"wrote {len(written)} reports into {tmp_path}: {', '.join(written)}" + (
        f"; failed: {', '.join(failed)} (the reasons above)" if failed else ""), out[-1]
    for kind in invalid:
        assert any(line.startswith(f"bench all: {kind} failed: ReportError: <new report>: row 0 of a {kind} "
                                   "report lacks ") for line in out), out
    assert rc == (1 if failed else 0)


def test_shipped_bench_all_kernel_reports_name_their_size():
    """``bench compare`` lines kernel rows up by the report's problem size; the shipped ``bench all`` reports
    (benchmarks/results, made before reports carried it) had none, so a vendor's new folder compared against the
    2-core Xeon's or the H200's matched no kernel row ("size differs: None, small"). Each names the size ``bench all``
    runs on its device kind (the suites that wrote them ran these sizes: small on a CPU, large on a device, and the
    benchmark's small and large cases are unchanged since)."""
    import pathlib

    from omnitron.bench import suite
    from omnitron.bench.report import load

    root = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    shipped = [load(str(p)) for p in sorted(root.rglob("kernels.json"))]
    made_by_suite = [r for r in shipped if " bench all " in r.get("command", "")]
    assert len(made_by_suite) >= 2, [r.get("command") for r in shipped]
    for rep in made_by_suite:
        sizes = suite.CPU if rep["machine"]["device_type"] == "cpu" else suite.DEVICE
        assert rep["extra"].get("size") == sizes["kernels"], (rep["command"], rep["extra"])


def test_a_table_names_the_folders_without_its_kind():
    """The shipped bench-cpu folder has no elementwise report (older than that kind): compared with a new folder,
    the elementwise table held the new machine alone without a word; its title now names the folders (or, for
    reports not read from files, the machines) that have no report of its kind. Tables every folder has say
    nothing; a table whose reports share no row says both."""
    rng = random.Random()
    old, new, third = "results/bench-cpu", "vendor/run1", "vendor/run2"

    def rep(kind, rows, where, device="A", **extra):
        return {**_report(kind, device, rows, **extra), "_path": f"{where}/{kind}.json"}

    memory = [{"op": "copy", "bytes": 1024, "ms": 1.0, "gbs": _fig(rng)}]
    reps = [rep("memory", memory, old), rep("memory", memory, new, "B"), rep("elementwise", _elementwise(rng), new)]
    text = compare.tables(reps)
    titles = {line.split(" (")[0][3:]: line for line in text.splitlines() if line.startswith("== ")}
    assert set(titles) == {"memory", "elementwise"}, titles
    assert titles["elementwise"].endswith(f": absent in {old}"), titles
    assert "absent" not in titles["memory"] and "no row lines up" not in titles["memory"], titles
    kernels = [{"op": "add", "dtype": "float32", "mode": "fwd", "impl": "cpp", "ms": _fig(rng)}]
    reps = [rep("kernels", kernels, old, size="small"), rep("kernels", kernels, new, size="large"),
            rep("memory", memory, third)]
    title = next(line for line in compare.tables(reps).splitlines() if line.startswith("== kernels ("))
    assert title.endswith(f": no row lines up, size differs: small, large; absent in {third}"), title
    # reports not read from files: named by machine
    title = compare.tables([_report("memory", "X", memory), _report("elementwise", "Y", _elementwise(rng))])
    assert "== elementwise (ms; ratio = vs cpu:Y, inverted: >1 is better): absent in cpu:X" in title, title


def test_kernels_as_run_is_each_machines_default_implementation():
    """The "kernels as run" table: per case, the row of the first implementation of the report's ``resolved``
    order (its kernel table's) that did not decline the case, its name after the figure, the ratio against the
    first machine's; a first choice that failed has no figure (the engine would fail too); the per-implementation
    rows stay in the "kernels" table."""
    rng = random.Random()

    def row(impl, mode, ms="time", note=""):
        return {"op": "swiglu", "dtype": "float32", "mode": mode, "impl": impl, "ms": _fig(rng) if ms else None,
                "gbs": 1.0, "note": note}

    modes = ("fwd", "fwd+bwd")
    a = [row(impl, m) for m in modes for impl in ("eager", "torch", "cpp")]
    b = [row("eager", m) for m in modes] + [row("vendor", "fwd"), row("vendor", "fwd+bwd", None, "declined: bias")]
    b += [dict(row("eager", "fwd"), op="rope"), row("vendor", "fwd", None, "failed: boom") | {"op": "rope"}]
    reps = [_report("kernels", "A", a, size="tiny", resolved={"swiglu": ["cpp", "eager"], "rope": ["eager"]}),
            _report("kernels", "B", b, size="tiny", resolved={"swiglu": ["vendor", "eager"], "rope": ["vendor",
                                                                                                     "eager"]})]
    text = compare.tables(reps)
    lines = _lines(text, "kernels as run")
    pick = {"A": {m: a[3 * i + 2] for i, m in enumerate(modes)}, "B": {"fwd": b[2], "fwd+bwd": b[1]}}
    assert set(lines) == {f"swiglu float32 {m} size tiny" for m in modes}, lines  # B's rope: its choice failed
    for m in modes:
        first, other = pick["A"][m], pick["B"][m]
        cells = lines[f"swiglu float32 {m} size tiny"]
        assert cells[0] == f"{first['ms']:.4g} cpp (1.00x)", cells
        assert cells[1] == f"{other['ms']:.4g} {other['impl']} ({first['ms'] / other['ms']:.2f}x)", cells
    # A's 3 implementations in 2 modes (B's eager swiglu beside A's), B's 2 vendor swiglu rows and 2 rope rows
    assert len(_lines(text, "kernels")) == 3 * 2 + 2 + 2
    older = _report("kernels", "C", a, size="tiny")  # no ``resolved``: made before reports kept it
    title = next(line for line in compare.tables([reps[0], older]).splitlines() if "kernels as run" in line)
    assert title.endswith(": no record of the implementations the engine runs (a report older than it) in cpu:C")
