"""Checkpoint -> one process (any layout), ``omnitron generate`` and ``omnitron serve`` against the library call."""
from __future__ import annotations

import contextlib
import io
import json
import threading
import urllib.error
import urllib.request

import pytest
import torch

from omnitron.backends import get_backend
from omnitron.cli import main
from omnitron.core.checkpoint.hf import write_weights_checkpoint
from omnitron.core.checkpoint.reshard import Layout
from omnitron.core.inference import SamplingParams, generate_batch
from omnitron.core.inference.loader import load_for_inference
from omnitron.core.inference.server import make_server
from omnitron.core.inference.text import complete
from omnitron.core.models.gpt.presets import llama_tiny
from omnitron.core.models.gpt.model import GPTModel
from omnitron.core.models.gpt.state import gather_full_state
from omnitron.core.parallel.groups import ParallelGroups

NULL = {"tokenizer_type": "NullTokenizer", "vocab_size": 300, "seed": 7}


@pytest.fixture(scope="module")
def gpt_ckpt(tmp_path_factory):
    """A Llama-style GQA model (vocab 301 = NullTokenizer(300)) saved as a tp2 x pp2 checkpoint."""
    cfg = llama_tiny(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=301,
                     seq_length=32)
    model = GPTModel(cfg, ParallelGroups.single(), backend=get_backend("cpu"), seed=5).eval()
    path = str(tmp_path_factory.mktemp("gpt"))
    write_weights_checkpoint(gather_full_state(model, ParallelGroups.single()), cfg, path, Layout(tp=2, pp=2),
                             config=NULL)
    return model, path


def test_loader_reassembles_any_layout(gpt_ckpt):
    model, path = gpt_ckpt
    loaded = load_for_inference(path, get_backend("cpu"))
    assert loaded.family == "gpt" and loaded.seed == 7 and loaded.tokenizer.vocab_size == 301
    ids = torch.randint(0, 301, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(tokens=ids), model(tokens=ids), atol=1e-5, rtol=1e-5)


def _cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def test_generate_command_matches_library(gpt_ckpt):
    model, path = gpt_ckpt
    rc, out, _ = _cli("generate", "--load", path, "--prompt", "5 6 7", "--prompt", "9", "--max-new-tokens", "6",
                      "--top-k", "1", "--return-log-probs", "--json", "--backend", "cpu")
    assert rc == 0
    got = json.loads(out)
    lib = generate_batch(model, [[5, 6, 7], [9]], 6, eod=300, return_log_probs=True)
    assert got["text"] == [" ".join(map(str, p + [t for t in n if t != 300])) for p, n in zip([[5, 6, 7], [9]],
                                                                                             lib.tokens)]
    assert len(got["segments"][0]) == 3 + len(lib.tokens[0]) and len(got["logprobs"][0]) == 2 + len(lib.tokens[0])
    torch.testing.assert_close(torch.tensor(got["logprobs"][1]), torch.tensor(lib.log_probs[1]), atol=1e-5, rtol=0)
    # sampling defaults to the checkpoint's seed (7): same as the library with seed 7
    rc, out, _ = _cli("generate", "--load", path, "--prompt", "3 4", "--max-new-tokens", "5", "--json")
    lib = generate_batch(model, [[3, 4]], 5, eod=300, params=SamplingParams(temperature=0.8, top_k=20, seed=7))
    assert json.loads(out)["text"] == [" ".join(map(str, [3, 4] + [t for t in lib.tokens[0] if t != 300]))]
    # --top-p alone turns the default --top-k 20 off (the library refuses the pair, as Megatron's); both given: one line
    rc, out, _ = _cli("generate", "--load", path, "--prompt", "3 4", "--max-new-tokens", "5", "--top-p", "0.8",
                      "--json")
    lib = generate_batch(model, [[3, 4]], 5, eod=300, params=SamplingParams(temperature=0.8, top_p=0.8, seed=7))
    assert rc == 0 and json.loads(out)["text"] == [" ".join(map(str, [3, 4] + [t for t in lib.tokens[0] if t != 300]))]
    rc, _, err = _cli("generate", "--load", path, "--prompt", "3", "--top-k", "5", "--top-p", "0.8")
    assert rc == 2 and "--top-k 5 and --top-p 0.8 together" in err and len(err.strip().splitlines()) == 1
    rc, _, err = _cli("generate", "--load", path, "--prompt", "3", "--image-index", "0")
    assert rc == 2 and "--image-index / --image apply to multimodal checkpoints; this one is gpt" in err
    rc, _, err = _cli("generate", "--load", path + "/nothing", "--prompt", "3")
    assert rc == 2 and "no checkpoint there" in err


def _put(port: int, body, path="/api"):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method="PUT",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_server_answers_like_the_library(gpt_ckpt):
    _, path = gpt_ckpt
    loaded = load_for_inference(path, get_backend("cpu"))
    server = make_server(loaded, port=0, quiet=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_port
        body = {"prompts": ["1 2 3", "8"], "tokens_to_generate": 5, "temperature": 0.7, "top_p": 0.9,
                "random_seed": 3}
        code, got = _put(port, body)
        params = SamplingParams(temperature=0.7, top_p=0.9, seed=3)
        assert code == 200 and got == complete(loaded, ["1 2 3", "8"], 5, params=params)
        code, got = _put(port, {"prompts": ["4 5"], "tokens_to_generate": 3, "top_k": 1, "logprobs": True})
        want = complete(loaded, ["4 5"], 3, params=SamplingParams(top_k=1), logprobs=True)
        assert code == 200 and set(got) == {"text", "segments", "logprobs"} and got == want
        code, got = _put(port, {"prompts": ["1 2 3"], "tokens_to_generate": 0, "logprobs": True})  # scoring only
        assert code == 200 and got["text"] == ["1 2 3"] and len(got["logprobs"][0]) == 2
        for bad, words in (({"prompts": "1 2"}, "prompts must be a non-empty list of strings"),
                           ({"prompts": ["1"], "top_p": 2}, "top_p must be a number in [0, 1]"),
                           ({"prompts": ["1"], "top_k": 5, "top_p": 0.9}, "top_k and top_p together"),
                           ({"prompts": ["1"], "top_k": "x", "top_p": "y"}, "top_k must be an integer"),
                           ({"prompts": ["1"], "tokens_to_generate": -1}, "tokens_to_generate must be an integer"),
                           ({"prompts": ["1"], "tokens_to_generate": 0}, "nothing to return"),
                           ({"prompts": ["1"], "temprature": 1}, "unknown field(s) temprature"),
                           ({"prompts": ["1"], "random_seed": "x"}, "random_seed must be"),
                           ({"prompts": ["1"], "image_index": [0]}, "image_index applies to multimodal"),
                           ({"prompts": ["1 x"]}, "space-separated integers"),
                           ({"prompts": [""]}, "encodes to no tokens"),
                           (b"{not json", "the body is not JSON")):
            code, got = _put(port, bad)
            assert code == 400 and words in got["error"], (bad, got)
        assert _put(port, body, path="/other")[0] == 404
    finally:
        server.shutdown()
        server.server_close()


def test_a_prompt_near_the_context_gets_the_room_left_with_one_line(gpt_ckpt):
    """``omnitron generate`` and the server, a prompt two positions short of the model's context and 6 tokens
    asked: it gets 2 (the library's greedy tokens, stopped where the context is full), and one line says so: the
    command's on stderr, the server's in the answer's ``warnings`` (before: 2 tokens and no word). A prompt with room
    enough gets no line."""
    from omnitron.core.inference.generation import context_limit

    _, path = gpt_ckpt
    loaded = load_for_inference(path, get_backend("cpu"))
    limit = context_limit(loaded.model)
    ids = torch.randint(0, 300, (limit - 2,)).tolist()
    prompt = " ".join(map(str, ids))
    lib = generate_batch(loaded.model, [ids], limit, eod=300)  # the context stops it: its 2 tokens (or fewer at EOD)
    text = " ".join(map(str, ids + [t for t in lib.tokens[0] if t != 300]))
    line = (f"the model's context is {limit} positions (--max-position-embeddings): prompt 0 takes {limit - 2} of "
            "them, leaving room for 2 of the 6 new tokens asked; generating that many (shorten the prompt or ask "
            "for fewer tokens)")
    rc, out, err = _cli("generate", "--load", path, "--prompt", prompt, "--max-new-tokens", "6", "--top-k", "1",
                        "--json", "--backend", "cpu")
    assert rc == 0 and err.strip().splitlines() == [f"omnitron generate: warning: {line}"], err
    assert json.loads(out) == {"text": [text], "warnings": [line]}
    server = make_server(loaded, port=0, quiet=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        code, got = _put(server.server_port, {"prompts": [prompt], "tokens_to_generate": 6, "top_k": 1})
        assert code == 200 and got == {"text": [text], "warnings": [line]}, got
        code, got = _put(server.server_port, {"prompts": ["1 2"], "tokens_to_generate": 6, "top_k": 1})
        assert code == 200 and set(got) == {"text"}, got
    finally:
        server.shutdown()
        server.server_close()


def test_generate_command_t5_and_llava_caption(tmp_path):
    from omnitron.core.inference.families import caption, generate_t5
    from omnitron.core.inference.text import synthetic_image
    from omnitron.core.models.multimodal import LLaVAModel
    from omnitron.core.models.multimodal.config import llava_tiny
    from omnitron.core.models.t5 import T5Model
    from omnitron.core.models.t5.config import t5_tiny

    single, cpu = ParallelGroups.single(), get_backend("cpu")
    # NOTE: num_layers = encoder + decoder layers keeps clear of a layer-range check in init_single_stage
    t5 = T5Model(t5_tiny(num_layers=2, encoder_num_layers=1, decoder_num_layers=1, hidden_size=32,
                         ffn_hidden_size=64, num_query_groups=2), single, backend=cpu, seed=2).eval()
    write_weights_checkpoint(gather_full_state(t5, single), t5.config, str(tmp_path / "t5"), Layout(tp=2),
                             config={"tokenizer_type": "BertWordPieceLowerCase"})
    rc, out, _ = _cli("generate", "--load", str(tmp_path / "t5"), "--prompt", "call me ishmael", "--top-k", "1",
                      "--max-new-tokens", "5", "--json")
    tok = load_for_inference(str(tmp_path / "t5"), cpu).tokenizer
    lib = generate_t5(t5, [tok.encode("call me ishmael")], 5, start=tok.cls, eod=tok.sep).tokens[0]
    assert rc == 0 and json.loads(out)["text"] == [tok.decode([t for t in lib if t != tok.sep])]

    llava = LLaVAModel(llava_tiny(hidden_size=32, ffn_hidden_size=64, vision_hidden_size=32, img_h=16, img_w=16),
                       single, backend=cpu, seed=3).eval()
    write_weights_checkpoint(gather_full_state(llava, single), llava.config, str(tmp_path / "mm"), Layout(tp=2),
                             config={"seed": 9})
    loaded = load_for_inference(str(tmp_path / "mm"), cpu)
    rc, out, _ = _cli("generate", "--load", str(tmp_path / "mm"), "--image-index", "2", "--top-k", "1",
                      "--max-new-tokens", "4")
    image, truth = synthetic_image(loaded, 2)
    prompt = loaded.tokenizer.encode("a")
    lib = caption(llava, image[None], [prompt], 4, eod=loaded.tokenizer.eod).tokens[0]
    text = loaded.tokenizer.decode(prompt + [t for t in lib if t != loaded.tokenizer.eod])
    assert rc == 0 and out == f"--- 0 ---\n{text}\n--- true caption ---\n{truth}\n"
    rc, _, err = _cli("generate", "--load", str(tmp_path / "mm"), "--prompt", "a")
    assert rc == 2 and "pass --image-index N or --image FILE.npy" in err


def test_server_survives_slow_loris_oversized_and_20_concurrent_clients(gpt_ckpt):
    """A client that sends half a request and stalls, and one announcing a 10 MB body, block nobody:
    20 concurrent clients all get the library's answer; the stalled one gets 408 and is closed
    after the socket timeout; the oversized one gets 413 at once (the body is never read)."""
    import socket
    import time

    _, path = gpt_ckpt
    loaded = load_for_inference(path, get_backend("cpu"))
    server = make_server(loaded, port=0, quiet=True, timeout_s=3)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_port
    loris = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        loris.sendall(b"PUT /api HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompts\"")  # then silence
        started = time.monotonic()
        big = socket.create_connection(("127.0.0.1", port), timeout=30)
        big.sendall(b"PUT /api HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n\r\n")
        head = b""
        while chunk := big.recv(4096):  # headers and body may arrive apart; HTTP/1.0: closed after the answer
            head += chunk
        head = head.decode()
        big.close()
        assert head.startswith("HTTP/1.0 413") and "at most 1048576 per request" in head, head
        bodies = [{"prompts": [f"{i} {i + 1}"], "tokens_to_generate": 3, "random_seed": i} for i in range(20)]
        results = [None] * 20

        def client(i):
            results[i] = _put(port, bodies[i])

        threads = [threading.Thread(target=client, args=(i,)) for i in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for i, body in enumerate(bodies):
            want = complete(loaded, body["prompts"], 3, params=SamplingParams(seed=i))
            assert results[i] == (200, want), (i, results[i])
        reply = loris.recv(4096)  # the server gives up on the stalled body after its timeout
        waited = time.monotonic() - started
        while chunk := loris.recv(4096):  # the body may follow the headers apart; closed after the answer
            reply += chunk
        reply = reply.decode()
        assert reply.startswith("HTTP/1.0 408") and "did not arrive within 3 s" in reply, reply
        assert 2.5 < waited < 60, waited  # the 3 s per-read timeout, plus the 20 requests' compute under contention
    finally:
        loris.close()
        server.shutdown()
        server.server_close()


class _NewlineAt:
    """The checkpoint's tokenizer, except that token ``t`` reads as a line end."""

    def __init__(self, tok, t):
        self._tok, self.t = tok, t

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def decode(self, ids):
        return "".join("\n" if i == self.t else self._tok.decode([i]) for i in ids)


def test_server_add_bos_and_stop_on_eol_as_megatron(gpt_ckpt):
    """add_BOS: the end-of-document token leads each prompt (left out of the text); stop_on_eol: a row ends at
    its first line-ending token. Both against the library's greedy continuation."""
    import dataclasses

    model, path = gpt_ckpt
    loaded = load_for_inference(path, get_backend("cpu"))
    greedy = SamplingParams(top_k=1)
    bos = generate_batch(model, [[300, 4, 5]], 6, eod=300).tokens[0]
    got = complete(loaded, ["4 5"], 6, params=greedy, add_bos=True)
    assert got["text"] == [" ".join(map(str, [4, 5] + [t for t in bos if t != 300]))]
    plain = generate_batch(model, [[4, 5]], 8, eod=300).tokens[0]
    t = plain[2]  # the third generated token becomes a line end: generation stops at its first appearance
    eol = dataclasses.replace(loaded, tokenizer=_NewlineAt(loaded.tokenizer, t))
    server = make_server(eol, port=0, quiet=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        code, got = _put(server.server_port, {"prompts": ["4 5"], "tokens_to_generate": 8, "top_k": 1,
                                              "stop_on_eol": True, "logprobs": True})
        assert code == 200 and len(got["logprobs"][0]) == 1 + plain.index(t) + 1
        code, got = _put(server.server_port, {"prompts": ["4 5"], "stop_on_eol": "yes"})
        assert code == 400 and "stop_on_eol must be true or false" in got["error"]
    finally:
        server.shutdown()
        server.server_close()


def test_server_names_the_field_of_every_bad_request_and_tiny_temperatures_are_greedy(gpt_ckpt):
    """Out-of-range seeds, JSON nested past any field's depth (in a field or the whole body: before, the
    parser's RecursionError closed the connection unanswered), wrong types: 400 naming the field. Temperatures
    down to 1e-320 (inside the documented range) answer the greedy continuation, ids inside the tokenizer's
    vocabulary (before, a vocabulary-padding column's id)."""
    _, path = gpt_ckpt
    loaded = load_for_inference(path, get_backend("cpu"))
    server = make_server(loaded, port=0, quiet=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_port
        deep = b'{"prompts": ["1"], "temperature": ' + b"[" * 100000 + b"]" * 100000 + b"}"
        for bad, field in (({"prompts": ["1"], "random_seed": 2**80}, "random_seed must be an integer in [0, 2**63)"),
                           ({"prompts": ["1"], "random_seed": -1}, "random_seed must be"),
                           (deep, "temperature: JSON nested deeper than"),
                           (b"[" * 5000 + b"]" * 5000, "the body: JSON nested deeper than"),
                           ({"prompts": [["1"] * 3]}, "prompts must be"),
                           ({"prompts": ["1"], "temperature": [[[[1.0]]]]}, "temperature must be a number"),
                           ({"prompts": ["1"], "top_k": 1.5}, "top_k must be an integer"),
                           ({"prompts": ["1"], "logprobs": "yes"}, "logprobs must be true or false"),
                           ({"prompts": ["1 " * 40]}, "prompts: generate: prompt 0 has 40 tokens"),
                           (b"\xff\xfe", "the body is not UTF-8 JSON")):
            code, got = _put(port, bad)
            assert code == 400 and got["error"].startswith(field) and len(got["error"]) < 300, (bad, got)
        assert _put(port, {"prompts": ["1"], "random_seed": 2**63 - 1, "tokens_to_generate": 1})[0] == 200
        greedy = complete(loaded, ["1 2", "7"], 8, params=SamplingParams(top_k=1))
        for t in (1e-320, 1e-300, 1e-45):
            code, got = _put(port, {"prompts": ["1 2", "7"], "tokens_to_generate": 8, "temperature": t,
                                    "random_seed": 5})
            ids = [int(w) for text in got["text"] for w in text.split()]
            assert code == 200 and got == greedy and max(ids) < loaded.tokenizer.vocab_size, (t, got)
    finally:
        server.shutdown()
        server.server_close()


def test_a_malformed_body_is_refused_in_one_pass():
    """The nesting pre-scan reads an unterminated string to the end once. It matched a full string from every
    quote, so `{"prompts": ["` and N escaped quotes cost O(N^2): 38 s for 80 KB, an hour at the 1 MiB body
    limit, with every other client waiting. Bound: the 1 MiB body's linear scan and JSON error take
    ~0.1 s on this 2-core machine; 10 s leaves a 100x margin for a loaded CI machine and still fails the
    quadratic scan by more than 300x. An integer of more digits than Python converts is "not JSON" too, not an
    error about prompts."""
    import time

    from omnitron.core.inference.server import MAX_BODY_BYTES, BadRequest, parse_body

    n = (MAX_BODY_BYTES - 16) // 2
    start = time.perf_counter()
    with pytest.raises(BadRequest, match="the body is not JSON: Unterminated string"):
        parse_body(b'{"prompts": ["' + b'\\"' * n)
    assert time.perf_counter() - start < 10.0
    with pytest.raises(BadRequest, match="the body is not JSON: Exceeds the limit"):
        parse_body(b'{"prompts": ["a"], "tokens_to_generate": ' + b"9" * 5000 + b"}")


def test_chunked_bodies_are_read_and_their_limit_kept(gpt_ckpt):
    """A client that streams its body (``Transfer-Encoding: chunked``, as curl does for stdin and http.client
    for an iterable) gets the same answer as one sending a Content-Length; the server used to read such a
    body as empty ("prompts must be..."). Chunk sizes past the limit are refused (413) before their bytes
    are read; malformed framing and another transfer coding are 400."""
    import http.client

    from omnitron.core.inference.server import BadRequest, read_body

    _, path = gpt_ckpt
    loaded = load_for_inference(path, get_backend("cpu"))
    server = make_server(loaded, port=0, quiet=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    body = {"prompts": ["3 4 5"], "tokens_to_generate": 4, "top_k": 1}
    data = json.dumps(body).encode()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.server_port, timeout=30)
        conn.request("PUT", "/api", body=iter([data[:7], data[7:20], data[20:]]), encode_chunked=True,
                     headers={"Transfer-Encoding": "chunked"})
        reply = conn.getresponse()
        assert reply.status == 200 and json.loads(reply.read()) == _put(server.server_port, body)[1]
        conn.close()
    finally:
        server.shutdown()
        server.server_close()

    def headers(**h):
        return {k.replace("_", "-"): v for k, v in h.items()}

    chunked = headers(Transfer_Encoding="chunked")
    wire = b"7;ext=1\r\n" + data[:7] + b"\r\n" + hex(len(data) - 7)[2:].encode() + b"\r\n" + data[7:] + b"\r\n0\r\n"
    assert read_body(io.BytesIO(wire + b"X-Trailer: 1\r\n\r\n"), chunked, 1 << 20) == data
    with pytest.raises(BadRequest, match="passes 64 bytes"):
        read_body(io.BytesIO(b"41\r\n"), chunked, 64)  # 65 announced, none sent: refused before reading
    for wire, words in ((b"zz\r\n", "malformed chunk size"), (b"5\r\nab", "ended early"),
                        (b"2\r\nabcd\r\n0\r\n\r\n", "longer than its size line")):
        with pytest.raises(BadRequest, match=words):
            read_body(io.BytesIO(wire), chunked, 1 << 20)
    with pytest.raises(BadRequest, match="Transfer-Encoding 'gzip' is not supported"):
        read_body(io.BytesIO(b""), headers(Transfer_Encoding="gzip"), 1 << 20)
