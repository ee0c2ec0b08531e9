"""BERT samples against Megatron's own ``BERTMaskedWordPieceDataset`` (fixtures written by
tests/data/megatron_bert_masking/make_fixtures.py): the same sentences, target length and per-sample seed give
the same segments, short-sample cut and whole-word n-gram masking, draw for draw, at ``--mask-prob`` 0.15 and
at other values, also on texts that hold special ids (kept in the text; a [CLS] / [SEP] id no masking candidate; the
padding mask where a token is [PAD]). The random replacement draws from the ids the datasets use
(:func:`replacement_ids`: the whole vocabulary, as Megatron's ``token_lookup``). Then the statistics that follow from
Megatron's rules, checked on the same cases."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from omnitron.core.data.bert_dataset import build_sample, mask_count, replacement_ids

FIXTURES = os.path.join(os.path.dirname(__file__), "megatron_bert_masking", "fixtures.pt")
IDS = {"pad": 0, "cls": 2, "sep": 3, "mask": 4}


@pytest.fixture(scope="module")
def fixtures():
    data = torch.load(FIXTURES, weights_only=True)
    vocab = data["vocab"]
    continuation = np.asarray([vocab[i].startswith("##") for i in range(len(vocab))])
    cases = [{k: v.long() if torch.is_tensor(v) else [t.long() for t in v] if isinstance(v, list) else v
              for k, v in case.items()} for case in data["cases"]]  # stored as int8
    samples = [(case, _ours(case, continuation)) for case in cases]
    return continuation, samples


class _Tok:
    """The tokenizer surface :func:`replacement_ids` reads: the fixtures' 64-id vocabulary (ids 0-4 special)."""

    vocab_size, special_ids = 64, (0, 1, 2, 3, 4)


def _ours(case, continuation) -> dict:
    rng = np.random.RandomState((case["seed"] + 0) % 2**32)  # Megatron's RandomState(seed + idx), idx 0
    assert len(continuation) == _Tok.vocab_size
    return build_sample([s.numpy() for s in case["sentences"]], rng, seq_length=case["seq_length"], ids=IDS,
                        vocab_ids=replacement_ids(_Tok()), binary_head=case["binary"], target=case["target"],
                        continuation=continuation, masked_lm_prob=case["prob"])


def _has_special(case) -> bool:
    return any(bool((s < 5).any()) for s in case["sentences"])


def test_samples_equal_megatron(fixtures):
    """Tokens, token types, padding mask, masked positions and labels, is_random: exactly Megatron's (integers, no
    tolerance), at every masking probability of the fixtures (0.15 and others), texts with special ids included."""
    _, samples = fixtures
    assert {case["prob"] for case, _ in samples} > {0.15}
    assert sum(_has_special(case) for case, _ in samples) >= 100
    for case, ours in samples:
        assert int(ours["is_random"]) == int(case["is_random"])
        assert torch.equal(ours["padding_mask"], case["padding_mask"] == 0)
        assert torch.equal(ours["tokens"], case["text"])
        assert torch.equal(ours["tokentype_ids"], case["types"])
        assert torch.equal(ours["loss_mask"].long(), case["loss_mask"])
        pos = case["loss_mask"].bool()
        assert torch.equal(ours["labels"][pos], case["labels"][pos])


def test_short_samples_cut_to_target(fixtures):
    """A sample's text (tokens less [CLS] / [SEP]s) never exceeds its target; at least one case is cut short."""
    _, samples = fixtures
    cut = 0
    for case, ours in samples:
        text = int((~ours["padding_mask"]).sum()) - (3 if case["binary"] else 2)
        assert text <= case["target"]
        cut += case["target"] < case["seq_length"] - 3 and text == case["target"]
    assert cut > 0


def test_masking_statistics(fixtures):
    """Megatron's rules, measured: never more than ``mask_count`` tokens (and at least one); a masked
    ``##`` piece always with the start of its word (whole words); n-gram lengths in proportion 1 : 1/2 : 1/3.
    The last is checked on word runs: a masked run of k words is one or more n-grams, so the share of runs
    of one word must lie within 5 standard deviations (binomial, over the runs counted) of at least the
    1-gram share 6/11 minus the runs merged from adjacent n-grams; we only bound it below by 0.4 and above
    by 0.95 (an implementation masking single tokens or only 3-grams falls outside)."""
    continuation, samples = fixtures
    runs = []
    for case, ours in samples:
        tokens = case["text"].numpy()  # the sample ends at its last [SEP] (a [PAD] in the text is no end)
        n = int(np.flatnonzero(case["padding_mask"].numpy())[-1]) + 1
        masked = ours["loss_mask"].numpy()[:n].astype(bool)
        assert masked.sum() <= mask_count(n, case["target"], case["prob"])  # may be 0: a 2-token target allows 0.3
        labels = ours["labels"].numpy()[:n]
        original = np.where(masked, labels, tokens[:n])
        text = ~np.isin(original, (2, 3))
        for i in np.flatnonzero(masked & continuation[original]):
            j = i - 1  # back to the word's start (a [SEP] in between is skipped: Megatron joins across it)
            while j > 0 and not (text[j] and not continuation[original[j]]):
                j -= 1
            assert masked[j:i + 1][text[j:i + 1]].all() or j == 0, "a ## piece masked without its word"
        if case["prob"] != 0.15 or _has_special(case):  # the run statistics below: at pretrain_bert's default,
            continue  # on texts of words only
        words, run = 0, 0
        for i in range(1, n):
            start = not continuation[original[i]] and original[i] not in (2, 3)
            if masked[i] and start:
                run += 1
            elif not masked[i] and run:
                runs.append(run)
                run = 0
        if run:
            runs.append(run)
    runs = np.asarray(runs)
    share = float((runs == 1).mean())
    assert 0.4 < share < 0.95, share
    assert runs.max() >= 3
