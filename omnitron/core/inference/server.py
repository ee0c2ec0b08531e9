"""A small HTTP text-generation server on the standard library, with Megatron's API shape.

``PUT /api`` with a JSON body::

    {"prompts": ["..."], "tokens_to_generate": 32, "temperature": 1.0, "top_k": 0, "top_p": 0.0,
     "logprobs": false, "random_seed": 1234, "image_index": [0], "add_BOS": false, "stop_on_eol": false}

answers ``{"text": [...]}`` (plus ``"segments"`` and ``"logprobs"`` when ``logprobs`` is true, and ``"warnings"``,
one line, when a prompt leaves the model's context room for fewer tokens than asked: it gets the room left, as
Megatron's serving engine clamps; see :func:`omnitron.core.inference.text.complete`). Defaults follow Megatron's
server: temperature 1,
no top-k / top-p filter (plain sampling), 64 tokens. ``image_index`` (multimodal checkpoints only):
one synthetic validation image per prompt. ``add_BOS`` and ``stop_on_eol`` (GPT checkpoints): Megatron's
options, see :func:`omnitron.core.inference.text.complete_gpt`. A malformed request gets 400 with ``{"error": message}``
naming the field (also a body nested deeper than :data:`MAX_DEPTH`, found before the parser recurses); an
internal fault 500; another path 404. Connections are served on their own (daemon) threads, each with
a socket timeout (a silent or trickling client gets 408 and is closed without blocking anyone); a
body over the size limit is refused with 413 from its Content-Length (or, chunked, as the chunk sizes pass it),
before it is read; model
calls take one lock (one model, one KV cache), so requests are computed one at a time.
"""
from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from omnitron.core.inference.sampling import SamplingParams, short_repr
from omnitron.core.inference.text import complete, synthetic_image

MAX_PROMPTS = 128
MAX_BODY_BYTES = 1 << 20  # 1 MiB of JSON: far more prompt text than a model's context holds
TIMEOUT_S = 30.0  # per socket read / write of one connection
BACKLOG = 128  # pending connections the kernel queues (http.server's default is 5)
FIELDS = {"prompts", "tokens_to_generate", "temperature", "top_k", "top_p", "logprobs", "random_seed", "image_index",
          "add_BOS", "stop_on_eol"}
GPT_ONLY = ("add_BOS", "stop_on_eol")  # Megatron's options of text continuation


MAX_DEPTH = 32
"""JSON nesting a body may have (no field needs more than 2): deeper is refused, naming the field, before
the parser's recursion limit would end the connection without an answer."""


class BadRequest(ValueError):
    """A request the server refuses with 400 (the message names the field and what it must be)."""


def _int(body: dict, key: str, default: int, low: int) -> int:
    v = body.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise BadRequest(f"{key} must be an integer >= {low}, got {short_repr(v)}")
    return v


_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"?|[\[\]{}:]')
"""A string (to its closing quote, or to the end of an unterminated one: a body of ``\\"`` pairs after one quote
then costs one pass, not one per quote, which was quadratic: 38 s for 80 KB), or a bracket, brace or colon."""


def _too_deep(text: str, limit: int = MAX_DEPTH) -> str | None:
    """The top-level field whose value nests deeper than ``limit`` ("the body" when not in a field), else None."""
    depth, key, last = 0, None, None
    for m in _JSON_TOKEN.finditer(text):
        tok = m.group()
        if tok == "[" or tok == "{":
            depth += 1
            if depth > limit:
                return key or "the body"
        elif tok == "]" or tok == "}":
            depth -= 1
        elif tok == ":" and depth == 1 and last:
            key = last[1:-1][:60]  # the field's name as written (escapes left as they are)
        last = tok if tok.startswith('"') else None
    return None


def parse_body(raw: bytes):
    """The request's JSON value; BadRequest when it is not JSON or nests deeper than MAX_DEPTH."""
    try:
        text = raw.decode("utf-8") if raw else "null"
    except UnicodeDecodeError as err:
        raise BadRequest(f"the body is not UTF-8 JSON: {err}") from None
    field = _too_deep(text)
    if field is not None:
        raise BadRequest(f"{field}: JSON nested deeper than {MAX_DEPTH} levels; no field takes more than 2")
    try:
        return json.loads(text)
    except ValueError as err:  # JSONDecodeError, and an integer of more digits than Python converts
        raise BadRequest(f"the body is not JSON: {err}") from None


def _library_field(message: str) -> str:
    """The request field a library ValueError is about (its message names prompts, images or the seed)."""
    for word, field in (("image", "image_index"), ("seed", "random_seed"), ("prompt", "prompts"),
                        ("source", "prompts"), ("token", "prompts")):
        if word in message:
            return field
    return "prompts"


def parse_request(body, loaded) -> dict:
    """The keyword arguments of :func:`complete` for one request body; :class:`BadRequest` if malformed."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object with at least \"prompts\"")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(FIELDS))}")
    prompts = body.get("prompts")
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise BadRequest("prompts must be a non-empty list of strings")
    if len(prompts) > MAX_PROMPTS:
        raise BadRequest(f"prompts holds {len(prompts)} prompts; at most {MAX_PROMPTS} per request")
    n = _int(body, "tokens_to_generate", 64, 0)
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, bool):
        raise BadRequest(f"logprobs must be true or false, got {logprobs!r}")
    if n == 0 and not logprobs:
        raise BadRequest("tokens_to_generate is 0 and logprobs is false: nothing to return; generate tokens or "
                         "ask for the prompts' logprobs")
    seed = body.get("random_seed")
    try:  # each value's type and range, then top_k with top_p (refused, as Megatron's server does)
        params = SamplingParams(temperature=body.get("temperature", 1.0), top_k=body.get("top_k", 0),
                                top_p=body.get("top_p", 0.0), seed=None if seed is None else seed)
    except ValueError as err:
        raise BadRequest(str(err).replace("seed must", "random_seed must")) from None
    out = {"prompts": prompts, "tokens_to_generate": n, "params": params, "logprobs": logprobs,
           "images": _images(body.get("image_index"), len(prompts), loaded)}
    for key in GPT_ONLY:
        if key not in body:
            continue
        if not isinstance(body[key], bool):
            raise BadRequest(f"{key} must be true or false, got {short_repr(body[key])}")
        if loaded.family != "gpt":
            raise BadRequest(f"{key} applies to GPT checkpoints (text continuation); this one is {loaded.family}")
        out["add_bos" if key == "add_BOS" else key] = body[key]
    return out


def _images(index, count: int, loaded) -> torch.Tensor | None:
    if not loaded.spec.takes_images:
        if index is not None:
            raise BadRequest(f"image_index applies to multimodal checkpoints; this one is {loaded.family}")
        return None
    if not isinstance(index, list) or len(index) != count:
        raise BadRequest(f"image_index must list one synthetic image index per prompt ({count}) for this "
                         "multimodal checkpoint")
    try:
        return torch.stack([synthetic_image(loaded, i)[0] for i in index])
    except ValueError as err:
        raise BadRequest(f"image_index: {err}") from None


def _body_length(headers, limit: int) -> int:
    """The request's Content-Length; BadRequest (400) when malformed, _TooLarge (413) over ``limit``."""
    raw = headers.get("Content-Length")
    try:
        n = int(raw) if raw is not None else 0
    except ValueError:
        n = -1
    if n < 0:
        raise BadRequest(f"Content-Length {raw!r} is not a byte count")
    if n > limit:
        raise _TooLarge(f"the body is {n} bytes; at most {limit} per request: send fewer or shorter prompts")
    return n


class _TooLarge(BadRequest):
    """A body over the size limit (413, refused unread)."""


_HEX = re.compile(rb"[0-9a-fA-F]{1,16}")


def _chunked_body(rfile, limit: int) -> bytes:
    """A ``Transfer-Encoding: chunked`` body (RFC 9112 7.1): hex-sized chunks, extensions and trailers ignored;
    _TooLarge as soon as the sizes announced pass ``limit`` (before those bytes are read), BadRequest when the
    framing is malformed or the stream ends early."""
    body = bytearray()
    while True:
        line = rfile.readline(1026)  # a size line: hex digits, optional ";ext", CRLF
        size_text = line.split(b";", 1)[0].strip()
        if not _HEX.fullmatch(size_text):
            raise BadRequest(f"the chunked body has a malformed chunk size line {short_repr(line[:40])}")
        size = int(size_text, 16)
        if size == 0:
            break
        if len(body) + size > limit:
            raise _TooLarge(f"the chunked body passes {limit} bytes; at most {limit} per request: send fewer or "
                            "shorter prompts")
        data = rfile.read(size)
        if len(data) < size or rfile.readline(3) not in (b"\r\n", b"\n"):
            raise BadRequest("the chunked body ended early or a chunk is longer than its size line says")
        body += data
    for _ in range(64):  # trailer fields, then the empty line that ends the message
        if rfile.readline(8194) in (b"\r\n", b"\n", b""):
            break
    return bytes(body)


def read_body(rfile, headers, limit: int) -> bytes:
    """The request body, framed by ``Transfer-Encoding: chunked`` (which wins over a Content-Length, as HTTP/1.1
    says) or by Content-Length; another transfer coding is refused (400)."""
    coding = headers.get("Transfer-Encoding")
    if coding is None:
        return rfile.read(_body_length(headers, limit))
    if coding.strip().lower() != "chunked":
        raise BadRequest(f"Transfer-Encoding {coding!r} is not supported; send the body plain (Content-Length) "
                         "or chunked")
    return _chunked_body(rfile, limit)


def make_handler(loaded, lock: threading.Lock, *, timeout_s: float = TIMEOUT_S, max_body_bytes: int = MAX_BODY_BYTES,
                 run=None):
    """The request handler class bound to one loaded model (``timeout_s``: per socket operation). ``run``
    computes a parsed request (default: :func:`complete` in this process; a sharded job's coordinator first
    hands it to every rank)."""
    run = run or (lambda prompts, n, **kw: complete(loaded, prompts, n, **kw))

    class Handler(BaseHTTPRequestHandler):
        timeout = timeout_s  # StreamRequestHandler sets it on the connection's socket

        def _reply(self, code: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_PUT(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path.rstrip("/") != "/api":
                return self._reply(404, {"error": f"no endpoint {self.path}; PUT /api"})
            try:
                kwargs = parse_request(parse_body(read_body(self.rfile, self.headers, max_body_bytes)), loaded)
                prompts = kwargs.pop("prompts")
                with lock:
                    result = run(prompts, kwargs.pop("tokens_to_generate"), **kwargs)
            except _TooLarge as err:
                self.close_connection = True  # the unread body must not be parsed as the next request
                return self._reply(413, {"error": str(err)})
            except BadRequest as err:
                if "Transfer-Encoding" in self.headers:  # a chunked body may be left part-read
                    self.close_connection = True
                return self._reply(400, {"error": str(err)})
            except ValueError as err:  # the library's own input checks: name the field they are about
                return self._reply(400, {"error": f"{_library_field(str(err))}: {err}"})
            except TimeoutError:  # the body stopped arriving: free this thread
                self.close_connection = True
                return self._reply(408, {"error": f"the request body did not arrive within {timeout_s:g} s"})
            except Exception as err:  # noqa: BLE001 - a fault of the server, not of the request: still an answer
                self.log_error("internal error: %r", err)
                return self._reply(500, {"error": f"internal error: {type(err).__name__}: {str(err)[:200]}"})
            for line in result.get("warnings", ()):
                self.log_message("warning: %s", line)
            return self._reply(200, result)

        def do_POST(self) -> None:  # noqa: N802
            self._reply(405, {"error": "use PUT /api (Megatron's text generation server API)"})

        do_GET = do_POST

        def log_message(self, fmt, *args) -> None:  # one line per request on stderr, as http.server does
            if not getattr(self.server, "quiet", False):
                super().log_message(fmt, *args)

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a stuck connection never keeps the process alive
    block_on_close = False  # server_close() does not wait for connection threads
    request_queue_size = BACKLOG


def make_server(loaded, host: str = "127.0.0.1", port: int = 5000, *, quiet: bool = False,
                timeout_s: float = TIMEOUT_S, max_body_bytes: int = MAX_BODY_BYTES, run=None,
                lock: threading.Lock | None = None) -> ThreadingHTTPServer:
    """An unstarted server (``serve_forever()`` to run; port 0 picks a free one: ``server.server_port``);
    ``run`` and ``lock``: see :func:`make_handler` (a sharded job's coordinator passes its own)."""
    server = _Server((host, port), make_handler(loaded, lock or threading.Lock(), timeout_s=timeout_s,
                                                max_body_bytes=max_body_bytes, run=run))
    server.quiet = quiet
    return server


def serve_until_stopped(server: ThreadingHTTPServer, on_stop=None) -> None:
    """``serve_forever`` until Ctrl-C (KeyboardInterrupt), then close the socket and call ``on_stop``."""
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        if on_stop is not None:
            on_stop()
