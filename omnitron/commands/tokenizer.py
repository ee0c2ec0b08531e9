"""``omnitron tokenizer``: train a byte-level BPE (``train``) or inspect a tokenizer (``encode``).

    omnitron tokenizer train --input corpus.txt --vocab-size 8000 --output out/tokenizer.json
    omnitron tokenizer encode --text "Hello world"              # bundled GPT-2 BPE by default
The trained ``tokenizer.json`` loads with ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model``.
"""
from __future__ import annotations

import argparse
import os
import sys

SPECIAL_TOKENS = ("<|endoftext|>", "<pad>")


def register(sub) -> None:
    p = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer, or encode text with one",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tsub = p.add_subparsers(dest="tokenizer_command", metavar="ACTION")
    t = tsub.add_parser("train", help="train a byte-level BPE on text/JSONL files; write tokenizer.json")
    t.add_argument("--input", nargs="+", required=True, help="text files (.jsonl: the --json-key field of each line)")
    t.add_argument("--json-key", default="text")
    t.add_argument("--vocab-size", type=int, required=True, help="vocabulary size including special tokens")
    t.add_argument("--min-frequency", type=int, default=2)
    t.add_argument("--output", required=True, help="path of the tokenizer.json to write")
    t.set_defaults(func=run_train)
    e = tsub.add_parser("encode", help="print the ids of --text")
    e.add_argument("--text", required=True)
    from omnitron.commands.preprocess import add_tokenizer_args

    add_tokenizer_args(e)
    e.set_defaults(func=run_encode)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _texts(paths: list[str], json_key: str):
    import json

    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if path.endswith((".jsonl", ".json")):
                    try:
                        text = json.loads(line).get(json_key)
                    except (ValueError, AttributeError):
                        continue
                    if isinstance(text, str):
                        yield text
                else:
                    yield line


def train_bpe(paths: list[str], vocab_size: int, output: str, *, json_key: str = "text", min_frequency: int = 2):
    """Train a GPT-2 style byte-level BPE with ``<|endoftext|>`` (eod) and ``<pad>``; save ``output``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(f"--input: no such file(s) {missing}")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(f"--vocab-size {vocab_size} is below the 256 byte symbols + {len(SPECIAL_TOKENS)} special "
                         f"tokens; use at least {len(alphabet) + len(SPECIAL_TOKENS)}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, initial_alphabet=alphabet,
                                  special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    seen = [0]  # characters of text read: an empty corpus trains a vocabulary of the byte symbols alone

    def counted():
        for text in _texts(paths, json_key):
            seen[0] += len(text.strip())
            yield text
    tok.train_from_iterator(counted(), trainer=trainer)
    if not seen[0]:
        where = f" (a .json / .jsonl line's text is its {json_key!r} field: --json-key)" if any(
            p.endswith((".jsonl", ".json")) for p in paths) else ""
        raise ValueError(f"--input {' '.join(paths)} holds no text to train on{where}")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    tok.save(output)
    return tok


def run_train(args: argparse.Namespace) -> int:
    try:
        tok = train_bpe(args.input, args.vocab_size, args.output, json_key=args.json_key,
                        min_frequency=args.min_frequency)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    size = tok.get_vocab_size()
    print(f"wrote {args.output}: vocabulary {size} (special tokens {', '.join(SPECIAL_TOKENS)})")
    if size < args.vocab_size:
        print(f"note: the corpus allowed {size} tokens of the --vocab-size {args.vocab_size} asked for (every pair "
              f"seen at least --min-frequency {args.min_frequency} times was merged): a larger corpus gives more",
              file=sys.stderr)
    return 0


def run_encode(args: argparse.Namespace) -> int:
    from omnitron.commands.preprocess import tokenizer_kwargs
    from omnitron.core.data.tokenizers import TokenizerError, build_tokenizer

    try:
        tok = build_tokenizer(**tokenizer_kwargs(args))
    except TokenizerError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    ids = tok.encode(args.text)
    print(f"{tok!r}\nids: {ids}\ndecoded: {tok.decode(ids)!r}")
    return 0
