"""--async-save's host staging buffers (:class:`omnitron.core.checkpoint.dist_staging.Staging`), one process.

A piece table like a rank's: weights as views of one flat parameter buffer (with a gap where a piece is
not this rank's to write), bf16 pieces of another flat buffer, optimizer slices in tensors of their own,
a non-contiguous narrowing and an empty piece. The reference is a plain ``clone`` of every live piece."""
from __future__ import annotations

import pytest
import torch

from omnitron.core.checkpoint.dist_staging import Staging
from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim


def _table(g: torch.Generator, device="cpu"):
    flat = torch.randn(1000, generator=g).to(device)  # the wrapper's flat fp32 parameter buffer
    half = torch.randn(300, generator=g).bfloat16().to(device)
    state = [torch.randn(50, generator=g).to(device) for _ in range(2)]
    mat = torch.randn(8, 6, generator=g).to(device)
    pieces = {"model/a": ((10, 20), [((0, 0), flat[0:200].view(10, 20))]),
              "model/b": ((300,), [((0,), flat[200:500])]),
              "model/c": ((400,), [((0,), flat[600:1000])]),  # flat[500:600] is not written: a gap
              "model/h": ((300,), [((0,), half[:100]), ((100,), half[100:])]),
              "optim/exp_avg/a": ((100,), [((0,), state[0]), ((50,), state[1])]),
              "optim/strided": ((8, 3), [((0, 0), mat[:, :3])]),  # non-contiguous
              "optim/empty": ((0,), [((0,), torch.empty(0, device=device))])}
    return pieces, (flat, half, *state, mat)


def _check(staged, pieces):
    for k, (shape, ps) in pieces.items():
        assert staged[k][0] == shape
        for (o1, live), (o2, copy) in zip(ps, staged[k][1]):
            assert o1 == o2 and copy.shape == live.shape and copy.dtype == live.dtype
            assert torch.equal(copy, live), k
            assert copy.numel() == 0 or copy.data_ptr() != live.data_ptr(), f"{k}: staged in the live memory"


def test_staging_copies_into_the_same_buffers_every_time():
    g = torch.Generator().manual_seed(0)
    pieces, live = _table(g)
    st = Staging(pieces)
    assert st.matches(pieces)
    written = sum(v.nbytes for _, ps in pieces.values() for _, v in ps)
    assert st.nbytes == written  # exactly one copy of what is written: the gap is not staged
    # abutting pieces of one storage are one copy: flat [0, 500) and [600, 1000), half, each optimizer
    # tensor, the strided narrowing, the empty piece
    assert len(st.copies) == 7
    first = st.stage()
    _check(first, pieces)
    ptrs = [v.data_ptr() for _, ps in first.values() for _, v in ps]
    kept = {k: [v.clone() for _, v in ps] for k, (_, ps) in first.items()}
    for t in live:  # training goes on: the live tensors change in place
        t.add_(torch.randn(t.shape, generator=g).to(t.dtype))
    for k, (_, ps) in first.items():  # the staged copy does not follow the live tensors
        assert all(torch.equal(v, c) for (_, v), c in zip(ps, kept[k]))
    second = st.stage()
    _check(second, pieces)
    assert [v.data_ptr() for _, ps in second.values() for _, v in ps] == ptrs


def test_staging_notices_moved_pieces():
    pieces, _ = _table(torch.Generator().manual_seed(1))
    st = Staging(pieces)
    moved = dict(pieces, **{"optim/exp_avg/a": ((100,), [((0,), torch.zeros(50)), ((50,), torch.zeros(50))])})
    assert not st.matches(moved)
    assert not st.matches({k: v for k, v in pieces.items() if k != "optim/empty"})


def stage_on_the_device(seed: int) -> list[str]:
    """The table on this rank's device, staged into pinned host buffers with the device's synchronize: the keys
    whose staged copy differs from the live tensor read back (blocking) to the host."""
    from omnitron.backends import get_backend

    be = get_backend()
    pieces, _ = _table(torch.Generator().manual_seed(seed), be.current_device())
    staged = Staging(pieces, pin=True).stage(be.synchronize)
    return [k for k, (_, ps) in pieces.items()
            if not all(torch.equal(c, live.cpu()) for (_, live), (_, c) in zip(ps, staged[k][1]))]


@requires_sim()
@pytest.mark.multiprocess
def test_staged_device_pieces_are_the_live_values_when_stage_returns():
    """On sim a non_blocking copy into pinned memory lands on the device's worker 2 s later unless the host waits
    (OMNITRON_SIM_ASYNC_DELAY_MS; guard pages off, so an early read shows the NaN the buffer holds, as a GPU's
    pinned buffer holds stale bytes): what stage() returns must already equal every live piece, or a background
    save writes garbage. Reference: each live device tensor copied to the host with a blocking copy."""
    import random

    seed = random.randrange(2**31)
    env = {"OMNITRON_SIM_ASYNC_DELAY_MS": "2000", "OMNITRON_SIM_GUARD_PAGES": "0", "OMNITRON_STRICT_COLLECTIVES": "0"}
    [wrong] = run_distributed(stage_on_the_device, 1, seed, backend="sim", env=env, timeout_s=120)
    assert wrong == [], (seed, wrong)


def test_the_saver_stages_the_pieces_it_is_given_after_they_move():
    """A reloaded optimizer state (or any rebuild) puts the pieces in new tensors: AsyncSaver's cached staging must
    then be rebuilt, so the next snapshot holds the new tensors' values, not the old ones'. Reference: the new
    pieces themselves."""
    from types import SimpleNamespace

    from omnitron.core.checkpoint.dist_async import AsyncSaver

    g = torch.Generator().manual_seed(2)
    c = SimpleNamespace(backend=SimpleNamespace(current_device=lambda: torch.device("cpu")),
                        groups=SimpleNamespace(rank=1))
    saver = AsyncSaver(collectives=None)
    old, _ = _table(g)
    _check(saver._staging(c, old).stage(), old)
    moved, _ = _table(g)  # the same keys and shapes in new tensors with other values
    _check(saver._staging(c, moved).stage(), moved)
