"""Flight recorder and strict collective checking (the machinery behind ``backends/collectives.py``).

Every collective and point-to-point call of :class:`~omnitron.backends.collectives.Collectives`
is recorded here as a fingerprint (op, group ranks, shape, dtype, reduce op, peer, call site) in
a per-rank ring buffer. Recording is a tuple append (the call site is a frame walk, formatted
only when dumped), so it stays on even when strict checking is off: a hang watchdog reads it
with :func:`flight_recorder_dump`.

Strict mode (``OMNITRON_STRICT_COLLECTIVES=1``) adds what NCCL enforces and gloo forgives:

* before each collective, the members of the group exchange fingerprints; any difference (a
  different shape, a skipped or extra collective) raises on every member at once with every
  rank's fingerprint and call site, instead of pairing the wrong tensors or hanging;
* point-to-point groups (``batch_p2p``) on one communicator complete in the order posted, as
  NCCL runs them: a group is started only after the previous one on that communicator finished,
  and each send carries a header checked against the receive (shape, dtype, call site);
* every strict wait is bounded (``OMNITRON_STRICT_TIMEOUT_S``, default 60 s): on expiry the rank
  publishes its pending operations in the rendezvous store, reads its peers' and raises with all
  of them, so a schedule that would deadlock on NCCL fails here with both sides printed.
"""
from __future__ import annotations

import collections
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

_HERE = (os.path.join("omnitron", "backends", "collectives.py"), os.path.join("omnitron", "backends", "flight.py"),
         os.path.join("omnitron", "backends", "staged.py"))  # the host-staged layer is the collectives layer too
HEADER_BYTES = 512
"""Size of one encoded fingerprint (call sites are truncated to fit)."""


def strict_enabled() -> bool:
    """``OMNITRON_STRICT_COLLECTIVES`` is set to a true value (read at each call: tests flip it)."""
    return os.environ.get("OMNITRON_STRICT_COLLECTIVES", "0") not in ("", "0", "false", "False")


def strict_timeout_s() -> float:
    """Bound on any strict-mode wait, in seconds (``OMNITRON_STRICT_TIMEOUT_S``, default 60)."""
    return float(os.environ.get("OMNITRON_STRICT_TIMEOUT_S", "60"))


def call_site() -> tuple[str, int, str]:
    """(file, line, function) of the first frame outside the collectives layer."""
    f = sys._getframe(2)
    while f.f_back is not None and f.f_code.co_filename.endswith(_HERE):
        f = f.f_back
    return f.f_code.co_filename, f.f_lineno, f.f_code.co_name


def format_site(site: tuple[str, int, str]) -> str:
    path, line, fn = site
    i = path.rfind("omnitron" + os.sep)
    return f"{path[i:] if i >= 0 else os.path.basename(path)}:{line} ({fn})"


_RANKS: dict[int, tuple] = {}


def group_ranks(group) -> tuple[int, ...]:
    """World ranks of ``group`` (``None``: the world), cached per group object."""
    key = id(group)
    hit = _RANKS.get(key)
    if hit is None or hit[0] is not group:
        ranks = tuple(range(dist.get_world_size())) if group is None else tuple(dist.get_process_group_ranks(group))
        hit = _RANKS[key] = (group, ranks)
    return hit[1]


class FlightRecorder:
    """Ring buffer of the last ``size`` calls of this rank: (seq, time, op, ranks, detail, site)."""

    def __init__(self, size: int) -> None:
        self.entries: collections.deque = collections.deque(maxlen=size)
        self.seq = 0
        self.on = size > 0
        """``OMNITRON_FLIGHT_RECORDER_SIZE=0`` turns recording off (the benchmark's baseline)."""

    def record(self, op: str, group, shape: tuple, dtype, extra: str, site) -> None:
        """Append one call; nothing is formatted here (this runs on every collective)."""
        self.seq += 1
        self.entries.append((self.seq, time.time(), op, group, shape, dtype, extra, site))

    def dump(self) -> list[str]:
        out = []
        for seq, t, op, group, shape, dtype, extra, site in list(self.entries):
            ranks = list(group_ranks(group)) if dist.is_initialized() else []
            stamp = datetime.datetime.fromtimestamp(t).strftime("%H:%M:%S.%f")[:-3]
            out.append(f"#{seq} {stamp} {op} ranks={ranks} {fingerprint(shape, dtype, extra)} at {format_site(site)}")
        return out


RECORDER = FlightRecorder(int(os.environ.get("OMNITRON_FLIGHT_RECORDER_SIZE", "256")))


def release_groups() -> None:
    """Forget every process group this module holds (the recorder's calls, the cached ranks, the strict
    sequence numbers, the last p2p batches), once the groups are destroyed. NOTE: a gloo group's worker threads
    live as long as the group object; held here, they outlived ``destroy_process_group`` into the interpreter's
    finalization, where one still dropping a finished all-reduce's tensors (that takes the GIL) ended in
    ``pthread_exit`` inside a destructor and aborted the process after its work was done (SIGABRT;
    tests/parallel/test_groups_freed_at_destroy.py)."""
    RECORDER.entries.clear()
    for held in (_RANKS, _SEQ, _PENDING):
        held.clear()


_SOURCES: list = []


def add_source(fn) -> None:
    """Add ``fn() -> list[str]``, a process-group backend's own record (issue and completion of every
    operation it ran, whoever issued it), to what :func:`flight_recorder_dump` returns (idempotent)."""
    if fn not in _SOURCES:
        _SOURCES.append(fn)


def flight_recorder_dump() -> list[str]:
    """The last recorded collective / p2p calls of this rank, oldest first, one line each; then the
    process-group backends' records (``simccl #N ... completed HH:MM:SS.mmm``), where one keeps them."""
    return RECORDER.dump() + [line for fn in _SOURCES for line in fn()]


def fingerprint(shape: tuple, dtype, extra: str = "") -> str:
    """``shape=[...] dtype=... <extra>``: what peers must agree on (shape entries ``*`` may differ)."""
    text = f"shape={list(shape)} dtype={str(dtype).replace('torch.', '')}"
    return f"{text} {extra}" if extra else text


# ---- strict collective check -----------------------------------------------------------------
_SEQ: dict[int, list] = {}


def _next_seq(group) -> int:
    key = id(group)
    hit = _SEQ.get(key)
    if hit is None or hit[0] is not group:
        hit = _SEQ[key] = [group, 0]
    hit[1] += 1
    return hit[1]


def _encode(text: str, device) -> torch.Tensor:
    raw = text.encode()[:HEADER_BYTES]
    buf = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf.to(device)


def _decode(buf: torch.Tensor) -> str:
    return bytes(buf.cpu().tolist()).rstrip(b"\0").decode(errors="replace")


def check_collective(op: str, detail: str, group, site, device) -> None:
    """Exchange this call's fingerprint with every member of ``group``; raise on any difference."""
    ranks = group_ranks(group)
    if len(ranks) < 2:
        return
    key = f"{op} #{_next_seq(group)} {detail}"
    mine = _encode(f"{key}\t{format_site(site)}", device)
    out = torch.empty(len(ranks) * HEADER_BYTES, dtype=torch.uint8, device=device)
    work = dist.all_gather_into_tensor(out, mine, group=group, async_op=True)
    timed_wait(work, lambda: [f"fingerprint exchange before {key} at {format_site(site)}"], group)
    seen = [_decode(out[i * HEADER_BYTES:(i + 1) * HEADER_BYTES]).split("\t") for i in range(len(ranks))]
    if any(s[0] != key for s in seen):
        lines = "\n".join(f"  rank {r}: {s[0]} at {s[1] if len(s) > 1 else '?'}" for r, s in zip(ranks, seen))
        raise RuntimeError(f"strict collectives: the ranks {list(ranks)} issued different collectives "
                           f"(a shape that differs or a collective skipped on some rank; every rank must issue "
                           f"the same collectives in the same order):\n{lines}")


# ---- bounded waits and the deadlock report ----------------------------------------------------
def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: the report holds this rank only
        return None


def _peer_report(pending: list[str], group, wait_s: float) -> str:
    """Publish this rank's pending operations; collect those of ``group``'s other members.

    Each rank then waits (bounded) until every peer has read the reports, so the rank hosting the
    store does not exit before the others have theirs."""
    me, ranks = dist.get_rank(), group_ranks(group)
    lines = [f"  rank {me} (this rank) waits on: " + "; ".join(pending)]
    store = _store()
    if store is None:
        return "\n".join(lines)
    deadline = time.monotonic() + wait_s
    try:
        store.set(f"omnitron/strict/pending/{me}", "; ".join(pending))
        for r in ranks:
            if r == me:
                continue
            key = f"omnitron/strict/pending/{r}"
            while not store.check([key]) and time.monotonic() < deadline:
                time.sleep(0.05)
            text = store.get(key).decode() if store.check([key]) else "(no report: not in a strict wait)"
            lines.append(f"  rank {r} waits on: {text}")
        done = "omnitron/strict/read/" + ",".join(map(str, ranks))
        count = store.add(done, 1)
        while count < len(ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
            count = store.add(done, 0)
    except Exception as err:  # noqa: BLE001 - the store went away: report what we have
        lines.append(f"  (peer reports incomplete: {type(err).__name__})")
    return "\n".join(lines)


def timed_wait(work, pending, group) -> None:
    """Wait for ``work`` at most the strict timeout; on expiry raise with every peer's pending ops.

    ``pending`` is a callable returning this rank's pending operations (built only on failure).
    """
    if work is None:
        return
    limit = strict_timeout_s()
    try:
        # NOTE: a bounded wait, not polling: gloo's point-to-point works report is_completed() only once waited
        work.wait(timeout=datetime.timedelta(seconds=limit))
    except RuntimeError as err:  # our timeout, or a peer's closing the connection after its own
        text = str(err).lower()
        closed = "connection closed" in text or "connection reset" in text
        if not closed and "timed out" not in text and "timeout" not in text:
            raise
        cause = str(err).splitlines()[0][:200]
        if closed:  # gloo closes a pair when the peer's own bounded wait expires: its report is already posted
            # (or, for a dead peer, never comes: the short wait bounds that)
            report = _peer_report(pending(), group, wait_s=min(2.0, limit))
            raise RuntimeError(f"strict collectives: a peer closed the connection while this rank waited ({cause}); "
                               f"a peer that timed out in its own strict wait does so, and its report is among "
                               f"these. Pending operations:\n{report}\nIf no peer reports a deadlock, the peer "
                               f"died: its own log says why.") from None
        report = _peer_report(pending(), group, wait_s=min(10.0, limit))
        raise TimeoutError(f"strict collectives: no progress for {limit:.0f} s ({cause}): a deadlock under NCCL's "
                           f"rules (point-to-point completes in the order posted; every rank must issue the "
                           f"same collectives). Pending operations:\n{report}\n"
                           f"Fix the order (batch matching sends and receives in one batch_p2p group) or "
                           f"raise OMNITRON_STRICT_TIMEOUT_S if a peer is only slow.") from None


# ---- NCCL-order point-to-point -----------------------------------------------------------------
HEADER_TAG, PAYLOAD_TAG = 1, 0
"""Headers and payloads are two FIFO streams per peer (gloo matches by peer and tag, in posting order)."""


class _StrictOp:
    """One strict point-to-point op on a host transport (gloo, which runs each operation on its own: a device
    library, which runs a communicator's groups in order, gets :func:`_fused_batch`). A send posts header and
    payload at once; a receive posts its header, and its payload only once the header matched (a payload of the
    wrong size would abort gloo's I/O thread). Waiting on any op of a batch first posts all its payload receives,
    in batch order; waiting twice is a no-op (gloo's works may not be waited twice: a second ``wait`` on a finished
    receive waits for another message).

    A finished op drops its tensors, works and batch (:meth:`_release`): each op and its batch list refer to each
    other, so without that the tensors a pipeline sends and receives would live until Python's cyclic collector
    ran, at no predictable point (memory held past its last use, and a step's peak measured low or 0 when an
    earlier step's buffers were collected inside it)."""

    def __init__(self, batch: list, kind, tensor, wire, peer, where, group) -> None:
        self.batch, self.kind, self.tensor, self.wire, self.peer = batch, kind, tensor, wire, peer
        self.where, self.group, self.done = where, group, False
        self.desc = (f"{kind} {fingerprint(tensor.shape, tensor.dtype)} {'to' if kind == 'send' else 'from'} "
                     f"rank {peer} posted at {where}")
        if kind == "send":
            head = _encode(f"{fingerprint(tensor.shape, tensor.dtype)}\t{where}", tensor.device)
            self.works = dist.batch_isend_irecv([dist.P2POp(dist.isend, head, peer, group, HEADER_TAG),
                                                 dist.P2POp(dist.isend, wire, peer, group, PAYLOAD_TAG)])
            self.head, self.payload = None, self.works[-1]  # one work for both where the backend coalesces
        else:
            self.head = torch.zeros(HEADER_BYTES, dtype=torch.uint8, device=tensor.device)
            self.works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, self.head, peer, group, HEADER_TAG)])
            self.payload = None

    def _post_payload(self) -> None:
        """Receive side: wait for the header, check it, then post the payload receive."""
        if self.payload is not None or self.done:
            return
        timed_wait(self.works[0], lambda: [self.desc], self.group)
        _check_header(self.head, fingerprint(self.tensor.shape, self.tensor.dtype), self.peer, self.where)
        # batched as the send is: NCCL matches a batched send only with a batched receive (an unbatched one runs on
        # the pair's own communicator), and sim checks a pair's unbatched operations against each other
        self.payload = dist.batch_isend_irecv([dist.P2POp(dist.irecv, self.wire, self.peer, self.group,
                                                          PAYLOAD_TAG)])[0]

    def wait(self) -> None:
        if self.done:
            return
        for op in self.batch:  # the batch's payload receives, in batch order, before waiting on anything:
            if op.kind == "recv":  # a peer's send in this same group may need them (a ring exchange)
                op._post_payload()
        if self.kind == "send" and self.works[0] is not self.payload:
            timed_wait(self.works[0], lambda: [self.desc], self.group)
        timed_wait(self.payload, lambda: [self.desc], self.group)
        self.done = True
        self._release()

    def _release(self) -> None:
        """Drop what a finished op holds (its caller keeps the tensors it still needs)."""
        self.batch = self.tensor = self.wire = self.head = self.payload = None
        self.works = ()


class _FusedOp:
    """One strict point-to-point op of a batch posted as one group (``fused``): every op's header and payload,
    received blind and checked once the group has run. ``wait()`` it like a work; waiting twice is a no-op."""

    def __init__(self, kind, want: str, peer, where, group, head) -> None:
        self.kind, self.want, self.peer, self.where, self.group, self.head = kind, want, peer, where, group, head
        self.done, self.works, self.waited = False, (), {}
        self.desc = f"{kind} {want} {'to' if kind == 'send' else 'from'} rank {peer} posted at {where}"

    def wait(self) -> None:
        if self.done:
            return
        for work in self.works:  # this op's header and payload works (one shared work where the backend coalesces)
            if id(work) not in self.waited:
                timed_wait(work, lambda: [self.desc], self.group)
                self.waited[id(work)] = work  # held: an id is unique only while its object lives
        self.done = True
        head, self.head, self.works, self.waited = self.head, None, (), {}
        if self.kind == "recv":
            _check_header(head, self.want, self.peer, self.where)


def _check_header(head: torch.Tensor, want: str, peer: int, where: str) -> None:
    """The sender's header must name the receive's shape and dtype; raise naming both call sites."""
    sent = _decode(head).split("\t")
    if sent[0] != want:
        raise RuntimeError(f"strict p2p: rank {dist.get_rank()} receives {want} from rank {peer} at "
                           f"{where}, but rank {peer} sends {sent[0]} at "
                           f"{sent[1] if len(sent) > 1 else '?'}; sender and receiver must agree on the shape")


def _fused_batch(ops: list, where: str, group) -> list:
    """``ops`` as one group: each op's header then its payload, in op order. A batch then runs as the caller's one
    group would: the library runs a communicator's groups one after another, each until all its operations ran,
    so a batch split in several groups (a send's {header, payload} apart from the receives) deadlocks a symmetric
    exchange there once payloads exceed its buffers. Header beside payload keeps a pair's messages in one order
    however the two ends cut their transfers into batches (NCCL ignores the tags that keep them apart on gloo).
    The payload receives are posted blind: a shape that differs is reported by the header check after the wait
    (or, where the sizes differ too, by the library or the bounded wait)."""
    out, parts = [], []
    for kind, t, wire, peer in ops:
        want = fingerprint(t.shape, t.dtype)
        head = (_encode(f"{want}\t{where}", t.device) if kind == "send"
                else torch.zeros(HEADER_BYTES, dtype=torch.uint8, device=t.device))
        out.append(_FusedOp(kind, want, peer, where, group, head))
        fn = dist.isend if kind == "send" else dist.irecv
        parts += [dist.P2POp(fn, head, peer, group, HEADER_TAG), dist.P2POp(fn, wire, peer, group, PAYLOAD_TAG)]
    works, waited = dist.batch_isend_irecv(parts), {}
    for i, op in enumerate(out):
        op.works = works[:1] if len(works) == 1 else works[2 * i: 2 * i + 2]
        op.waited = waited  # shared: a coalesced work is waited once for the whole batch
    return out


_PENDING: dict[int, tuple] = {}  # id(group) -> (group, [op]) of the last p2p batch


def strict_batch_p2p(ops: list, group, site, fused: bool = False) -> list:
    """Run ``ops`` = ``[(kind, tensor, wire_tensor, peer)]`` as one NCCL-ordered batch; returns one
    handle per op (``wait()`` it like a work).

    The previous batch on ``group`` is waited first (bounded): NCCL runs a communicator's groups in
    the order posted. Each op travels as a header (fingerprint and call site, checked by the receive)
    and its payload. ``fused`` (a library that runs a communicator's groups in order, one after another:
    ``Collectives(p2p_groups_in_order=True)``): the batch is one group (:func:`_fused_batch`). Otherwise (host
    transports, which run each operation on its own and abort on a payload of the wrong size) a payload
    receive is posted once its header was checked (:class:`_StrictOp`).
    """
    prev = _PENDING.pop(id(group), None)
    if prev is not None and prev[0] is group:
        for op in prev[1]:
            op.wait()
    where = format_site(site)
    if fused:
        batch = _fused_batch(ops, where, group)
    else:
        batch = []
        for kind, t, wire, peer in ops:
            batch.append(_StrictOp(batch, kind, t, wire, peer, where, group))
    _PENDING[id(group)] = (group, batch)
    return batch
