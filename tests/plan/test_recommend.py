"""``omnitron plan --devices``: every listed layout divides the devices, heads, layers and global batch and fits
the memory given (the memory model, re-derived from the printed launch flags); the list is ordered by predicted
tokens/s and skips only layouts that do not fit; bad requests get one line naming the binding constraint."""
from __future__ import annotations

import shlex

import pytest

from omnitron.cli import main

GIVEN = {"model": "gpt2_tiny", "mock_data": True, "tokenizer_type": "NullTokenizer", "vocab_size": 200,
         "seq_length": 64, "max_position_embeddings": 64, "global_batch_size": 8}
ARGV = ["--model", "gpt2_tiny", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200",
        "--seq-length", "64", "--max-position-embeddings", "64"]


def _settings_from_launch(line: str, devices: int):
    """Settings parsed back from a printed ``launch:`` line (the user's flags + the printed ones)."""
    from omnitron.core.training.arguments import parse_settings

    flags = shlex.split(line.split("(or torchrun's world)", 1)[1])
    return parse_settings(ARGV + flags, devices)


def test_listed_layouts_divide_fit_and_are_ordered(tmp_path, constant_rates, capsys):
    """The memory limit is set 1 byte under the fastest layout's need, so the search must skip it."""
    from omnitron.plan.memory import estimate
    from omnitron.plan.recommend import candidates, recommend
    from omnitron.plan.speed import predict

    rates = constant_rates(tmp_path, 0.05, 5.0)
    given = GIVEN | {"nproc_per_node": 4}
    every = candidates(given, 4)
    for c in every:
        c.step = predict(c.settings, rates)
    fastest = max(every, key=lambda c: c.step.tokens_per_s)
    limit = max(s.total for s in estimate(fastest.settings)) - 1
    got = recommend(GIVEN, 4, limit, rates, top=3)
    assert fastest.name() not in [c.name() for c in got]
    speeds = [c.step.tokens_per_s for c in got]
    assert speeds == sorted(speeds, reverse=True) and len(got) == 3
    # nothing faster than the last listed was skipped unless it does not fit
    for c in every:
        if c.step.tokens_per_s > speeds[-1] and c.name() not in [g.name() for g in got]:
            assert max(s.total for s in estimate(c.settings)) > limit, c.name()
    from omnitron.plan.recommend import format_choices

    out = format_choices(got, 4, limit)
    launches = [line for line in out.splitlines() if line.strip().startswith("launch:")]
    assert len(launches) == 3
    for c, line in zip(got, launches):
        s = _settings_from_launch(line, 4)
        pc = s.parallel
        tp, pp, cp = pc.tensor_model_parallel_size, pc.pipeline_model_parallel_size, pc.context_parallel_size
        assert tp * pp * cp * s.dp == 4 and s.model.num_attention_heads % tp == 0 and s.model.num_layers % pp == 0
        assert s.training.global_batch_size == 8 == s.training.micro_batch_size * s.dp * s.num_microbatches
        assert max(st.total for st in estimate(s)) <= limit
        assert c.name() == type(c)(c.flags, s).name()


def test_moe_search_covers_expert_parallelism(tmp_path, constant_rates):
    """A MoE model's candidates hold every valid ep (dividing the experts, dp x cp a multiple of it), each
    launchable; the expert-parallel ones price their all-to-alls."""
    from omnitron.plan.recommend import candidates, recommend
    from omnitron.plan.speed import predict

    given = GIVEN | {"nproc_per_node": 4, "num_experts": 4}
    every = candidates(given, 4)
    got = {(c.settings.parallel.tensor_model_parallel_size, c.settings.parallel.pipeline_model_parallel_size,
            c.settings.parallel.context_parallel_size, c.settings.parallel.expert_model_parallel_size) for c in every}
    want = {(tp, pp, cp, ep) for tp in (1, 2, 4) for pp in (1, 2, 4) for cp in (1, 2, 4) for ep in (1, 2, 4)
            if tp * pp * cp <= 4 and 4 % (tp * pp * cp) == 0 and (4 // (tp * pp)) % ep == 0}
    assert got == want
    rates = constant_rates(tmp_path, 0.05, 5.0)
    for c in every:
        if c.settings.parallel.expert_model_parallel_size > 1:
            assert predict(c.settings, rates).ep > 0, c.name()
    assert recommend(GIVEN | {"num_experts": 4}, 4, 2**40, rates, top=3)


@pytest.mark.parametrize("extra,needle", [
    (["--device-memory", "1MiB", "--global-batch-size", "8"],
     r"no layout fits 0.0009766 GiB: the smallest needs "),
    (["--device-memory", "80GiBs", "--global-batch-size", "8"], "--device-memory '80GiBs' is not a size"),
    (["--device-memory", "80GiB"], "--devices: give --global-batch-size"),
    (["--device-memory", "80GiB", "--global-batch-size", "8", "--model", "llama3_9b"],
     "--model 'llama3_9b' is not a preset"),
    (["--global-batch-size", "8"], "--devices needs --device-memory"),
])
def test_bad_requests_get_one_line(extra, needle, tmp_path, constant_reports, capsys):
    reports = constant_reports(tmp_path, 0.05, 5.0)
    assert main(["plan", *ARGV, "--devices", "4", "--bench", *reports, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


@pytest.mark.parametrize("dtype,advice", [([], True), (["--bf16"], False)])
def test_no_fit_suggests_bf16_only_in_fp32(dtype, advice, tmp_path, constant_reports, capsys):
    reports = constant_reports(tmp_path, 0.05, 5.0)
    argv = ["plan", *ARGV, "--devices", "4", "--bench", *reports, "--device-memory", "1MiB", "--global-batch-size", "8"]
    assert main(argv + dtype) == 2
    err = capsys.readouterr().err.strip()
    assert "no layout fits" in err and err.endswith("or use --bf16") == advice, err


def test_no_fit_names_the_smallest_need(tmp_path, constant_rates):
    """The error's figure is the least peak over the memory-minimal variants, and no candidate needs less."""
    from omnitron.core.config.parallel import ConfigError
    from omnitron.plan.memory import estimate
    from omnitron.plan.recommend import candidates, recommend

    rates = constant_rates(tmp_path, 0.05, 5.0)
    with pytest.raises(ConfigError) as err:
        recommend(GIVEN, 2, 2**20, rates)
    need = float(str(err.value).split("the smallest needs ")[1].split(" GiB")[0]) * 2**30
    least = min(max(s.total for s in estimate(c.settings)) for c in candidates(GIVEN | {"nproc_per_node": 2}, 2))
    assert abs(need / least - 1) < 1e-3  # the message prints 4 significant digits
    import gc

    assert gc.isenabled()  # the search pauses the cyclic collector (recommend.collector_paused), even when it fails
    # the up-front check stops at the first layout that fits (_smallest's ``enough``), with the same answer as pricing
    # every one: at exactly the least need something is listed, a byte under it the error names that need
    least = int(least)
    listed = recommend(GIVEN, 2, least, rates)
    assert listed and all(c.peak <= least for c in listed)
    with pytest.raises(ConfigError, match="the smallest needs "):
        recommend(GIVEN, 2, least - 1, rates)


def test_the_fit_check_stops_at_the_first_that_fits_with_the_walks_answer(monkeypatch):
    """recommend's up-front check (``_smallest(..., enough=memory)``) prices candidates with the transient probes
    (a probe set each) in floor order only until one fits; when none fits it returns the walk's smallest. Three
    stand-in candidates whose floor order (1, 2, 3) differs from their full peaks' (10, 5, 8): hand-derived answers."""
    import types

    import omnitron.plan.memory as memory
    import omnitron.plan.recommend as rec

    floors, peaks = {"a": 1, "b": 2, "c": 3}, {"a": 10, "b": 5, "c": 8}

    class Cand:
        def __init__(self, name):
            self.settings, self.stages = name, []

        peak = property(lambda self: max(s.total for s in self.stages))

    probed = []

    def estimate(name, transients=True, load=None, device=None):
        probed.append(name) if transients else None
        return [types.SimpleNamespace(total=peaks[name] if transients else floors[name], recompute=0)]

    monkeypatch.setattr(rec, "candidates", lambda *a, **k: [Cand(n) for n in "abc"])
    monkeypatch.setattr(memory, "estimate", estimate)
    for enough, want, walked in ((None, "b", "abc"), (4, "b", "abc"), (6, "b", "ab"), (9, "b", "ab"),
                                 (10, "a", "a")):
        probed.clear()
        got = rec._smallest({}, 1, enough=enough)
        assert (got.settings, "".join(probed)) == (want, walked), enough


def test_the_smallest_layout_is_priced_under_the_routing_histogram(tmp_path, monkeypatch):
    """With ``--moe-expert-load`` the up-front "no layout fits" check prices each memory-minimal layout under the
    histogram, as the search does (it priced them at balanced routing: a memory between the two passed the check
    and the search came back empty), and its message names the busiest ep rank. A one-layer, one-head model, so
    the memory-minimal layouts differ in ep and cp only and the smallest is an ep2 one."""
    import omnitron.plan.memory as memory
    from omnitron.plan.recommend import _no_fit, _smallest
    from omnitron.plan.routing import read_expert_load

    given = GIVEN | {"num_experts": 4, "nproc_per_node": 2, "num_attention_heads": 1, "num_query_groups": 1,
                     "num_layers": 1}
    path = tmp_path / "load.json"
    path.write_text('{"tokens_per_expert": [[97, 1, 1, 1]]}')  # one row: every MoE layer at these shares
    load, seen, estimate = read_expert_load(str(path)), [], memory.estimate

    def recorded(settings, transients=True, load=None, device=None):
        seen.append(load)
        return estimate(settings, transients, load, device)

    monkeypatch.setattr(memory, "estimate", recorded)
    smallest = _smallest(given, 2, False, load=load)
    assert seen and all(x is load for x in seen), seen  # every candidate priced under the histogram
    assert smallest.settings.parallel.expert_model_parallel_size == 2, smallest.name()
    msg = _no_fit(smallest, 1)
    assert f"on stage 0 on its busiest ep rank ({smallest.stages[0].ep_rank}, --moe-expert-load)" in msg, msg
    assert "busiest" not in _no_fit(_smallest(given, 2, False), 1)


def test_interleaving_is_searched_down_to_one_layer_a_virtual_stage(tmp_path, constant_rates):
    """The search tries every vpp dividing a stage's layers up to 16, and one layer a virtual stage beyond (Megatron
    accepts any divisor), where the interleaved schedule runs (micro-batches a multiple of pp): 36 layers on pp2
    (18 a stage: 1, 2, 3, 6, 9 and 18) and pp4 (9: 1, 3, 9); with a single micro-batch on pp2, 1F1B only. Each is
    priced and its schedule's bubble shrinks as vpp grows (constant rates, equal stages)."""
    from omnitron.plan.layouts import candidates
    from omnitron.plan.speed import predict

    given = GIVEN | {"nproc_per_node": 4, "num_layers": 36}
    vpps = {}
    for c in candidates(given, 4):
        pc = c.settings.parallel
        if (pc.tensor_model_parallel_size, pc.context_parallel_size) == (1, 1) and not c.flags.get(
                "pipeline_schedule") and not c.flags.get("recompute_granularity"):
            key = (pc.pipeline_model_parallel_size, c.settings.training.micro_batch_size)
            vpps.setdefault(key, {})[pc.virtual_pipeline_model_parallel_size or 1] = c
    assert set(vpps[(2, 1)]) == {1, 2, 3, 6, 9, 18} and set(vpps[(4, 1)]) == {1, 3, 9}
    assert set(vpps[(2, 4)]) == {1}  # 8 / (4 x dp 2) = 1 micro-batch
    rates = constant_rates(tmp_path, 0.05, 0.0)
    bubbles = [predict(vpps[(2, 1)][v].settings, rates).bubble for v in (1, 2, 3, 6, 9, 18)]
    assert all(a > b for a, b in zip(bubbles, bubbles[1:])), bubbles


def test_per_stage_memory_prints_runs_once():
    """A deep pipeline's equal middle stages print once with their count; unequal neighbours each, in order."""
    import random

    from omnitron.plan.recommend import _runs

    assert _runs([]) == "" and _runs(["1.000"]) == "1.000"
    values = [f"{random.choice([1, 2, 3]):.3f}" for _ in range(40)]
    expanded = []
    for part in _runs(values).split(" "):
        if part.startswith("x"):
            expanded += [expanded[-1]] * (int(part[1:]) - 1)
        else:
            assert not expanded or part != expanded[-1]  # a run is never split
            expanded.append(part)
    assert expanded == values


def test_fit_line_says_where_the_transients_were_left_out(tmp_path, constant_rates):
    """The search's last line claims backward's transients in every listed stage only where they were probed: a
    stage whose transient probes did not align (``StageMemory.probed`` False: the estimate warned and left them out,
    as for Mixtral 8x7B at tp1 on 64 devices, 2026-12-07) is named as short. Before, the line said "included (every
    stage)" whatever the probes did."""
    from dataclasses import replace

    from omnitron.commands.plan import settings_of
    from omnitron.plan.layouts import Choice
    from omnitron.plan.memory import estimate
    from omnitron.plan.recommend import format_choices
    from omnitron.plan.speed import predict

    s = settings_of({"model": "gpt2_tiny", "mock_data": True, "tokenizer_type": "NullTokenizer", "vocab_size": 200,
                     "layout": "pp2", "global_batch_size": 8})
    stages, step = estimate(s), predict(s, constant_rates(tmp_path, 0.5, 1.0))
    assert all(m.probed for m in stages)
    short = [stages[0], replace(stages[1], probed=False, transient=0)]
    out = format_choices([Choice({}, s, step, stages), Choice({}, s, step, short)], 2, 2**30).splitlines()[-1]
    assert out.endswith("backward's transients left out on #2 (their transient probes did not align, warned above): "
                        "those totals are short of the step's peak"), out
    assert format_choices([Choice({}, s, step, stages)], 2, 2**30).endswith("included (every stage)")


def test_layout_names_say_which_recomputation():
    """The listed name tells full recomputation (every layer), block (the first K layers of each chunk) and
    selective apart: they differ in speed and memory, and the launch flags alone are long to read."""
    from omnitron.plan.layouts import Choice

    assert [Choice(f, None)._recompute() for f in (
        {}, {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
        {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 3},
        {"recompute_granularity": "selective"})] == ["", " recompute", " recompute-block3", " recompute-selective"]


def test_context_parallel_sizes_grow_with_the_sequence():
    """cp 1-8 wherever the sequence splits into 2 cp chunks, and beyond 8 only while a rank keeps 4,096 tokens:
    Llama 3 405B's cp16 at 131,072 tokens is searched, cp16 at 8,192 (512 a rank) is not."""
    from omnitron.plan.layouts import _cp_sizes, candidates

    assert _cp_sizes(8192) == [1, 2, 4, 8] and _cp_sizes(131072) == [1, 2, 4, 8, 16, 32]
    assert _cp_sizes(6) == [1] and _cp_sizes(7) == [1] and _cp_sizes(16) == [1, 2, 4, 8]
    long = GIVEN | {"seq_length": 131072, "max_position_embeddings": 131072, "nproc_per_node": 32,
                    "global_batch_size": 1}
    cps = {c.settings.parallel.context_parallel_size for c in candidates(long, 32, minimal=True)}
    assert {16, 32} <= cps
