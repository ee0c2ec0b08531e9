"""GPT dataset indices, samples, caching, splits, blending, mock data, vs plain-Python references."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from omnitron.core.data import (BlendedDataset, DataConfig, DataError, GPTDataset, IndexCacheMissing,
                                IndexedDataset, IndexedDatasetBuilder, MockGPTDataset, blend_indices,
                                build_gpt_datasets, build_tokenizer, make_sample, split_ranges)
from omnitron.core.config.parallel import ConfigError
from omnitron.core.data.config import parse_blend


def _write(prefix, docs, dtype=np.uint16):
    b = IndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for d in docs:
        b.add_document(d)
    b.finalize(f"{prefix}.idx")
    return IndexedDataset(prefix)


def _docs(rng, n, vocab, eod, max_len=60):
    return [np.append(rng.integers(0, eod, rng.integers(0, max_len)), eod) for _ in range(n)]


def test_samples_match_flat_token_stream(tmp_path):
    rng = np.random.default_rng(0)
    docs = _docs(rng, 40, 1000, 999)
    ds = _write(tmp_path / "d", docs)
    documents = np.arange(5, 33)
    seq, n = 16, 300  # more samples than one epoch holds: several epochs
    g = GPTDataset(ds, documents, n, seq_length=seq, seed=11, eod=999, cache_dir=str(tmp_path / "c"))
    per_epoch = sum(len(docs[d]) for d in documents)
    epochs = len(g.document_index) // len(documents)
    assert len(g.document_index) == epochs * len(documents)
    assert (epochs - 1) * per_epoch < n * seq + 1 <= epochs * per_epoch  # fewest epochs that suffice
    # the epochs' copies of the split's documents, shuffled (Megatron's order: tests/data/test_megatron_order.py)
    assert sorted(g.document_index.tolist()) == sorted(documents.tolist() * epochs)
    stream = np.concatenate([docs[d] for d in g.document_index])
    assert len(g) == (len(stream) - 1) // seq >= n
    assert sorted(g.shuffle_index.tolist()) == list(range(len(g)))
    for i in range(len(g)):
        j = int(g.shuffle_index[i])
        item = g[i]
        np.testing.assert_array_equal(item["tokens"].numpy(), stream[j * seq: j * seq + seq])
        np.testing.assert_array_equal(item["labels"].numpy(), stream[j * seq + 1: j * seq + seq + 1])
    assert item["tokens"].dtype == torch.int64 and item["loss_mask"].dtype == torch.float32


def test_an_epoch_of_exactly_the_requested_tokens_takes_a_second_epoch(tmp_path):
    """n samples of seq tokens read n * seq + 1 tokens (each sample's labels reach one token further): a split of
    exactly n * seq tokens is one token short, so a second epoch is indexed (Megatron's ``_get_num_epochs`` adds
    ``add_extra_token_to_sequence``); with one epoch only n - 1 samples fit. Hand-derived on random documents
    whose lengths sum to n * seq."""
    rng = np.random.default_rng(int(torch.randint(0, 2 ** 31, ()).item()))
    seq, n = 16, 10
    cuts = np.sort(rng.choice(np.arange(1, n * seq), 7, replace=False))
    lengths = np.diff(np.concatenate([[0], cuts, [n * seq]]))
    docs = [np.append(rng.integers(0, 99, length - 1), 99) for length in lengths]
    ds = _write(tmp_path / "d", docs)
    g = GPTDataset(ds, np.arange(len(docs)), n, seq_length=seq, seed=5, eod=99, cache_dir=str(tmp_path / "c"))
    assert len(g.document_index) == 2 * len(docs)
    assert len(g) == (2 * n * seq - 1) // seq >= n


def test_determinism_and_cache(tmp_path):
    rng = np.random.default_rng(1)
    ds = _write(tmp_path / "d", _docs(rng, 30, 500, 499))
    kw = dict(seq_length=8, eod=499, cache_dir=str(tmp_path / "c"))
    with pytest.raises(IndexCacheMissing, match="builder rank"):
        GPTDataset(ds, np.arange(30), 50, seed=3, allow_build=False, **kw)
    a = GPTDataset(ds, np.arange(30), 50, seed=3, **kw)
    b = GPTDataset(ds, np.arange(30), 50, seed=3, allow_build=False, **kw)  # loads what a built
    assert isinstance(b.shuffle_index, np.memmap)
    assert all(torch.equal(a[i]["tokens"], b[i]["tokens"]) for i in range(len(a)))
    c = GPTDataset(ds, np.arange(30), 50, seed=4, **kw)
    assert not all(torch.equal(a[i]["tokens"], c[i]["tokens"]) for i in range(min(len(a), len(c))))
    # a changed file is a different cache key
    ds2 = _write(tmp_path / "d", _docs(rng, 30, 500, 499))
    with pytest.raises(IndexCacheMissing):
        GPTDataset(ds2, np.arange(30), 50, seed=3, allow_build=False, **kw)


def test_make_sample_masks_and_positions():
    eod = 7
    text = np.array([1, 2, 7, 3, 4, 5, 7, 7, 6, 1, 2])
    s = make_sample(text, eod, eod_mask_loss=True, reset_position_ids=True)
    tokens = text[:-1]
    pos, p = [], 0
    for t in tokens:  # reference: restart after each eod
        pos.append(p)
        p = 0 if t == eod else p + 1
    assert s["position_ids"].tolist() == pos
    assert s["loss_mask"].tolist() == [0.0 if t == eod else 1.0 for t in tokens]
    plain = make_sample(text, eod, False, False)
    assert plain["position_ids"].tolist() == list(range(10)) and plain["loss_mask"].sum() == 10


def test_split_ranges_and_config_errors():
    assert split_ranges(1000, [0.969, 0.03, 0.001]) == [(0, 969), (969, 999), (999, 1000)]
    r = split_ranges(863, [0.969, 0.03, 0.001])
    assert r[0][0] == 0 and r[-1][1] == 863 and all(hi > lo for lo, hi in r)
    with pytest.raises(ConfigError, match="--split"):
        DataConfig(split="a,b")
    with pytest.raises(ConfigError, match="WEIGHT PREFIX"):
        DataConfig(data_path=["0.5", "A", "0.5"])
    assert parse_blend(["A", "B"]) == (["A", "B"], None)  # prefixes alone: blended by size, as Megatron
    assert parse_blend(["1.0", "A"]) == (["A"], [1.0]) and parse_blend(["A"]) == (["A"], None)
    with pytest.raises(ConfigError, match="weight"):
        DataConfig(data_path=["0.5", "A", "B", "C"])
    with pytest.raises(ConfigError, match="must be > 0"):
        DataConfig(data_path=["0", "A", "1", "B"])


def test_blend_indices_greedy_reference():
    w = [0.5, 0.3, 0.2]
    di, si = blend_indices(w, 1000)
    counts = [0, 0, 0]
    for i in range(1000):  # reference: the dataset furthest behind its target share (Megatron's max(i, 1))
        errs = [w[d] * max(i, 1) - counts[d] for d in range(3)]
        d = errs.index(max(errs))
        assert (di[i], si[i]) == (d, counts[d])
        counts[d] += 1
        assert all(abs(counts[k] - w[k] * (i + 1)) <= 1 for k in range(3))


def test_build_gpt_datasets_blend_split_and_vocab_check(tmp_path):
    tok = build_tokenizer("NullTokenizer", vocab_size=300)
    rng = np.random.default_rng(2)
    a = _write(tmp_path / "a", _docs(rng, 200, 300, tok.eod))
    b = _write(tmp_path / "b", [d + 0 for d in _docs(rng, 100, 300, tok.eod)])
    cfg = DataConfig(data_path=["0.7", str(tmp_path / "a"), "0.3", str(tmp_path / "b")], split="90,10,0",
                     seq_length=12, seed=5, data_cache_path=str(tmp_path / "c"))
    train, valid, test = build_gpt_datasets(cfg, tok, train_samples=400, valid_samples=40, test_samples=10)
    assert test is None and isinstance(train, BlendedDataset) and len(train) == 400 and len(valid) == 40
    assert abs((train.dataset_index == 0).sum() - 280) <= 1
    train_docs, valid_docs = train.datasets[0].documents, valid.datasets[0].documents
    assert set(train_docs.tolist()).isdisjoint(valid_docs.tolist()) and len(train_docs) == 180
    ref = train.datasets[int(train.dataset_index[17])][int(train.dataset_sample_index[17])]
    assert torch.equal(train[17]["tokens"], ref["tokens"])
    again = build_gpt_datasets(cfg, tok, train_samples=400, valid_samples=40, test_samples=10)[0]
    assert all(torch.equal(train[i]["labels"], again[i]["labels"]) for i in range(0, 400, 7))
    small = build_tokenizer("NullTokenizer", vocab_size=100)
    with pytest.raises(DataError, match="beyond the NullTokenizer vocabulary of 101"):
        build_gpt_datasets(cfg, small, train_samples=10, valid_samples=0, test_samples=0)
    tiny = DataConfig(data_path=[str(tmp_path / "b")], split="999,1,0", seq_length=12,
                      data_cache_path=str(tmp_path / "c"))
    with pytest.raises(DataError, match="valid split .* gets no documents"):
        build_gpt_datasets(tiny, tok, train_samples=10, valid_samples=5, test_samples=0)


def test_per_split_paths_read_all_documents_of_their_own_files(tmp_path):
    """--train-data-path / --valid-data-path: each split indexes every document of its own files and nothing
    of the others' (the tokens of every sample are a window of its own file's token stream)."""
    tok = build_tokenizer("NullTokenizer", vocab_size=300)
    rng = np.random.default_rng(3)
    a = _write(tmp_path / "a", _docs(rng, 50, 300, tok.eod))
    v = _write(tmp_path / "v", [np.append(rng.integers(200, 250, 30), tok.eod) for _ in range(20)])  # ids 200-249
    cfg = DataConfig(train_data_path=[str(tmp_path / "a")], valid_data_path=[str(tmp_path / "v")], seq_length=12,
                     seed=5, data_cache_path=str(tmp_path / "c"))
    train, valid, test = build_gpt_datasets(cfg, tok, train_samples=60, valid_samples=30, test_samples=5)
    assert test is None and len(train) >= 60 and len(valid) >= 30  # whole epochs of each split
    assert sorted(train.documents.tolist()) == list(range(len(a)))
    assert sorted(valid.documents.tolist()) == list(range(len(v)))
    stream = np.concatenate([v.get(i) for i in range(len(v))])
    tokens = valid[7]["tokens"].numpy()
    assert any(np.array_equal(stream[i:i + len(tokens)], tokens) for i in range(len(stream) - len(tokens) + 1))
    with pytest.raises(ConfigError, match="not both"):
        DataConfig(data_path=[str(tmp_path / "a")], train_data_path=[str(tmp_path / "a")])


def test_demo_corpus_default_and_mock(tmp_path):
    tok = build_tokenizer()
    cfg = DataConfig(seq_length=64, data_cache_path=str(tmp_path))
    train, valid, test = build_gpt_datasets(cfg, tok, train_samples=200, valid_samples=20, test_samples=2)
    assert len(train) >= 200 and len(valid) >= 20 and len(test) >= 2
    text = tok.decode(torch.cat([train[i]["tokens"] for i in range(3)]).tolist())
    assert "\ufffd" not in text and len(text) > 100
    cfg = DataConfig(mock_data=True, seq_length=32)
    m1, _, _ = build_gpt_datasets(cfg, tok, train_samples=20, valid_samples=0, test_samples=0)
    m2 = MockGPTDataset(20, seq_length=32, vocab_size=tok.vocab_size, eod=tok.eod, seed=cfg.seed)
    assert torch.equal(m1[5]["tokens"], m2[5]["tokens"]) and m1[5]["tokens"].max() < tok.vocab_size
    assert torch.equal(m1[5]["labels"][:-1], m1[5]["tokens"][1:])


def _digest(cache_dir, prefix, is_builder_rank=True, barrier=None):
    tok = build_tokenizer("NullTokenizer", vocab_size=300)
    cfg = DataConfig(data_path=[prefix], split="80,20,0", seq_length=10, seed=9, data_cache_path=cache_dir)
    train, valid, _ = build_gpt_datasets(cfg, tok, train_samples=300, valid_samples=30, test_samples=0,
                                         is_builder_rank=is_builder_rank, barrier=barrier)
    h = hashlib.sha256()
    for ds in (train, valid):
        for i in range(len(ds)):
            h.update(ds[i]["tokens"].numpy().tobytes())
    return h.hexdigest()


def _rank_checks(cache_dir, prefix):
    """One spawn, two checks: rank 0 builds the caches while rank 1 waits and loads; tp broadcast of a batch."""
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.data import broadcast_batch, collate, needs_batch
    from omnitron.core.parallel.groups import ParallelGroups

    digest = _digest(cache_dir, prefix, dist.get_rank() == 0, dist.barrier)
    coll = get_backend().collectives
    groups = ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=2), coll)
    ds = MockGPTDataset(8, seq_length=16, vocab_size=50, eod=49, reset_position_ids=True)
    mine = collate([ds[i] for i in range(4)]) if groups.tp.rank == 0 else None
    dev = get_backend().device()  # the batch lands on the device, as the training loop asks
    got = broadcast_batch(mine, group=groups.tp, collectives=coll, micro_batch_size=4, seq_length=16, device=dev)
    docs = MockGPTDataset(8, seq_length=16, vocab_size=50, eod=49, reset_attention_mask=True, seed=3)
    mine = collate([docs[i] for i in range(4)]) if groups.tp.rank == 0 else None
    got_docs = broadcast_batch(mine, group=groups.tp, collectives=coll, micro_batch_size=4, seq_length=16,
                               document_ids=True, device=dev)
    return digest, needs_batch(groups), {k: v.tolist() for k, v in got.items()}, got_docs["document_ids"].tolist()


@pytest.mark.multiprocess
def test_two_ranks_build_load_and_broadcast(tmp_path):
    from omnitron.core.data import collate
    from omnitron.testing.distributed import run_distributed

    _write(tmp_path / "d", _docs(np.random.default_rng(3), 120, 300, 300))
    results = run_distributed(_rank_checks, 2, str(tmp_path / "shared"), str(tmp_path / "d"))
    assert [r[0] for r in results] == [_digest(str(tmp_path / "single"), str(tmp_path / "d"))] * 2
    ds = MockGPTDataset(8, seq_length=16, vocab_size=50, eod=49, reset_position_ids=True)
    ref = {k: v.tolist() for k, v in collate([ds[i] for i in range(4)]).items()}
    assert all(r[1] for r in results) and all(r[2] == ref for r in results)
    docs = MockGPTDataset(8, seq_length=16, vocab_size=50, eod=49, reset_attention_mask=True, seed=3)
    ref_docs = collate([docs[i] for i in range(4)])["document_ids"]
    assert ref_docs.max() > 0 and all(r[3] == ref_docs.tolist() for r in results)
