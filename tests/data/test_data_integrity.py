"""Bad token data is refused naming the file (and document): a same-size replaced ``.bin``, dtype codes
that cannot hold ids, negative ids, misaligned pointers, ids beyond the tokenizer under two processes."""
from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from omnitron.cli import main
from omnitron.core.data import IndexedDataset, IndexedDatasetBuilder, build_tokenizer
from omnitron.core.data.builder import DataError, check_vocabulary
from omnitron.core.data.indexed import IndexedDatasetError

VOCAB = 50  # NullTokenizer --vocab-size 50: ids 0..49 plus eod 50, vocab_size 51


def _write(prefix, docs, dtype=np.int32) -> IndexedDataset:
    b = IndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for d in docs:
        b.add_document(d)
    b.finalize(f"{prefix}.idx")
    return IndexedDataset(prefix)


def _docs(rng, n=12, high=VOCAB):
    return [rng.integers(0, high, int(rng.integers(5, 40))) for _ in range(n)]


def test_same_size_replaced_bin_is_checked_again(tmp_path):
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    tok = build_tokenizer("NullTokenizer", vocab_size=VOCAB)
    docs = _docs(rng)
    prefix = str(tmp_path / "d")
    check_vocabulary(_write(prefix, docs), tok, str(tmp_path / "cache"), True)
    bad_doc = int(rng.integers(len(docs)))
    docs[bad_doc][int(rng.integers(len(docs[bad_doc])))] = VOCAB + 7  # another tokenizer's id
    _write(str(tmp_path / "other"), docs)
    os.replace(tmp_path / "other.bin", tmp_path / "d.bin")  # same size, same .idx
    assert os.path.getsize(tmp_path / "d.bin") == sum(len(d) for d in docs) * 4
    with pytest.raises(DataError, match=f"holds token id {VOCAB + 7}, beyond the NullTokenizer vocabulary of 51"):
        check_vocabulary(IndexedDataset(prefix), tok, str(tmp_path / "cache"), True)


def test_reads_check_ids_against_the_vocabulary(tmp_path):
    """A file changed in place after its check: the read names file and document."""
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    tok = build_tokenizer("NullTokenizer", vocab_size=VOCAB)
    docs = _docs(rng)
    ds = _write(str(tmp_path / "d"), docs)
    check_vocabulary(ds, tok, str(tmp_path / "cache"), True)
    k = int(rng.integers(len(docs)))
    with open(tmp_path / "d.bin", "r+b") as f:  # the memory map sees the new bytes
        f.seek(int(ds.sequence_pointers[k]))
        f.write(struct.pack("<i", 9999))
    assert ds.document((k + 1) % len(docs)).tolist() == docs[(k + 1) % len(docs)].tolist()
    with pytest.raises(IndexedDatasetError, match=rf"d.bin: document {k} \(sequence {k}\) holds token id 9999"):
        ds.document(k)


@pytest.mark.parametrize("code,name", [(2, "int8"), (3, "int16"), (6, "float64"), (7, "float32")])
def test_dtype_codes_that_cannot_hold_ids_are_refused(tmp_path, code, name):
    _write(str(tmp_path / "d"), [np.arange(8)], np.uint16)
    idx = bytearray((tmp_path / "d.idx").read_bytes())
    idx[9 + 8] = code  # the dtype byte follows the 9-byte magic and the 8-byte version
    (tmp_path / "d.idx").write_bytes(bytes(idx))
    with pytest.raises(IndexedDatasetError, match=rf"d.idx: dtype code {code} \({name}\) cannot hold token ids"):
        IndexedDataset(str(tmp_path / "d"))
    with pytest.raises(IndexedDatasetError, match="no MMIDIDX code for token ids"):  # nor does the writer make one
        IndexedDatasetBuilder(str(tmp_path / "w.bin"), {2: np.int8, 3: np.int16, 6: np.float64, 7: np.float32}[code])


def test_negative_ids_are_refused_naming_file_and_document(tmp_path):
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    docs = _docs(rng)
    k = int(rng.integers(len(docs)))
    docs[k][-1] = -3
    ds = _write(str(tmp_path / "d"), docs)
    with pytest.raises(DataError, match=r"d.bin holds token id -3: token ids are never negative"):
        check_vocabulary(ds, build_tokenizer("NullTokenizer", vocab_size=VOCAB), str(tmp_path / "cache"), True)
    with pytest.raises(IndexedDatasetError, match=rf"document {k} \(sequence {k}\) holds token id -3"):
        ds.document(k)


def test_misaligned_and_out_of_range_pointers(tmp_path):
    _write(str(tmp_path / "d"), [np.arange(8), np.arange(5)])
    raw = bytearray((tmp_path / "d.idx").read_bytes())
    at = 34 + 2 * 4 + 8  # the second sequence's pointer (after the header and both lengths)
    (tmp_path / "d.idx").write_bytes(bytes(raw[:at]) + struct.pack("<q", 8 * 4 + 2) + bytes(raw[at + 8:]))
    with pytest.raises(IndexedDatasetError, match="sequence 1's pointer 34 is not a multiple of the 4-byte int32"):
        IndexedDataset(str(tmp_path / "d"))
    (tmp_path / "d.idx").write_bytes(bytes(raw[:at]) + struct.pack("<q", 400) + bytes(raw[at + 8:]))
    with pytest.raises(IndexedDatasetError, match="d.bin is truncated: 52 bytes, the index needs 420"):
        IndexedDataset(str(tmp_path / "d"))
    far = 2 ** 63 - 4  # aligned; pointer + 5 ids x 4 bytes passes 2**63: must not wrap into "fits"
    (tmp_path / "d.idx").write_bytes(bytes(raw[:at]) + struct.pack("<q", far) + bytes(raw[at + 8:]))
    with pytest.raises(IndexedDatasetError, match=f"d.bin is truncated: 52 bytes, the index needs {far + 20}"):
        IndexedDataset(str(tmp_path / "d"))


def _train(capsys, *flags) -> tuple[int, str]:
    rc = main(["train", "--model", "gpt2_tiny", "--train-iters", "2", *flags])
    return rc, capsys.readouterr().err.strip()


def test_foreign_tokenizer_data_under_two_processes_is_one_line(tmp_path, capsys):
    """Checked in the launcher before any worker starts: one line, exit 2, no traceback per rank."""
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    prefix = str(tmp_path / "gpt2_text_document")
    _write(prefix, _docs(rng, high=50257))  # GPT-2 ids, trained with a 51-id NullTokenizer
    rc, err = _train(capsys, "--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
                     "--nproc-per-node", "2", "--data-cache-path", str(tmp_path / "cache"))
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"--data-path {prefix}: {prefix} holds token id" in err and "preprocessed with another tokenizer" in err


def test_tokenizer_and_config_file_errors_are_one_line(tmp_path, capsys):
    rc, err = _train(capsys, "--mock-data", "--tokenizer-type", "HuggingFaceTokenizer")
    assert rc == 2 and len(err.splitlines()) == 1 and "HuggingFaceTokenizer needs --tokenizer-model PATH" in err, err
    bad = tmp_path / "run.yaml"
    bad.write_text("model: gpt2_tiny\nlr: [0.1\nbf16: true\n")
    rc, err = _train(capsys, "--config", str(bad))
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"--config {bad}: not valid YAML at line" in err and "Traceback" not in err
