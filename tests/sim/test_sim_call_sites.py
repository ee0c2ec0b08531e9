"""Sim's reports name the user's call, not omnitron's collective plumbing: in strict mode the engine's send and
receive run as batches that omnitron/backends/flight.py issues (``_fused_batch``), and the site hook
(omnitron/backends/sim/device.py ``_issue_site``) skips those frames as it skips collectives.py's."""
from __future__ import annotations

import inspect

import pytest
import torch

from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim

pytestmark = [requires_sim(), pytest.mark.multiprocess, pytest.mark.planted]
ENV = {"OMNITRON_STRICT_COLLECTIVES": "1", "OMNITRON_STRICT_TIMEOUT_S": "5", "OMNITRON_SIM_DEADLOCK_S": "30"}


def engine_sizes_differ() -> str:
    """Rank 0 sends 6 elements through the engine's collectives, rank 1 receives 5; the error's text (the call's, or
    the release's on a rank whose call completed), or "". The process group is closed here: after the fault its
    communicator is aborted, and the harness's last barrier would fail on it."""
    import torch.distributed as dist

    from omnitron.backends import get_backend

    be, out = get_backend(), ""
    try:
        if dist.get_rank() == 0:
            be.collectives.send(torch.ones(6, device=be.device()), dst=1)  # the send's site
        else:
            be.collectives.recv(torch.empty(5, device=be.device()), src=0)  # the receive's site
    except RuntimeError as err:
        out = str(err)
    try:
        dist.destroy_process_group()
    except RuntimeError as err:  # rank 0's send completed: told at the group's release if the report has reached it
        out = out or str(err)
        dist.destroy_process_group()  # the report said, the release completes
    return out


def _line(marker: str) -> str:
    """``test_sim_call_sites.py:LINE (engine_sizes_differ)`` of the line ending in ``marker``."""
    lines, first = inspect.getsourcelines(engine_sizes_differ)
    no = next(first + i for i, text in enumerate(lines) if text.rstrip().endswith(marker))
    return f"test_sim_call_sites.py:{no} (engine_sizes_differ)"


def test_strict_p2p_report_names_the_callers_lines():
    out = run_distributed(engine_sizes_differ, 2, backend="sim", env=ENV, timeout_s=90)
    msg = "\n".join(out)
    assert "sim: point-to-point size mismatch" in msg, out
    assert _line("# the send's site") in msg and _line("# the receive's site") in msg, msg
    assert "flight.py" not in msg and "collectives.py" not in msg, msg
