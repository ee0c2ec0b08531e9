"""MMIDIDX .bin/.idx: a byte fixture built from the format description, random access, merging, bad files."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from omnitron.cli import main
from omnitron.core.data.indexed import (IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError,
                                        merge_datasets)


def _fixture_bytes(docs: list[list[list[int]]], code: int, np_dtype) -> tuple[bytes, bytes]:
    """Hand-assembled .idx/.bin per Megatron's MMIDIDX description (independent of omnitron's writer)."""
    lengths, pointers, doc_idx, data = [], [], [0], b""
    for doc in docs:
        for seq in doc:
            pointers.append(len(data))
            lengths.append(len(seq))
            data += b"".join(struct.pack("<" + {np.uint16: "H", np.int32: "i"}[np_dtype], t) for t in seq)
        doc_idx.append(len(lengths))
    idx = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    idx += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_idx))
    idx += b"".join(struct.pack("<i", n) for n in lengths)
    idx += b"".join(struct.pack("<q", p) for p in pointers)
    idx += b"".join(struct.pack("<q", d) for d in doc_idx)
    return idx, data


def _random_docs(rng, n_docs, vocab, max_seqs=3):
    return [[rng.integers(0, vocab, rng.integers(0, 40)).tolist() for _ in range(rng.integers(1, max_seqs + 1))]
            for _ in range(n_docs)]


@pytest.mark.parametrize("code,np_dtype,vocab", [(8, np.uint16, 50257), (4, np.int32, 200000)])
def test_reader_and_writer_match_hand_built_fixture(tmp_path, code, np_dtype, vocab):
    rng = np.random.default_rng(code)
    docs = _random_docs(rng, 25, vocab)
    idx, data = _fixture_bytes(docs, code, np_dtype)
    (tmp_path / "fx.idx").write_bytes(idx)
    (tmp_path / "fx.bin").write_bytes(data)
    ds = IndexedDataset(tmp_path / "fx")
    seqs = [s for d in docs for s in d]
    assert len(ds) == len(seqs) and ds.num_documents == len(docs) and ds.dtype == np.dtype(np_dtype)
    for i, s in enumerate(seqs):
        assert ds[i].tolist() == s
    for d, doc in enumerate(docs):
        assert ds.document(d).tolist() == [t for s in doc for t in s]
    i = max(range(len(seqs)), key=lambda k: len(seqs[k]))
    assert ds.get(i, 3, 5).tolist() == seqs[i][3:8]
    assert ds.max_token() == max(t for s in seqs for t in s)
    # omnitron's writer produces the same bytes
    b = IndexedDatasetBuilder(str(tmp_path / "w.bin"), np_dtype)
    for doc in docs:
        for s in doc:
            b.add_item(s)
        b.end_document()
    b.finalize(str(tmp_path / "w.idx"))
    assert (tmp_path / "w.idx").read_bytes() == idx
    assert (tmp_path / "w.bin").read_bytes() == data


def test_merge_concatenates_documents(tmp_path):
    rng = np.random.default_rng(1)
    parts = [_random_docs(rng, n, 1000) for n in (7, 1, 12)]
    prefixes = []
    for k, docs in enumerate(parts):
        idx, data = _fixture_bytes(docs, 8, np.uint16)
        (tmp_path / f"p{k}.idx").write_bytes(idx)
        (tmp_path / f"p{k}.bin").write_bytes(data)
        prefixes.append(str(tmp_path / f"p{k}"))
    merged = merge_datasets(prefixes, str(tmp_path / "out" / "m"))
    idx, data = _fixture_bytes([d for docs in parts for d in docs], 8, np.uint16)
    assert (tmp_path / "out" / "m.idx").read_bytes() == idx and (tmp_path / "out" / "m.bin").read_bytes() == data
    assert merged.num_documents == sum(map(len, parts))


def test_token_dtype_is_megatrons_choice():
    """Megatron's DType.optimal_dtype: uint16 below a cardinality of 65,500 (not 65,536), else int32; None: int32."""
    from omnitron.core.data.indexed import optimal_dtype

    for vocab, want in ((1, np.uint16), (50257, np.uint16), (65499, np.uint16), (65500, np.int32),
                        (65536, np.int32), (200000, np.int32), (None, np.int32)):
        assert optimal_dtype(vocab) is want, vocab


def test_sequences_stored_out_of_order_are_read_and_their_truncation_seen(tmp_path):
    """The format allows any pointers: sequence 0 stored after sequence 1 in the .bin. Both read back, and a .bin
    cut short of sequence 0's end (not the last sequence's) is refused as truncated; a negative length is refused,
    and so is an id equal to the vocabulary size."""
    rng = np.random.default_rng()
    first, second = rng.integers(0, 500, 7).tolist(), rng.integers(0, 500, 5).tolist()
    data = struct.pack("<5H", *second) + struct.pack("<7H", *first)
    idx = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, 2, 3) + struct.pack("<2i", 7, 5)
    idx += struct.pack("<2q", 10, 0) + struct.pack("<3q", 0, 1, 2)
    for name, body in (("whole", data), ("cut", data[:-2])):
        (tmp_path / f"{name}.idx").write_bytes(idx)
        (tmp_path / f"{name}.bin").write_bytes(body)
    ds = IndexedDataset(tmp_path / "whole")
    assert ds[0].tolist() == first and ds[1].tolist() == second
    with pytest.raises(IndexError, match=r"slice \[3, 2\) outside sequence 1"):  # not numpy's count -1: the rest
        ds.get(1, 3, -1)
    ds.vocab_size = max(first) + 1
    assert ds[0].tolist() == first
    ds.vocab_size = max(first)  # an id equal to the vocabulary size is outside it
    with pytest.raises(IndexedDatasetError, match=f"holds token id {max(first)}, outside the tokenizer's range"):
        ds[0]
    with pytest.raises(IndexedDatasetError, match="truncated: 22 bytes, the index needs 24"):
        IndexedDataset(tmp_path / "cut")


def test_token_range_sees_a_negative_id_in_any_chunk(tmp_path):
    """A corrupt int32 .bin with a negative id early on: token_range, read in chunks smaller than the file, reports
    it as the smallest id (not the last chunk's smallest) and the largest id of all."""
    rng = np.random.default_rng()
    ids = rng.integers(0, 1000, 12)
    ids[rng.integers(0, 4)] = -int(rng.integers(1, 100))
    idx, data = _fixture_bytes([[ids.tolist()]], 4, np.int32)
    (tmp_path / "neg.idx").write_bytes(idx)
    (tmp_path / "neg.bin").write_bytes(data)
    assert IndexedDataset(tmp_path / "neg").token_range(chunk_tokens=4) == (int(ids.min()), int(ids.max()))


def test_token_range_of_valid_ids_is_their_smallest_and_largest(tmp_path):
    """Ids all above zero: the smallest reported is theirs, not a floor of 0 (the docstring's promise)."""
    rng = np.random.default_rng()
    ids = rng.integers(5, 1000, 13)
    idx, data = _fixture_bytes([[ids.tolist()]], 4, np.int32)
    (tmp_path / "pos.idx").write_bytes(idx)
    (tmp_path / "pos.bin").write_bytes(data)
    assert IndexedDataset(tmp_path / "pos").token_range(chunk_tokens=4) == (int(ids.min()), int(ids.max()))



def test_token_range_reads_every_position_of_every_chunk(tmp_path):
    """The largest and the smallest id at each position in turn (a chunk's first, middle and last, the file's last),
    read in chunks of a random size smaller than the file: each is found (the reference: numpy over all ids)."""
    rng = np.random.default_rng()
    n, chunk = int(rng.integers(7, 15)), int(rng.integers(2, 6))
    base = rng.integers(100, 1000, n)
    for pos in range(n):
        for extreme in (5000, 3):
            ids = base.copy()
            ids[pos] = extreme
            idx, data = _fixture_bytes([[ids.tolist()]], 4, np.int32)
            (tmp_path / "r.idx").write_bytes(idx)
            (tmp_path / "r.bin").write_bytes(data)
            got = IndexedDataset(tmp_path / "r").token_range(chunk_tokens=chunk)
            assert got == (int(ids.min()), int(ids.max())), (n, chunk, pos, extreme)

def test_bad_files_fail_with_clear_errors(tmp_path):
    docs = _random_docs(np.random.default_rng(2), 5, 500)
    idx, data = _fixture_bytes(docs, 8, np.uint16)

    def write(name, i, d):
        (tmp_path / f"{name}.idx").write_bytes(i)
        (tmp_path / f"{name}.bin").write_bytes(d)
        return tmp_path / name

    with pytest.raises(IndexedDatasetError, match="wrong magic"):
        IndexedDataset(write("magic", b"TNTIDX\x00\x00" + idx[7:], data))
    with pytest.raises(IndexedDatasetError, match="version 2, only version 1 .*re-run"):
        IndexedDataset(write("ver", idx[:9] + struct.pack("<Q", 2) + idx[17:], data))
    with pytest.raises(IndexedDatasetError, match="dtype code 9"):
        IndexedDataset(write("code", idx[:17] + b"\x09" + idx[18:], data))
    with pytest.raises(IndexedDatasetError, match="truncated"):
        IndexedDataset(write("bin", idx, data[:-3]))
    with pytest.raises(IndexedDatasetError, match="truncated or corrupt"):
        IndexedDataset(write("idx", idx[:-8], data))
    with pytest.raises(IndexedDatasetError, match="no such file"):
        IndexedDataset(tmp_path / "nothing")
    seqs = struct.unpack("<Q", idx[18:26])[0]  # the last document boundary short of the sequence count
    with pytest.raises(IndexedDatasetError, match="document boundaries must rise from 0 to the sequence count"):
        IndexedDataset(write("docs", idx[:-8] + struct.pack("<q", seqs - 1), data))
    b = IndexedDatasetBuilder(str(tmp_path / "o.bin"), np.uint16)
    with pytest.raises(IndexedDatasetError, match="do not fit"):
        b.add_item([1, 70000])


def test_pickle_reopens_instead_of_copying(tmp_path):
    import pickle

    idx, data = _fixture_bytes(_random_docs(np.random.default_rng(4), 50, 900), 8, np.uint16)
    (tmp_path / "p.idx").write_bytes(idx)
    (tmp_path / "p.bin").write_bytes(data)
    ds = IndexedDataset(tmp_path / "p")
    blob = pickle.dumps(ds)
    assert len(blob) < 300
    again = pickle.loads(blob)
    assert all(np.array_equal(ds[i], again[i]) for i in range(len(ds)))


def test_merge_of_a_directory_takes_its_datasets_sorted_by_name(tmp_path):
    """Megatron's tools/merge_datasets.py --input DIR merges every .bin/.idx pair of DIR in sorted name order
    (checked byte for byte against it at d98e8a6); --merge DIR does the same. A half pair is refused."""
    rng = np.random.default_rng()
    names = ["b", "a_2", "c", "a_10"]  # written in this order; merged as a_10, a_2, b, c
    docs = {}
    (tmp_path / "in").mkdir()
    for name in names:
        docs[name] = _random_docs(rng, int(rng.integers(1, 8)), 300)
        idx, data = _fixture_bytes(docs[name], 8, np.uint16)
        (tmp_path / "in" / f"{name}.idx").write_bytes(idx)
        (tmp_path / "in" / f"{name}.bin").write_bytes(data)
    (tmp_path / "in" / "notes.txt").write_text("not a dataset")
    assert main(["preprocess", "--merge", str(tmp_path / "in"), "--output-prefix", str(tmp_path / "m")]) == 0
    idx, data = _fixture_bytes([d for name in sorted(names) for d in docs[name]], 8, np.uint16)
    assert (tmp_path / "m.idx").read_bytes() == idx and (tmp_path / "m.bin").read_bytes() == data
    (tmp_path / "in" / "lone.bin").write_bytes(b"")
    with pytest.raises(IndexedDatasetError, match="lone.bin has no .idx"):
        merge_datasets([str(tmp_path / "in")], str(tmp_path / "m2"))
