"""Streaming preprocessing: JSONL or text files -> one MMIDIDX dataset per JSON key.

The input is read line by line (never whole); documents are tokenized in chunks, by worker
processes when ``workers > 1`` (results are written in input order, so the output does not
depend on the number of workers). Bad records are counted and skipped, never fatal:
invalid UTF-8 (replaced or skipped), lines that are not JSON objects, records without a
requested key (a key's value is a string, or a list of strings: the document's sentences, each its
own sequence, as Megatron's encoder reads it). Empty documents are kept as Megatron keeps them (a
document of no sequences in the ``.idx``). Input with no token at all is an error.

``split_sentences`` (Megatron's ``--split-sentences``): each document is cut by
:func:`omnitron.core.data.sentences.split_sentences` and every sentence is tokenized and stored as
its own sequence; the ``.idx`` document index keeps the document boundaries (an appended eod ends
the document's last sentence), and the outputs are named ``PREFIX_<key>_sentence`` as Megatron's.

``partitions`` (Megatron's ``--partitions N``) gives Megatron's document order: its preprocess_data.py deals the
input lines round robin into N partition files, tokenizes each, and merges the N outputs in partition order, so
documents 0, N, 2N, ... come first; with ``keep_sequential_samples`` the partitions are contiguous blocks and the
input order stays. Here the documents are dealt the same way into N temporary datasets merged in that order.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from omnitron.core.lifetime import die_with_parent

from .indexed import IndexedDatasetBuilder, data_file, index_file, optimal_dtype
from .sentences import split_sentences as cut_sentences
from .tokenizers import Tokenizer, build_tokenizer

CHUNK_DOCS = 256  # documents per tokenization task


class PreprocessError(ValueError):
    """Preprocessing cannot produce a dataset (no input, no documents); the message says why."""


@dataclass
class PreprocessStats:
    """What a run read, wrote and skipped (printed as the summary)."""

    documents: int = 0
    tokens: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    invalid_utf8: int = 0
    empty: int = 0
    records: int = 0
    """Records written (each one document per key, empty or not): the round-robin count of ``partitions``."""
    """Documents without a token: kept as Megatron keeps them (a document of no sequences in the .idx)."""
    skipped: dict = field(default_factory=lambda: {"invalid_utf8": 0, "bad_json": 0, "missing_key": 0})
    outputs: list = field(default_factory=list)

    def summary(self) -> str:
        rate = self.tokens / self.seconds if self.seconds > 0 else float("inf")
        skipped = ", ".join(f"{k} {v}" for k, v in self.skipped.items() if v) or "none"
        empty = f" (and {self.empty} empty, kept without tokens)" if self.empty else ""
        return (f"{self.documents} documents{empty}, {self.tokens} tokens in {self.seconds:.2f} s "
                f"({rate:,.0f} tokens/s), "
                f"{self.bytes_read} bytes read, {self.bytes_written} bytes written; invalid UTF-8 lines "
                f"{self.invalid_utf8}; skipped: {skipped}")


def _decode(raw: bytes, invalid_utf8: str, stats: PreprocessStats) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        stats.invalid_utf8 += 1
        if invalid_utf8 == "skip":
            stats.skipped["invalid_utf8"] += 1
            return None
        return raw.decode("utf-8", errors="replace")


def iter_records(paths: list[str], json_keys: list[str], *, txt_mode: str = "line", invalid_utf8: str = "replace",
                 stats: PreprocessStats) -> Iterator[dict[str, str]]:
    """Yield ``{key: text}`` per document. ``.jsonl``/``.json`` files are JSON lines, and so is any file whose first
    line is a JSON object (Megatron reads every input as JSON lines, whatever its name); anything else is text:
    one document per line (``txt_mode="line"``) or per blank-line separated paragraph (``"paragraph"``)."""
    for path in paths:
        is_json = path.endswith((".jsonl", ".json")) or _starts_with_json_object(path)
        para: list[str] = []
        with open(path, "rb") as f:
            for raw in f:
                stats.bytes_read += len(raw)
                text = _decode(raw, invalid_utf8, stats)
                if text is None:
                    continue
                if is_json:
                    rec = _json_record(text, json_keys, stats, invalid_utf8)
                    if rec is not None:
                        yield rec
                elif txt_mode == "paragraph":
                    if text.strip():
                        para.append(text)
                    elif para:
                        yield {json_keys[0]: "".join(para).rstrip("\r\n")}
                        para = []
                elif text.strip():
                    yield {json_keys[0]: text.rstrip("\r\n")}
        if para:
            yield {json_keys[0]: "".join(para).rstrip("\r\n")}


def _starts_with_json_object(path: str) -> bool:
    """Whether the first non-blank line of ``path`` is a JSON object (a JSON-lines corpus named ``.ndjson``, ``train``
    or ``.txt``: read as text it would be tokenized braces, keys and all)."""
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    return isinstance(json.loads(raw), dict)
                except ValueError:
                    return False
    return False


_SURROGATE = re.compile("[\ud800-\udfff]")
"""A lone UTF-16 surrogate: valid in JSON (``"\\ud800"``), not text UTF-8 or a tokenizer can hold."""


def _is_text(value) -> bool:
    """A document's text: a string, or a list of strings (its sentences, as Megatron's split step writes them)."""
    return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))


def _clean(value, pattern_sub):
    return pattern_sub(value) if isinstance(value, str) else [pattern_sub(v) for v in value]


def _json_record(line: str, json_keys: list[str], stats: PreprocessStats,
                 invalid_utf8: str = "replace") -> dict | None:
    """The record's ``json_keys`` texts (strings, or lists of sentences); bad JSON and missing keys are counted and
    skipped, and a text with a lone surrogate escape is invalid UTF-8 by ``--invalid-utf8`` (replaced by U+FFFD, or
    the document skipped)."""
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        stats.skipped["bad_json"] += 1
        return None
    if not isinstance(obj, dict):
        stats.skipped["bad_json"] += 1
        return None
    if any(not _is_text(obj.get(k)) for k in json_keys):
        stats.skipped["missing_key"] += 1
        return None
    rec = {k: obj[k] for k in json_keys}
    if any(_SURROGATE.search(t) for v in rec.values() for t in ([v] if isinstance(v, str) else v)):
        stats.invalid_utf8 += 1
        if invalid_utf8 == "skip":
            stats.skipped["invalid_utf8"] += 1
            return None
        rec = {k: _clean(v, lambda t: _SURROGATE.sub("\ufffd", t)) for k, v in rec.items()}
    return rec


_WORKER_TOK: Tokenizer | None = None


def _init_worker(tokenizer_kwargs: dict, parent_pid: int) -> None:
    global _WORKER_TOK
    die_with_parent(parent_pid)  # a killed ``omnitron preprocess`` leaves no worker tokenizing on
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    _WORKER_TOK = build_tokenizer(**tokenizer_kwargs)


def _encode_chunk(task: tuple[list[dict], list[str], bool, bool]) -> list[dict[str, tuple]]:
    """Per record and key ``(ids, sentence lengths or None)``; sentences with no token are dropped. A text given as
    a list is its sentences (Megatron's encoder takes a list so, with or without --split-sentences)."""
    records, keys, append_eod, by_sentence = task
    tok = _WORKER_TOK
    out = [dict() for _ in records]
    for k in keys:
        whole = [i for i, r in enumerate(records) if isinstance(r[k], str) and not by_sentence]
        for i, ids in zip(whole, tok.encode_batch([records[i][k] for i in whole]) if whole else []):
            if ids and append_eod:
                ids.append(tok.eod)
            out[i][k] = (np.asarray(ids, np.int64), None)
        for i, r in enumerate(records):
            if k in out[i]:
                continue
            pieces = r[k] if isinstance(r[k], list) else cut_sentences(r[k])
            sentences = [ids for ids in (tok.encode_batch(pieces) if pieces else []) if ids]
            if sentences and append_eod:
                sentences[-1].append(tok.eod)
            flat = [t for ids in sentences for t in ids]
            out[i][k] = (np.asarray(flat, np.int64), [len(ids) for ids in sentences])
    return out


def _chunks(records: Iterator[dict[str, str]], keys: list[str], append_eod: bool, by_sentence: bool):
    chunk: list[dict[str, str]] = []
    for rec in records:
        chunk.append(rec)
        if len(chunk) == CHUNK_DOCS:
            yield chunk, keys, append_eod, by_sentence
            chunk = []
    if chunk:
        yield chunk, keys, append_eod, by_sentence


def preprocess_files(inputs: list[str], output_prefix: str, *, json_keys: list[str] = ("text",),
                     tokenizer_kwargs: dict | None = None, append_eod: bool = True, workers: int = 1,
                     txt_mode: str = "line", invalid_utf8: str = "replace", progress: bool = False,
                     split_sentences: bool = False, partitions: int = 1,
                     keep_sequential_samples: bool = False) -> PreprocessStats:
    """Tokenize ``inputs`` into ``{output_prefix}_{key}_document.{bin,idx}`` for each key (``_sentence``
    with ``split_sentences``: one sequence per sentence); return stats. ``partitions``: Megatron's document order
    for its ``--partitions`` (see the module docstring)."""
    json_keys = list(json_keys)
    for p in inputs:
        if not os.path.isfile(p):
            raise PreprocessError(f"--input {p!r}: no such file")
    if workers < 1:
        raise PreprocessError(f"--workers must be >= 1, got {workers}")
    if partitions < 1:
        raise PreprocessError(f"--partitions must be >= 1, got {partitions}")
    tokenizer_kwargs = dict(tokenizer_kwargs or {"tokenizer_type": "GPT2BPETokenizer"})
    tok = build_tokenizer(**tokenizer_kwargs)  # fail on a bad tokenizer before reading any input
    stats = PreprocessStats()
    level = "sentence" if split_sentences else "document"
    prefixes = {k: f"{output_prefix}_{k}_{level}" for k in json_keys}
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    dealt = 1 if keep_sequential_samples else partitions  # contiguous blocks merged in order: the input order
    parts = _part_prefixes(prefixes, dealt)
    builders = [{k: IndexedDatasetBuilder(data_file(p), optimal_dtype(tok.vocab_size)) for k, p in part.items()}
                for part in parts]
    bar = _progress_bar(sum(os.path.getsize(p) for p in inputs)) if progress else None
    start = time.perf_counter()
    tasks = _chunks(iter_records(inputs, json_keys, txt_mode=txt_mode, invalid_utf8=invalid_utf8, stats=stats),
                    json_keys, append_eod, split_sentences)
    pool = mp.get_context("fork").Pool(workers, _init_worker, (tokenizer_kwargs, os.getpid())) if workers > 1 else None
    if pool is None:
        global _WORKER_TOK
        _WORKER_TOK = tok
    try:
        for encoded in (_bounded_imap(pool, tasks, 4 * workers) if pool else map(_encode_chunk, tasks)):
            _write_chunk(encoded, builders, stats)
            if bar is not None:
                bar.update(stats.bytes_read - bar.n)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
        if bar is not None:
            bar.close()
    for part, built in zip(parts, builders):
        for k, b in built.items():
            b.finalize(index_file(part[k]))
    if dealt > 1:
        _merge_parts(prefixes, parts, optimal_dtype(tok.vocab_size))
    stats.seconds = time.perf_counter() - start
    if stats.documents == 0:
        for p in prefixes.values():
            for f in (data_file(p), index_file(p)):
                os.remove(f)
        raise PreprocessError(f"no documents in {', '.join(inputs)} ({stats.summary()}); check --json-keys "
                              f"{' '.join(json_keys)} and that the input is not empty")
    stats.bytes_written = sum(os.path.getsize(f) for p in prefixes.values() for f in (data_file(p), index_file(p)))
    stats.outputs = list(prefixes.values())
    return stats


def _bounded_imap(pool, tasks, max_pending: int):
    """Ordered ``pool.imap`` that keeps at most ``max_pending`` chunks in flight.

    NOTE: ``Pool.imap`` drains its input iterator eagerly, which would read the whole file
    into memory; this keeps preprocessing streaming.
    """
    pending: deque = deque()
    for task in tasks:
        pending.append(pool.apply_async(_encode_chunk, (task,)))
        if len(pending) >= max_pending:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _part_prefixes(prefixes: dict[str, str], n: int) -> list[dict[str, str]]:
    """Where each of ``n`` partitions is written: the outputs themselves for one, temporary names for several."""
    if n == 1:
        return [prefixes]
    return [{k: f"{p}.partition{i}-{os.getpid()}" for k, p in prefixes.items()} for i in range(n)]


def _merge_parts(prefixes: dict[str, str], parts: list[dict[str, str]], dtype) -> None:
    """Each key's partitions merged, in partition order, into its output; the partitions removed."""
    for k, out in prefixes.items():
        merged = IndexedDatasetBuilder(data_file(out), dtype)
        for part in parts:
            merged.add_index(part[k])
        merged.finalize(index_file(out))
        for part in parts:
            os.remove(data_file(part[k]))
            os.remove(index_file(part[k]))


def _write_chunk(encoded: list[dict[str, tuple]], parts: list[dict], stats: PreprocessStats) -> None:
    """Write each record's documents to its partition (record ``i`` of the run to ``i % len(parts)``)."""
    for rec in encoded:
        builders = parts[stats.records % len(parts)]
        stats.records += 1
        wrote = False
        for k, (ids, lengths) in rec.items():
            if ids.size == 0:  # as Megatron: the document stays, holding no sequence
                builders[k].add_document(ids, [])
                stats.empty += 1
                continue
            builders[k].add_document(ids, lengths)
            stats.tokens += int(ids.size)
            wrote = True
        stats.documents += wrote


def _progress_bar(total_bytes: int):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a dependency, but progress is optional
        return None
    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc="preprocess", file=sys.stderr, mininterval=1.0)
