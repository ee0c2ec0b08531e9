"""``omnitron preprocess``: tokenize JSONL/text into Megatron-compatible ``.bin``/``.idx`` datasets.

    omnitron preprocess --input corpus.jsonl --json-keys text --tokenizer-type GPT2BPETokenizer \\
        --output-prefix data/corpus --append-eod --workers 2
writes ``data/corpus_text_document.{bin,idx}``. ``--split-sentences`` stores each sentence as its own
sequence (documents kept in the index; BERT data uses them) in ``data/corpus_text_sentence.{bin,idx}``.
``--merge P1 P2 ... --output-prefix OUT`` concatenates existing datasets instead (``--merge DIR``: every dataset
in DIR, sorted by name, as Megatron's ``tools/merge_datasets.py --input DIR``).
"""
from __future__ import annotations

import argparse
import os
import sys


def add_tokenizer_args(p: argparse.ArgumentParser) -> None:
    from omnitron.core.data.config import add_tokenizer_args as add

    add(p)


def tokenizer_kwargs(args: argparse.Namespace) -> dict:
    from omnitron.core.data.tokenizers import tokenizer_kwargs as of

    return of(args)


def register(sub) -> None:
    p = sub.add_parser("preprocess", help="tokenize JSONL/text into .bin/.idx indexed datasets",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", help="input files: JSON lines (.jsonl/.json, or any file whose first line "
                   "is a JSON object, as Megatron reads every input) or plain text")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX_<key>_document.{bin,idx}")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="JSON keys to tokenize (one dataset each)")
    p.add_argument("--append-eod", action="store_true", help="append the end-of-document id to every document")
    p.add_argument("--split-sentences", action="store_true",
                   help="one sequence per sentence (rule-based splitter), documents kept: PREFIX_<key>_sentence")
    p.add_argument("--keep-newlines", action="store_true",
                   help="with --split-sentences: accepted; the splitter always keeps every newline and space (the "
                   "sentences join back to the text)")
    p.add_argument("--lang", default="english", help="--split-sentences language: english only (the rule-based "
                   "splitter's abbreviations are English)")
    p.add_argument("--workers", type=int, default=1, help="tokenizer worker processes")
    p.add_argument("--partitions", type=int, default=1,
                   help="Megatron's document order for its --partitions N: documents dealt round robin to N "
                   "partitions, merged in partition order (0, N, 2N, ... first)")
    p.add_argument("--keep-sequential-samples", action="store_true",
                   help="with --partitions: contiguous partitions, so the documents keep the input order (Megatron's)")
    p.add_argument("--log-interval", type=int, default=1000, help="accepted (Megatron's progress lines); a progress "
                   "bar shows the bytes read instead")
    p.add_argument("--txt-mode", choices=("line", "paragraph"), default="line",
                   help="plain text: one document per line, or per blank-line separated paragraph")
    p.add_argument("--invalid-utf8", choices=("replace", "skip"), default="replace",
                   help="lines that are not valid UTF-8: replace bad bytes with U+FFFD, or skip the line")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--merge", nargs="+", metavar="PREFIX", help="merge these datasets into --output-prefix (a "
                   "directory: all its datasets, sorted by name, as Megatron's tools/merge_datasets.py --input DIR)")
    add_tokenizer_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from omnitron.core.data.indexed import IndexedDatasetError, merge_datasets, prefixes_in
    from omnitron.core.data.preprocess import PreprocessError, preprocess_files
    from omnitron.core.data.tokenizers import TokenizerError

    try:
        if args.merge:
            inputs = [q for p in args.merge for q in (prefixes_in(p) if os.path.isdir(p) else [p])]
            ds = merge_datasets(inputs, args.output_prefix)
            print(f"merged {len(inputs)} datasets into {args.output_prefix}: {ds.num_documents} documents, "
                  f"{ds.num_tokens} tokens")
            return 0
        if not args.input:
            raise PreprocessError("give --input FILE [FILE ...] (or --merge PREFIX ...)")
        if args.split_sentences and args.lang != "english":
            raise PreprocessError(f"--lang {args.lang}: the sentence splitter knows English only; drop --lang, or "
                                  "split the sentences yourself and give one sentence per line")
        stats = preprocess_files(args.input, args.output_prefix, json_keys=args.json_keys,
                                 tokenizer_kwargs=tokenizer_kwargs(args), append_eod=args.append_eod,
                                 workers=args.workers, txt_mode=args.txt_mode, invalid_utf8=args.invalid_utf8,
                                 progress=not args.no_progress, split_sentences=args.split_sentences,
                                 partitions=args.partitions, keep_sequential_samples=args.keep_sequential_samples)
    except (PreprocessError, TokenizerError, IndexedDatasetError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(stats.summary())
    for prefix in stats.outputs:
        print(f"wrote {prefix}.bin, {prefix}.idx")
    return 0
