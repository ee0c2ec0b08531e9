"""Peak bytes one training step adds, for a GPT whose loss dominates its memory (vocab 32768, hidden 128, 2 layers,
one process, bf16), with the loss's backward writing the logits' gradient in place (``inplace_backward``, what the
models run) and without (a second logits-sized tensor), measured by :func:`omnitron.plan.measure.train_step_peak`.

    PYTHONPATH=. python benchmarks/loss_inplace_peak.py
"""
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import omnitron.core.parallel.tensor.cross_entropy as ce
from omnitron.plan.measure import train_step_peak
argv = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
        "--max-position-embeddings", "128", "--micro-batch-size", "8", "--global-batch-size", "8", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "32768", "--bf16", "--lr", "1e-4"]
orig = ce._VocabParallelCE.apply
res = {}
for inplace in (False, True):
    ce._VocabParallelCE.apply = lambda *a, _i=inplace: orig(*a[:6], _i)
    with tempfile.TemporaryDirectory() as d:
        res[inplace] = train_step_peak(argv, 1, d)[1]
    print("inplace", inplace, "step peak MiB %.3f" % (res[inplace] / 2**20))
print("saved MiB %.3f; logits [8*128, 32768] bf16 = %.3f MiB"
      % ((res[False] - res[True]) / 2**20, 8 * 128 * 32768 * 2 / 2**20))
