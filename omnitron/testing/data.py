"""Small indexed datasets built in tests from token ids."""
from __future__ import annotations

import numpy as np

from omnitron.core.data import IndexedDataset, IndexedDatasetBuilder
from omnitron.core.data.indexed import data_file, index_file


def write_documents(path, docs) -> IndexedDataset:
    """Indexed dataset at ``path`` from documents given as lists of sentences (id arrays): one
    sequence per sentence, document boundaries in the index, as ``preprocess --split-sentences`` writes."""
    b = IndexedDatasetBuilder(data_file(str(path)), np.uint16)
    for sentences in docs:
        b.add_document(np.concatenate(sentences), [len(s) for s in sentences])
    b.finalize(index_file(str(path)))
    return IndexedDataset(str(path))


def llama_style_tokenizer(directory) -> str:
    """A Llama-style tokenizer directory (the bundled Moby Dick BPE plus ``<s>`` / ``</s>`` and a post-processor
    that puts ``<s>`` before every text, as Llama's tokenizer.json does; ``</s>`` the eos of its
    tokenizer_config.json) that ``transformers.AutoTokenizer`` and ``--tokenizer-model`` both read; returns it."""
    import json
    import os

    from tokenizers import Tokenizer, processors

    from omnitron.core.data.moby import CORPUS_DIR

    tok = Tokenizer.from_file(str(CORPUS_DIR.parent / "moby_dick_bpe" / "tokenizer.json"))
    tok.add_special_tokens(["<s>", "</s>"])
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}, f)
    return str(directory)


def random_corpus(prefix: str, vocab: int, documents: tuple[int, int] = (20, 60),
                  length: tuple[int, int] = (3, 40)) -> IndexedDataset:
    """Indexed dataset at ``prefix`` of a random number of documents (``documents``: the range) of random token ids
    below ``vocab`` and random lengths (``length``: the range), drawn from a fresh seed."""
    import random

    rng = np.random.default_rng(random.randrange(2**32))
    b = IndexedDatasetBuilder(data_file(prefix), np.int32)
    for _ in range(int(rng.integers(*documents))):
        b.add_document(rng.integers(0, vocab - 1, int(rng.integers(*length))))
    b.finalize(index_file(prefix))
    return IndexedDataset(prefix)
