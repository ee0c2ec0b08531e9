"""Writes ``fixtures.json`` beside this file WITH MEGATRON-LM'S OWN CODE: GPT samples under Megatron's pad rule.

Needs a Megatron-LM checkout (snapshot d98e8a64dd was used) with its C++ dataset helpers built
(``make -C megatron/core/datasets``), numpy and torch; it runs on CPU, offline. Run from the omnitron root:

    MEGATRON_LM=/path/to/Megatron-LM python tests/data/megatron_pad/make_fixtures.py

omnitron is not imported. One corpus (:func:`corpus_documents`, which the test repeats) holds the pad candidate
``PAD`` and the eod ``EOD`` many times; Megatron's GPTDataset is built over it with a tokenizer stub reporting
each case's ``pad`` (None: no pad), and the first samples' tokens, labels, loss mask and position ids are stored;
the ``null_*`` cases read Megatron's own NullTokenizer instead, built by its ``build_tokenizer`` from
``--tokenizer-type NullTokenizer --vocab-size VOCAB --null-tokenizer-pad-id PAD`` (its pad and its eod, VOCAB - 1).
Megatron's rule (megatron_dataset.py): a pad equal to eos/eod is reset to -1 (never in the data) unless
``allow_ambiguous_pad_tokens``; gpt_dataset.py zeroes the loss where the label is pad and maps pad ids to 0.

Megatron at d98e8a6 has an aliasing bug there: without --reset-position-ids / --reset-attention-mask /
--eod-mask-loss it caches the FIRST sample's loss-mask tensor itself and then zeroes that sample's pad labels in
it, so every later sample of the dataset also loses the loss at those positions. The samples stored are read with
that cache off (each sample's own mask, what the code intends); ``megatron_cached_loss_mask`` keeps what Megatron
returns as it runs, so the difference stays on record.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import typing

import numpy as np

if not hasattr(typing, "override"):
    typing.override = lambda f: f

HERE = os.path.dirname(os.path.abspath(__file__))
SEQ, FIRST, EOD, PAD, VOCAB = 16, 8, 50, 7, 51
# name -> (tokenizer pad, allow_ambiguous_pad_tokens, eod_mask_loss, reset_position_ids, seed)
CASES = {
    "own_pad": (PAD, False, False, False, 1234),
    "own_pad_eod_flags": (PAD, False, True, True, 5),
    "pad_is_eod": (EOD, False, False, False, 1234),
    "pad_is_eod_allowed": (EOD, True, True, False, 1234),
    "no_pad": (None, False, False, False, 1234),
    "no_pad_allowed": (None, True, False, False, 1234),
}
NULL_CASES = {  # Megatron's NullTokenizer (--vocab-size VOCAB: eod VOCAB - 1 = EOD) with --null-tokenizer-pad-id
    "null_pad_id": (PAD, False, False, False, 1234),
    "null_pad_id_is_eod": (EOD, False, False, False, 1234),
    "null_pad_id_is_eod_allowed": (EOD, True, False, False, 1234),
    "null_pad_id_default": (-1, False, False, False, 1234),
}


def corpus_documents(num_docs: int = 60, seed: int = 3) -> list[np.ndarray]:
    """Documents of 1..30 ids below 10 (PAD among them) and an eod at the end, from RandomState(seed)."""
    rng = np.random.RandomState(seed)
    return [np.append(rng.randint(0, 10, n), EOD).astype(np.int32) for n in rng.randint(1, 31, num_docs)]


class _Tokenizer:  # what Megatron's GPTDataset reads of a tokenizer
    eod, eos, vocab_size, unique_identifiers = EOD, EOD, VOCAB, {"class": "fixture"}

    def __init__(self, pad):
        self.pad = pad


def _null_tokenizer(pad_id):
    """Megatron's NullTokenizer as its build_tokenizer makes it from --vocab-size VOCAB --null-tokenizer-pad-id."""
    from types import SimpleNamespace

    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    args = SimpleNamespace(tokenizer_type="NullTokenizer", vocab_size=VOCAB, null_tokenizer_eod_id=None,
                           null_tokenizer_pad_id=pad_id, pad_vocab_size=False, metadata_path=None, rank=0)
    tok = build_tokenizer(args)
    assert (tok.eod, tok.pad) == (EOD, pad_id)
    return tok


def _build(prefix, cache, tokenizer, allow, eod_mask_loss, reset_position_ids, seed):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    cfg = GPTDatasetConfig(random_seed=seed, sequence_length=SEQ, path_to_cache=cache, tokenizer=tokenizer,
                           reset_position_ids=reset_position_ids, reset_attention_mask=False,
                           eod_mask_loss=eod_mask_loss, allow_ambiguous_pad_tokens=allow,
                           blend=([prefix], None), split="1")
    return BlendedMegatronDatasetBuilder(GPTDataset, [40, 0, 0], lambda: True, cfg).build()[0]


def main() -> None:
    sys.path.insert(0, os.environ["MEGATRON_LM"])
    import logging
    import warnings

    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    root = tempfile.mkdtemp()
    prefix = os.path.join(root, "corpus")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for doc in corpus_documents():
        builder.add_document(doc, [len(doc)])
    builder.finalize(prefix + ".idx")
    out = {"megatron": "d98e8a64dd", "seq_length": SEQ, "eod": EOD, "vocab_size": VOCAB, "cases": {}}
    tokenizers = {name: _Tokenizer(case[0]) for name, case in CASES.items()}
    tokenizers.update({name: _null_tokenizer(case[0]) for name, case in NULL_CASES.items()})
    for name, (pad, allow, eml, rpi, seed) in {**CASES, **NULL_CASES}.items():
        tok = tokenizers[name]
        ds = _build(prefix, os.path.join(root, "cache", name), tok, allow, eml, rpi, seed)
        cached = [ds[i]["loss_mask"].tolist() for i in range(FIRST)]  # Megatron as it runs (see below)
        ds = _build(prefix, os.path.join(root, "cache", name), tok, allow, eml, rpi, seed)
        ds.masks_and_position_ids_are_cacheable = False  # each sample's own mask, see the note below
        samples = [ds[i] for i in range(FIRST)]
        out["cases"][name] = {"pad": pad, "null_tokenizer": name in NULL_CASES, "allow_ambiguous_pad_tokens": allow,
                              "eod_mask_loss": eml,
                              "reset_position_ids": rpi, "seed": seed, "megatron_cached_loss_mask": cached,
                              "samples": [{k: s[k].tolist() for k in ("tokens", "labels", "loss_mask", "position_ids")}
                                          for s in samples]}
    with open(os.path.join(HERE, "fixtures.json"), "w") as f:
        json.dump(out, f, separators=(",", ":"))


if __name__ == "__main__":
    main()
