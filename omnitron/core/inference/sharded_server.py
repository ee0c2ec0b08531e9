"""``omnitron serve`` under tensor x pipeline parallelism: rank 0 answers HTTP, every rank computes.

Rank 0 runs the same server as one process (:mod:`omnitron.core.inference.server`); each request it has
parsed and accepted is handed to every rank as JSON bytes (a length, then a uint8 payload, broadcast over the
world: nothing is unpickled), and all ranks run :func:`~omnitron.core.inference.text.complete` on their stage
together (:mod:`omnitron.core.inference.sharded`). A request without ``random_seed`` gets one drawn on rank 0,
so every rank samples alike. The other ranks wait for the next message; while the server is idle rank 0
sends a keep-alive every ``keepalive_s`` so that no wait runs into the collective timeout. Shutting down
(Ctrl-C or SIGTERM on rank 0) sends a stop message, and every rank returns.
"""
from __future__ import annotations

import dataclasses
import json
import threading
import time

import torch

from omnitron.core.inference.sampling import SamplingParams
from omnitron.core.inference.sharded import ShardedJob
from omnitron.core.inference.text import complete

KEEPALIVE, STOP = 0, -1
"""Message lengths with no payload: nothing to do / every rank returns."""


class Coordinator:
    """Hands rank 0's requests to every rank of the job (see the module docstring)."""

    def __init__(self, loaded, collectives, *, keepalive_s: float = 60.0) -> None:
        self.loaded, self.coll, self.keepalive_s = loaded, collectives, keepalive_s
        self.device = next(loaded.model.parameters()).device
        self.lock = threading.Lock()
        self._last = time.monotonic()
        self._stopped = threading.Event()

    # ---- rank 0 ----------------------------------------------------------------------------
    def run(self, prompts: list[str], tokens_to_generate: int, *, params: SamplingParams, logprobs: bool = False,
            images=None, **options) -> dict:
        """Compute one accepted request on every rank (call under :attr:`lock`); rank 0's result."""
        if images is not None:
            raise ValueError("images: multimodal checkpoints are served by one process")
        if not params.greedy and params.seed is None:
            params = dataclasses.replace(params, seed=int(torch.randint(0, 2**31 - 1, (1,))))
        request = {"prompts": prompts, "tokens_to_generate": tokens_to_generate, "logprobs": logprobs,
                   "params": dataclasses.asdict(params), "options": options}
        self._send(json.dumps(request).encode())
        return _compute(self.loaded, request)

    def keep_alive(self) -> None:
        """Rank 0's daemon loop: a keep-alive message whenever nothing was sent for ``keepalive_s``."""
        while not self._stopped.wait(self.keepalive_s / 4):
            if time.monotonic() - self._last >= self.keepalive_s and self.lock.acquire(blocking=False):
                try:
                    if not self._stopped.is_set():
                        self._length(KEEPALIVE)
                finally:
                    self.lock.release()

    def stop(self) -> None:
        """Tell every rank to return (rank 0, once, after the server stopped)."""
        with self.lock:
            if not self._stopped.is_set():
                self._stopped.set()
                self._length(STOP)

    def _send(self, payload: bytes) -> None:
        self._length(len(payload))
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        self.coll.broadcast(data, src=0)

    def _length(self, n: int) -> None:
        self.coll.broadcast(torch.tensor([n], dtype=torch.int64, device=self.device), src=0)
        self._last = time.monotonic()

    # ---- the other ranks ------------------------------------------------------------------
    def follow(self) -> None:
        """Compute every request rank 0 sends, until it sends the stop message."""
        while True:
            n = torch.zeros(1, dtype=torch.int64, device=self.device)
            self.coll.broadcast(n, src=0)
            n = int(n.item())
            if n == STOP:
                return
            if n == KEEPALIVE:
                continue
            data = torch.zeros(n, dtype=torch.uint8, device=self.device)
            self.coll.broadcast(data, src=0)
            try:
                _compute(self.loaded, json.loads(bytes(data.cpu().numpy())))
            except ValueError:  # rank 0 raises the same and answers 400
                pass


def _compute(loaded, request: dict) -> dict:
    return complete(loaded, request["prompts"], request["tokens_to_generate"],
                    params=SamplingParams(**request["params"]), logprobs=request["logprobs"], **request["options"])


@dataclasses.dataclass
class ServeJob(ShardedJob):
    """``omnitron serve`` under tp x pp."""

    host: str = "127.0.0.1"
    port: int = 5000


def run_serve_job(job: ServeJob, backend, watchdog=None) -> None:
    """One rank of a sharded ``omnitron serve``: rank 0 serves HTTP until stopped, the others follow."""
    import signal

    from omnitron.core.inference.server import make_server, serve_until_stopped

    groups, loaded = job.load_stage(backend)
    coord = Coordinator(loaded, backend.collectives)
    if groups.rank != 0:
        # NOTE: a launcher's SIGTERM reaches every rank, a terminal's Ctrl-C too: the others wait for rank 0's
        # stop message (a dead rank 0 is caught by the watchdog)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        coord.follow()
        return
    server = make_server(loaded, job.host, job.port, run=coord.run, lock=coord.lock)
    print(f"serving {loaded.family} checkpoint {job.load} at tp {groups.tp.size} x pp {groups.pp.size}"
          f"{f' x ep {groups.ep.size}' if groups.ep.size > 1 else ''} on "
          f"http://{job.host}:{server.server_port}/api (PUT)", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)  # the launcher forwards SIGTERM: stop as on Ctrl-C
    threading.Thread(target=coord.keep_alive, daemon=True).start()
    serve_until_stopped(server, coord.stop)


def _interrupt(*_) -> None:
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the stop message must go out undisturbed
    raise KeyboardInterrupt
