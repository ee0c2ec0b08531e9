"""Tokenizer and data checks the launcher runs before any worker starts.

A tokenizer that cannot be built, a ``--data-path`` dataset that is malformed or holds ids outside the
tokenizer's vocabulary, or synthetic samples that cannot take the sizes given, is known before training:
raised here as one ConfigError line from the launcher, instead of the same traceback from every rank after
the model was built (and an ``IndexError`` in the embedding a few steps later when nothing checked).
"""
from __future__ import annotations


def check_tokenizer_and_data(settings) -> None:
    """Build the run's tokenizer and check every ``--data-path`` (and per-split path) dataset against it (the vocabulary
    scan is cached: workers reuse it). Raises ConfigError naming the flag, the file and the fix."""
    from omnitron.core.config.parallel import ConfigError
    from omnitron.core.data import TokenizerError, build_tokenizer
    from omnitron.core.data.tokenizers import tokenizer_kwargs
    from omnitron.core.data.builder import DataError, check_vocabulary
    from omnitron.core.data.config import default_cache_dir, parse_data_path
    from omnitron.core.data.indexed import IndexedDataset, IndexedDatasetError
    from omnitron.core.models.family import family_of

    d, family = settings.data, family_of(settings.model)
    try:
        tokenizer = build_tokenizer(**tokenizer_kwargs(d), **family.tokenizer_kwargs(settings.model))
    except TokenizerError as err:
        raise ConfigError(f"--tokenizer-type {d.tokenizer_type}: {err}") from None
    if family.synthetic_data:  # drawn in memory: no files, but a size the samples cannot take is known now
        try:
            family.build_datasets(settings, tokenizer, train_samples=1, valid_samples=0, test_samples=0)
        except ValueError as err:  # its message names the flag and the fix
            raise ConfigError(str(err)) from None
    if d.mock_data or family.synthetic_data:  # samples made in memory: no files to check
        return
    cache_dir = d.data_cache_path or default_cache_dir()
    for flag, paths in d.path_flags():
        for _, prefix in parse_data_path(paths):
            try:
                check_vocabulary(IndexedDataset(prefix), tokenizer, cache_dir, allow_build=True)
            except (DataError, IndexedDatasetError) as err:
                raise ConfigError(f"{flag} {prefix}: {err}") from None
