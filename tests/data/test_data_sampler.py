"""PretrainingSampler: data-parallel partition, exact resume; collate and the DataLoader path."""
from __future__ import annotations

import os

import pytest
import torch

from omnitron.core.data import MockGPTDataset, PretrainingSampler, build_data_loader, collate


def test_partition_independent_of_dp_size():
    total, mbs = 103, 3
    for dp in (1, 2, 4):
        per_rank = [list(PretrainingSampler(total, 0, mbs, r, dp)) for r in range(dp)]
        steps = len(per_rank[0])
        assert all(len(p) == steps == total // (mbs * dp) for p in per_rank)
        flat = [i for s in range(steps) for r in range(dp) for i in per_rank[r][s]]
        assert flat == list(range(steps * mbs * dp))  # global order is 0, 1, 2, ... whatever dp is


def test_resume_continues_exactly():
    full = list(PretrainingSampler(100, 0, 2, 1, 2))
    s = PretrainingSampler(100, 0, 2, 1, 2)
    it = iter(s)
    first = [next(it) for _ in range(7)]
    state = s.state_dict()
    assert state == {"consumed_samples": 28}
    resumed = PretrainingSampler(100, 0, 2, 1, 2)
    resumed.load_state_dict(state)
    assert first + list(resumed) == full
    assert list(PretrainingSampler(100, 28, 2, 1, 2)) == full[7:]
    tail = list(PretrainingSampler(10, 0, 3, 0, 2, drop_last=False))
    assert tail == [[0, 1, 2], [6, 7, 8]]
    with pytest.raises(ValueError, match="dp_rank"):
        PretrainingSampler(10, 0, 1, 2, 2)
    with pytest.raises(ValueError, match="consumed_samples"):
        PretrainingSampler(10, 11, 1, 0, 1)


def test_loader_batches():
    ds = MockGPTDataset(24, seq_length=16, vocab_size=50, eod=49)
    loader = build_data_loader(ds, PretrainingSampler(len(ds), 4, 4, 1, 2), num_workers=0)
    batches = list(loader)
    assert len(batches) == 2
    b = batches[0]
    assert {k: tuple(v.shape) for k, v in b.items()} == {k: (4, 16) for k in ("tokens", "labels", "loss_mask",
                                                                                  "position_ids")}
    assert torch.equal(b["tokens"], torch.stack([ds[i]["tokens"] for i in range(8, 12)]))
    assert collate([ds[0]])["labels"].shape == (1, 16)
    with_worker = list(build_data_loader(ds, PretrainingSampler(len(ds), 4, 4, 1, 2), num_workers=1))
    assert all(torch.equal(a[k], b[k]) for a, b in zip(batches, with_worker) for k in a)


def test_data_args_roundtrip():
    import argparse

    from omnitron.core.data import add_data_args, data_config_from_args, tokenizer_from_config

    p = argparse.ArgumentParser()
    add_data_args(p)
    cfg = data_config_from_args(p.parse_args(["--data-path", "0.7", "A", "0.3", "B", "--split", "90,10,0",
                                              "--seq-length", "64", "--tokenizer-type", "NullTokenizer",
                                              "--vocab-size", "99", "--eod-mask-loss"]))
    assert cfg.data_path == ["0.7", "A", "0.3", "B"] and cfg.seq_length == 64 and cfg.eod_mask_loss
    assert tokenizer_from_config(cfg).vocab_size == 100 and cfg.seed == 1234


WORKERS_SCRIPT = """
import os, time, torch
from omnitron.core.data import PretrainingSampler, build_data_loader
class Slow(torch.utils.data.Dataset):
    def __len__(self): return 64
    def __getitem__(self, i):
        if i >= 8:
            time.sleep(120)  # busy reading when the rank dies: torch's own 5 s parent check never runs
        return {"pid": torch.tensor(os.getpid())}
pids = set()
for batch in build_data_loader(Slow(), PretrainingSampler(64, 0, 1, 0, 1), num_workers=2):
    pids.update(batch["pid"].tolist())
    if len(pids) == 2:
        print(*sorted(pids), flush=True)
"""


def test_loader_workers_die_with_their_rank():
    """SIGKILL of the process that owns a DataLoader: its worker processes (busy in ``__getitem__``) are gone
    within 3 s (the parent-death signal; before, they read on for as long as the item took)."""
    import signal
    import subprocess
    import sys

    from omnitron.testing.faults import alive, wait_gone

    proc = subprocess.Popen([sys.executable, "-c", WORKERS_SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert len(workers) == 2 and all(alive(p) for p in workers), workers
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    wait_gone(workers, 3.0)


SIGTERM_SCRIPT = """
import os, signal, torch
from omnitron.core.data import PretrainingSampler, build_data_loader
class Items(torch.utils.data.Dataset):
    def __len__(self): return 10**9
    def __getitem__(self, i): return {"pid": torch.tensor(os.getpid())}
asked = []
signal.signal(signal.SIGTERM, lambda *a: asked.append(1))  # a rank that finishes its step and saves
batches = iter(build_data_loader(Items(), PretrainingSampler(10**9, 0, 2, 0, 1), num_workers=2))
seen = set()
while len(seen) < 2:  # both workers running
    seen.update(next(batches)["pid"].tolist())
print("reading", flush=True)
while not asked:
    next(batches)
for _ in range(20):  # the step after the signal still reads its batches
    next(batches)
print("stopped cleanly", flush=True)
"""


def test_loader_workers_leave_sigterm_to_their_rank():
    """SIGTERM to the rank's whole process group (as torchrun stops a worker): the loader's workers, in a group
    of their own, do not get it; the rank reads on and stops on its own (before, they died and torch raised
    "DataLoader worker ... killed by signal" with a long traceback)."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    assert proc.stdout.readline() == "reading\n"
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out == "stopped cleanly\n" and "Traceback" not in err, err


class _StateProbe(torch.utils.data.Dataset):
    """Each item: whether the worker holds state its rank set at run time (a forked worker has it; a spawned or
    forkserver one starts from fresh imports)."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        import omnitron.core.data.sampler as sampler

        return {"inherited": torch.tensor([getattr(sampler, "_rank_state", 0)])}


def _loader_inherits_rank_state():
    import omnitron.core.data.sampler as sampler

    sampler._rank_state = 7  # set after import: no fresh interpreter can know it
    batches = list(build_data_loader(_StateProbe(), PretrainingSampler(4, 0, 2, 0, 1), num_workers=1))
    return [int(v) for b in batches for v in b["inherited"].flatten()]


@pytest.mark.skipif(not os.sys.platform.startswith("linux"), reason="fork is Linux's start method here")
def test_loader_workers_fork_inside_a_spawned_rank():
    """A rank that ``omnitron train``'s launcher spawned (here a forkserver child: its default start method is
    not fork either) forks its loader workers instead of starting fresh interpreters that import torch again.
    Fails with the loader's default context: under spawn the worker reads 0 for every item; under forkserver
    (this harness; Python 3.14's default on Linux) tie_worker kills the worker at once, its parent being the
    server, not the rank."""
    from omnitron.testing.distributed import run_distributed

    assert run_distributed(_loader_inherits_rank_state, 1, backend="cpu") == [[7, 7, 7, 7]]


def test_length_is_the_batches_each_rank_reads():
    """``len(sampler)`` (what ``len(DataLoader)`` reports) is the number of micro-batches this rank's iteration
    yields, from any resume point (given, or loaded from a state dict: one at the end of the data too), with or
    without ``drop_last``; without it the last partial step's batch goes to the ranks whose slice of it is not
    empty (fresh random sizes; the reference is the definition: the global order 0, 1, 2, ... cut into steps of
    mbs x dp, rank r taking items [r mbs, (r + 1) mbs) of each)."""
    import random

    rng = random.Random()
    for i in range(200):
        total, mbs, dp = rng.randint(1, 60), rng.randint(1, 5), rng.randint(1, 4)
        consumed, drop_last = total if i % 10 == 0 else rng.randint(0, total), rng.random() < 0.5
        left = list(range(consumed, total))
        steps = [left[i:i + mbs * dp] for i in range(0, len(left), mbs * dp)]
        for r in range(dp):
            want = [s[r * mbs:(r + 1) * mbs] for s in steps if len(s) == mbs * dp or not drop_last]
            want = [b for b in want if b]
            sampler = PretrainingSampler(total, consumed, mbs, r, dp, drop_last=drop_last)
            case = (total, consumed, mbs, r, dp, drop_last)
            assert len(sampler) == len(want), case
            assert list(sampler) == want, case
            loaded = PretrainingSampler(total, 0, mbs, r, dp, drop_last=drop_last)
            loaded.load_state_dict({"consumed_samples": consumed})
            assert len(loaded) == len(want) and list(loaded) == want, case
