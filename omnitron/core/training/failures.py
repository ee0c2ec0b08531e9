"""Why a rank stopped, in one line, and the launcher's summary of a failed job.

A worker that fails classifies its exception (:func:`classify`): ``stopped`` (the run stopped on purpose
with a one-line reason: a non-finite loss, a bad setting or checkpoint), ``peer`` (the transport lost a
peer or timed out: gloo's "Connection reset by peer", a collective timeout: the consequence of another
rank's fault, not a cause) or ``error`` (anything else, printed with its traceback). Under ``omnitron train
--nproc-per-node N`` it writes a JSON report (never a pickle) into ``$OMNITRON_FAILURE_DIR``; the watchdog
writes ``watchdog`` reports naming the rank it suspects, or ``store`` reports when the rendezvous store (the
launcher or torchrun's agent) stopped answering; the launcher writes a ``startup`` report for a worker frozen
before it joined the job. :func:`summarize` turns the reports and exit codes
into the launcher's lines: the first names the rank at fault, its pid and its signal or exception; the
other ranks' reactions take one line per kind.
"""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import time
import traceback

log = logging.getLogger("omnitron.train")
REPORT_DIR_ENV = "OMNITRON_FAILURE_DIR"
_PEER_MARKERS = ("connection reset by peer", "connection closed by peer", "broken pipe", "connectfullmesh",
                 "connection refused", "timed out", "timeout", "socket closed", "end of file")
_NOISE = re.compile(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")


def _first_line(text: str, limit: int = 200) -> str:
    text = _NOISE.sub("", str(text)).strip()
    line = text.splitlines()[0] if text else ""
    line = line.split(". This is typically")[0]
    return line if len(line) <= limit else line[:limit - 3] + "..."


def classify(exc: BaseException) -> tuple[str, str]:
    """``(kind, one line)`` for an exception that ended a rank (kinds in the module docstring)."""
    from omnitron.backends.group_agreement import GroupCreationError
    from omnitron.core.training.nonfinite import TrainingStopped
    from omnitron.core.training.prejoin import PeerNeverJoined

    if isinstance(exc, PeerNeverJoined):  # a reaction to another rank's failure before it joined
        return "peer", _first_line(exc, 1000)
    if isinstance(exc, (TrainingStopped, GroupCreationError)) or _bad_input(exc):
        return "stopped", _first_line(exc, 1000)
    text = str(exc).lower()
    dist_error = type(exc).__name__.startswith("Dist") or "gloo" in text  # DistBackendError, DistNetworkError
    if isinstance(exc, RuntimeError) and (dist_error or any(m in text for m in _PEER_MARKERS)):
        return "peer", _first_line(exc)
    return "error", f"{type(exc).__name__}: {_first_line(exc)}"


def is_timeout(line: str) -> bool:
    return "timed out" in line.lower() or "timeout" in line.lower()


def write_report(rank: int, kind: str, line: str, suspect: int | None = None) -> None:
    """This rank's failure report for the launcher (nothing when not run by ``--nproc-per-node``)."""
    folder = os.environ.get(REPORT_DIR_ENV)
    if not folder:
        return
    record = {"rank": rank, "pid": os.getpid(), "kind": kind, "line": line, "suspect": suspect, "time": time.time()}
    tmp = os.path.join(folder, f".rank{rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, os.path.join(folder, f"rank{rank}.json"))


def elastic_line(rank: int, kind: str, line: str) -> str:
    """The one line a failed rank leaves in torchrun's report: the command, the rank and pid, the cause."""
    if not line.startswith(f"rank {rank} ("):  # the watchdog's reasons name their rank already
        line = f"rank {rank} (pid {os.getpid()}) {'failed' if kind in ('error', 'peer') else 'stopped'}: {line}"
    return f"{command_name()}: error: {line}"


def write_elastic_report(rank: int, kind: str, line: str) -> None:
    """Under torchrun (``$TORCHELASTIC_ERROR_FILE``, the file its agent reads for each worker): this rank's
    one line in the JSON torchrun's error handler writes (never a pickle). torchrun prints its report last,
    after its own traceback, and shows a failure's ``py_callstack`` as the "traceback" of its "Root Cause"
    block; with this file that field, the report's last line, is the cause in one line instead of "To
    enable traceback see ...". torchrun names the earliest failure as the root cause: a reaction to
    another rank's fault (``peer``, ``store``) is dated one second later, so it never outranks the rank
    at fault (which writes before it exits, before any peer can notice)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    text = elastic_line(rank, kind, line)
    stamp = int(time.time()) + (1 if kind in ("peer", "store") else 0)
    data = {"message": {"message": text, "extraInfo": {"py_callstack": text, "timestamp": str(stamp)}}}
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(data, f)
        os.replace(path + ".tmp", path)
    except OSError as err:  # the report is a courtesy; the rank's own stderr line stands
        log.warning("rank %d: could not write torchrun's error file %s (%s)", rank, path, err)


def refuse(err: BaseException, say: bool = True) -> int:
    """A bad setting found before this process joined a job: its line on stderr and, under torchrun (``RANK``
    set), in the agent's error file too, so torchrun's report ends with the cause rather than "To enable
    traceback see ..." 30 lines below it; exit code 2. ``say=False``: not on stderr (a verdict every rank of the
    host reaches alike, which its local rank 0 prints)."""
    if say:
        print(f"{command_name()}: error: {err}", file=sys.stderr)
    if "RANK" in os.environ:
        from omnitron.core.training.prejoin import announce_failure

        write_elastic_report(int(os.environ["RANK"]), "stopped", _first_line(err, 1000))
        announce_failure(int(os.environ["RANK"]), _first_line(err, 1000))  # its peers stop waiting for it
    return 2


def handle(exc: BaseException, rank: int, dump, silent=None) -> int:
    """Report the exception that ended this rank; returns the exit code. ``dump(reason)``: the watchdog's
    stack and flight-recorder dump, used when a collective timed out. ``silent()``: the watchdog's ranks whose
    heartbeat stopped (:meth:`~omnitron.core.training.watchdog.Watchdog.silent_ranks`), asked after a transport
    error when no launcher summarises the job (torchrun, one process a rank): a peer killed on another node showed
    here only as "Connection reset by peer", naming no rank."""
    kind, line = classify(exc)
    if kind == "peer" and silent is not None and not os.environ.get(REPORT_DIR_ENV):
        line = lost_peers(silent()) + line
    if kind == "peer" and is_timeout(line):
        dump(f"a collective timed out: {line}")
    if kind == "error":
        traceback.print_exception(exc, file=sys.stderr)
    write_elastic_report(rank, kind, line)
    if os.environ.get(REPORT_DIR_ENV):
        write_report(rank, kind, line)
    elif kind == "peer":
        log.error("rank %d: lost a peer (%s); the failing rank's own message comes first", rank, line)
    elif kind == "stopped":  # one process: the reason is the whole message
        print(f"{command_name()}: error: {line}", file=sys.stderr)
    else:
        log.error("rank %d: %s", rank, line)
    sys.stderr.flush()
    return 2 if _bad_input(exc) else 1


def lost_peers(gone: list[tuple[int, str, str | None]], shown: int = 4) -> str:
    """The head of a lost peer's line from the watchdog's census ``gone`` (``(rank, "pid P on HOST", failure)``):
    ``rank 2 (pid 9 on node-b) failed first: <its line>; `` for a rank that failed, else ``lost rank 2 (pid 9 on
    node-b), whose heartbeat stopped (...): ``; '' when the census found none."""
    failed = [g for g in gone if g[2]]
    if failed:
        r, info, line = failed[0]
        return f"rank {r} ({info or 'pid unknown'}) failed first: {line}; here: "
    if not gone:
        return ""
    infos = "; ".join(info or "pid unknown" for _, info, _ in gone[:shown]) + ("; ..." if len(gone) > shown else "")
    whose, its = ("whose heartbeat", "its") if len(gone) == 1 else ("whose heartbeats", "their")
    return (f"lost {_ranks([r for r, _, _ in gone])} ({infos}), {whose} stopped (killed, or {its} host is down or "
            f"unreachable; {its} own node's log says why): ")


def _bad_input(exc: BaseException) -> bool:
    """A bad setting, checkpoint or data set (a split the data cannot fill: found only when the ranks index it):
    exit code 2 and its one line, as the CLI's own checks give before any worker starts."""
    from omnitron.core.checkpoint import CheckpointError
    from omnitron.core.config.parallel import ConfigError
    from omnitron.core.data.builder import DataError

    return isinstance(exc, (ConfigError, CheckpointError, DataError))


def read_reports(folder: str) -> dict[int, dict]:
    """Every ``rankN.json`` in ``folder`` (JSON written by :func:`write_report`), keyed by rank."""
    out = {}
    for name in os.listdir(folder):
        if re.fullmatch(r"rank\d+\.json", name):
            with open(os.path.join(folder, name)) as f:
                rec = json.load(f)
            out[int(rec["rank"])] = rec
    return out


def _ranks(rs: list[int]) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(str(r) for r in sorted(rs))


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def summarize(workers: list[dict], reports: dict[int, dict]) -> list[str]:
    """The launcher's lines for a failed job. ``workers``: one dict per rank with ``rank``, ``pid``,
    ``exitcode``, ``order`` (exit order) and ``killed`` (by the launcher, after the first failure)."""
    failed = sorted((w for w in workers if w["exitcode"]), key=lambda w: w["order"])
    if not failed:
        return []
    by_rank = {w["rank"]: w for w in workers}
    suspects = [r["suspect"] for r in reports.values() if r["kind"] in ("watchdog", "startup")
                and r.get("suspect") is not None]
    reactions = ("peer", "watchdog", "store", "startup")
    causes = [w for w in failed if not w["killed"] and reports.get(w["rank"], {}).get("kind") not in reactions]
    store = [r for r in reports.values() if r["kind"] == "store"]
    lines, explained = [], set()
    if store and not suspects and not causes:  # the ranks' common dependency stopped, not a rank
        lines.append(f"the rendezvous store stopped answering (the launcher or torchrun agent that hosts it was "
                     f"frozen or gone): {_ranks([r['rank'] for r in store])} stopped on it")
        explained.update(r["rank"] for r in store)
    elif suspects and suspects[0] in by_rank and not (causes and causes[0]["rank"] != suspects[0]):
        w = by_rank[suspects[0]]
        why = next(r["line"] for r in reports.values() if r.get("suspect") == w["rank"])
        why = why.split(") ", 1)[1] if why.startswith(f"rank {w['rank']} (") else why
        lines.append(f"rank {w['rank']} (pid {w['pid']}) stopped responding: {why}")
        explained.add(w["rank"])
    else:
        if causes and all(reports.get(c["rank"], {}).get("kind") == "stopped" for c in causes):
            causes.sort(key=lambda c: c["rank"])  # the same decision on every rank: name the lowest
        w = (causes or [w for w in failed if not w["killed"]] or failed)[0]
        rep = reports.get(w["rank"])
        what = ("stopped: " if rep["kind"] == "stopped" else "failed: ") + rep["line"] if rep else _exit_text(
            w["exitcode"])
        lines.append(f"rank {w['rank']} (pid {w['pid']}) {what}")
        explained.add(w["rank"])
    first = reports.get(min(explained), {}).get("line") or ""
    groups: dict[str, list[int]] = {}
    texts: dict[str, str] = {}
    for w in failed:
        if w["rank"] in explained:
            continue
        key, text = _reaction(w, reports.get(w["rank"]), first)
        groups.setdefault(key, []).append(w["rank"])
        texts.setdefault(key, text)
    return lines + [f"{_ranks(rs)} {texts[key]}" for key, rs in groups.items()]


def _reaction(w: dict, rep: dict | None, first: str) -> tuple[str, str]:
    """(grouping key, text) of a rank that failed after the one at fault."""
    if rep is None:
        return ("killed", "still running then: killed by the launcher") if w["killed"] else (
            _exit_text(w["exitcode"]),) * 2
    line = rep["line"]
    if rep["kind"] == "peer":
        return "peer", f"then lost the connection to it ({line[:160]})"
    if rep["kind"] == "watchdog":
        return "watchdog", "timed out waiting (watchdog: stacks and last collectives above)"
    if rep["kind"] == "stopped" and line.split(": ", 1)[-1] == first.split(": ", 1)[-1]:
        return "same", "stopped the same way"
    return f"{rep['kind']}: {line}", f"failed: {line}"


def command_name() -> str:
    """``omnitron <sub-command>`` this process runs (``omnitron train`` when started otherwise, e.g. ``python -m
    omnitron.train``): the prefix of its one-line failure reports."""
    args = sys.argv[1:]
    sub = next((a for a in args if not a.startswith("-")), None)
    known = ("train", "generate", "serve")
    return f"omnitron {sub}" if os.path.basename(sys.argv[0]) in ("omnitron", "__main__.py") and sub in known \
        else "omnitron train"


def rank_list(ranks: list[int], shown: int = 8) -> str:
    """``rank 3`` / ``ranks 1, 2`` / ``ranks 1, 2, ... and 9 more``: a line's worth of rank numbers."""
    more = f" and {len(ranks) - shown} more" if len(ranks) > shown else ""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks[:shown])) + more
