"""Writes ``fixtures.json`` beside this file WITH MEGATRON-LM'S OWN tools/preprocess_data.py: the ids it stores for
BERT WordPiece text holding literal special tokens ("[SEP]", "[MASK]", ...).

Needs a Megatron-LM checkout (snapshot d98e8a64dd was used), numpy, torch and transformers; it runs on CPU, offline.
Run from the omnitron root:

    MEGATRON_LM=/path/to/Megatron-LM python tests/data/megatron_wordpiece/make_fixtures.py

omnitron is not imported. Megatron's BertWordPieceLowerCase / BertWordPieceCase are ``AutoTokenizer`` of the hub
names bert-large-uncased / bert-large-cased with ``--vocab-file``; offline, a folder of that name in the working
directory holding what the hub's does (the model type, ``do_lower_case``) stands in for the hub. Each kind runs
twice: Megatron's default, whose tokenize adds the tokenizer's own [CLS] ... [SEP] around every text
(``include_special_tokens``), and with ``--tokenizer-hf-no-include-special-tokens``.
"""
from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import tempfile
import typing

if not hasattr(typing, "override"):
    typing.override = lambda f: f

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "whale", "sea", "##s", "[", "]", "sep", "cls", "mask",
         "s", "##e", "##p", "e", "p", "c", "##l", "hello", "world", "a", "##a", "pad", "Whale", "The", "call", "me"]
DOCUMENTS = ["the whale [SEP] the sea", "[CLS] hello [MASK] world [PAD]", "the [sep] whales", "The Whale[SEP]sea",
             "[UNK] a [ SEP ] call me", "Call me [MASK][MASK]", "[SEP]"]


def _run(kind: str, include_special: bool) -> list[list[int]]:
    """One preprocess_data.py run (a child process: its tokenizer is global) -> the stored sequences."""
    out = subprocess.run([sys.executable, __file__, kind, str(int(include_special))], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _child(kind: str, include_special: bool) -> None:
    sys.path.insert(0, os.environ["MEGATRON_LM"])
    for name, lower in (("bert-large-uncased", True), ("bert-large-cased", False)):
        os.makedirs(name, exist_ok=True)
        json.dump({"model_type": "bert"}, open(os.path.join(name, "config.json"), "w"))
        json.dump({"do_lower_case": lower}, open(os.path.join(name, "tokenizer_config.json"), "w"))
    with open("vocab.txt", "w") as f:
        f.write("\n".join(VOCAB) + "\n")
    with open("in.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in DOCUMENTS)
    sys.argv = ["preprocess_data.py", "--input", "in.jsonl", "--output-prefix", "out", "--tokenizer-type", kind,
                "--vocab-file", "vocab.txt", "--workers", "1", "--append-eod"]
    if not include_special:
        sys.argv.append("--tokenizer-hf-no-include-special-tokens")
    runpy.run_path(os.path.join(os.environ["MEGATRON_LM"], "tools", "preprocess_data.py"), run_name="__main__")
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    data = IndexedDataset("out_text_document")
    print(json.dumps([data[i].tolist() for i in range(len(data))]))


def main() -> None:
    out = {"megatron": "d98e8a64dd", "vocab": VOCAB, "documents": DOCUMENTS, "cases": {}}
    for kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        for include_special in (False, True):
            with tempfile.TemporaryDirectory() as cwd:
                os.chdir(cwd)
                out["cases"][f"{kind}-{'default' if include_special else 'no_include_special'}"] = _run(
                    kind, include_special)
    os.chdir(HERE)
    with open(os.path.join(HERE, "fixtures.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) == 3:
        _child(sys.argv[1], bool(int(sys.argv[2])))
    else:
        main()
