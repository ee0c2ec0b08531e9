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
