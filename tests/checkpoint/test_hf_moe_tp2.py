"""A Hugging Face MoE model imported at tensor parallel 2 is read by every reader of checkpoints.

``import-hf --tensor-model-parallel-size 2`` of a tiny random float64 ``DeepseekV3ForCausalLM`` (the config of
:mod:`tests.checkpoint.test_hf_moe`: MLA, a dense first layer, 8 grouped experts and a shared expert) writes whole
experts on every tp rank and records ``expert_tensor_parallel_size: 1`` in its layout (its flat config holds no run
settings). Readers used to take the experts' split from the flat config, else assume tp, and refused the import as
"saved with expert tensor parallelism 2". Here the same checkpoint:

- ``export-hf``s back to the transformers files bit for bit,
- ``checkpoint inspect``s, listing whole experts,
- loads for inference in one process and at tp2 with the experts split over etp 2, giving transformers' logits,
- starts a 2-rank ``--finetune`` run at tp2 (experts split, etp 2 by default: resharded on load) whose weights are
  transformers' own.

Tolerance of the logits: test_hf_moe's error analysis (float64 throughout except the routers' float32 logits:
at most ~1.5e-6 of the logits' maximum; bound 5e-6, TOL there). The tp2 forward adds float64 reductions in another
order (1e-15). The finetune run keeps float32 weights: float32 of the float64 tensors, compared exactly (lr 0, no
weight decay: Adam's update is 0 exactly).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from omnitron.cli import main as cli  # noqa: E402
from omnitron.core.checkpoint.hf import config_from_hf, read_hf_dir, state_to_hf  # noqa: E402
from omnitron.core.checkpoint.reshard import read_full_state  # noqa: E402
from omnitron.testing.distributed import REFERENCE_KERNELS, run_distributed  # noqa: E402
from tests.checkpoint.test_hf_moe import HF_CONFIGS, V, _close, _hf_logits, _randomize  # noqa: E402

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(transformers model, its directory, the tp2 import's ``iter_0000000``)."""
    root = tmp_path_factory.mktemp("moe_tp2")
    hf = transformers.AutoModelForCausalLM.from_config(HF_CONFIGS["deepseek_v3"](), dtype=torch.float64,
                                                       experts_implementation="eager").eval()
    _randomize(hf, 11)
    hf.save_pretrained(root / "hf")
    assert cli(["checkpoint", "import-hf", "--hf-dir", str(root / "hf"), "--save", str(root / "ck"),
                "--tensor-model-parallel-size", "2"]) == 0
    path = str(root / "ck" / "iter_0000000")
    layout = json.loads((root / "ck" / "iter_0000000" / "metadata.json").read_text())["layout"]
    assert layout["tensor_model_parallel_size"] == 2 and layout["expert_tensor_parallel_size"] == 1
    return hf, str(root / "hf"), path


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(seed))


def test_tp2_import_exports_back_bit_for_bit(imported, tmp_path):
    _, d, path = imported
    assert cli(["checkpoint", "export-hf", "--load", path, "--out", str(tmp_path / "out")]) == 0
    (c0, s0), (c1, s1) = read_hf_dir(d), read_hf_dir(str(tmp_path / "out"))
    assert sorted(s1) == sorted(s0)
    for name, t in s0.items():  # NOTE: transformers keeps the router's weight in float32 in a float64 model,
        assert torch.equal(s1[name].double(), t.double()), name  # omnitron at the model's dtype (exact upcast)
        assert s1[name].dtype == t.dtype or t.dtype == torch.float32, name
    assert config_from_hf(c1) == config_from_hf(c0)


def test_tp2_import_inspects(imported, capsys):
    """inspect lists every expert whole (fc1 of SwiGLU: 2 x 16 rows, fc2: 16 columns) and counts every weight of
    the transformers model."""
    hf, _, path = imported
    assert cli(["checkpoint", "inspect", path]) == 0
    out = capsys.readouterr().out
    assert "layout       tp2 pp1 dp1 (2 shards)" in out and "weights only (imported)" in out
    rows = {line.split()[0]: line.split(None, 1)[1] for line in out.splitlines() if line.startswith("  decoder.")}
    experts = {n: r for n, r in rows.items() if ".mlp.experts." in n}
    assert len(experts) == 2 * 8, sorted(rows)
    assert all(r.split(")")[0] + ")" == ("(32, 32)" if "fc1" in n else "(32, 16)") for n, r in experts.items())
    count = sum(p.numel() for p in hf.parameters()) + hf.model.layers[1].mlp.gate.e_score_correction_bias.numel()
    assert f"parameters   {count:,}" in out  # the routing bias too


def test_tp2_import_gives_transformers_logits_in_one_process(imported):
    """What export-hf and generate read (read_full_state of the tp2 shards) in a float64 model."""
    from omnitron.backends import get_backend
    from omnitron.core.models.gpt import GPTModel
    from omnitron.core.models.gpt.state import shard_full_state
    from omnitron.core.parallel.groups import ParallelGroups

    hf, _, path = imported
    model = GPTModel(config_from_hf(hf.config.to_dict()), ParallelGroups.single(), backend=get_backend("cpu")).eval()
    shard_full_state(model, read_full_state(path, with_optimizer=False).model, ParallelGroups.single())
    tokens = _tokens(12)
    with torch.no_grad():
        ours = model(tokens=tokens)[..., :V].transpose(0, 1).double()
    _close(ours, _hf_logits(hf, tokens))


def _etp2_worker(path: str, tokens: torch.Tensor) -> torch.Tensor:
    """This rank's vocabulary slice of the logits of a float64 tp2 model (experts split over etp 2: the default)
    loaded from the whole experts of ``path`` (inference's sharded loading: read_full_state, then this rank's cut)."""
    from omnitron.backends import get_backend
    from omnitron.core.checkpoint.io import read_metadata
    from omnitron.core.checkpoint.reshard import model_config, needed_owners
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.models.gpt import GPTModel
    from omnitron.core.models.gpt.state import shard_full_state
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.parallel.tensor.sharding import to_device

    torch.set_num_threads(1)
    groups = ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=2), backend=get_backend())
    assert groups.etp.size == 2
    model = GPTModel(model_config(read_metadata(path)["model"]), groups).eval()
    assert any(getattr(p, "tensor_model_parallel", False) for n, p in model.named_parameters() if ".experts." in n)
    shard_full_state(model, read_full_state(path, owners=needed_owners([model]), with_optimizer=False).model, groups)
    model = to_device(model, groups.backend.device())  # where the groups' collectives run (sim: not the host)
    with torch.no_grad():
        return model(tokens=tokens.to(groups.backend.device())).transpose(0, 1).contiguous().cpu()


def test_tp2_import_gives_transformers_logits_with_experts_split(imported):
    hf, _, path = imported
    tokens = _tokens(13)
    ranks = run_distributed(_etp2_worker, 2, path, tokens, env=REFERENCE_KERNELS)
    _close(torch.cat(ranks, -1)[..., :V].double(), _hf_logits(hf, tokens))


def _finetune_worker(load: str, root: str) -> tuple[dict, list, int]:
    """A 2-rank tp2 ``--finetune`` run of one step at lr 0 from ``load`` (model flags from the checkpoint); its
    gathered full weights, its losses and the experts' tp split it ran."""
    from omnitron.core.models.gpt.state import gather_full_state
    from omnitron.testing.training import worker_runner

    def args(layout, save, extra):
        return [*layout, "--load", load, "--use-checkpoint-args", "--finetune", "--mock-data", "--num-workers", "0",
                "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--lr", "0.0",
                "--weight-decay", "0", "--seq-length", "16", "--no-tensorboard", "--log-interval", "1",
                "--data-cache-path", os.path.join(root, "cache"), *extra]

    res = worker_runner(args, root)(["--tensor-model-parallel-size", "2"], "unused")  # no --save
    c = res["components"]
    return gather_full_state(c.modules[0], c.groups), list(res["losses"].values()), c.groups.etp.size


def test_tp2_import_finetunes_at_tp2(imported, tmp_path):
    """Training at tp2 (etp 2, the default: the import's etp 1 is resharded on load) starts from transformers'
    weights: the run's gathered weights, in the export's names, are transformers' tensors in float32."""
    from safetensors.torch import load_file

    hf, d, path = imported
    got, losses, etp = run_distributed(_finetune_worker, 2, os.path.dirname(path), str(tmp_path),
                                       env=REFERENCE_KERNELS)[0]
    assert etp == 2 and len(losses) == 1 and torch.isfinite(torch.as_tensor(losses)).all()
    cfg = config_from_hf(hf.config.to_dict())
    biases = {n: t for n, t in read_full_state(path, with_optimizer=False).model.items() if n.endswith("_bias")}
    got = {**got, **biases}  # the routers' expert_bias buffers (no parameters)
    ref = load_file(os.path.join(d, "model.safetensors"))  # what save_pretrained wrote
    ours = state_to_hf(got, cfg)
    assert sorted(ours) == sorted(ref)
    for name, t in ref.items():
        assert torch.equal(ours[name].float(), t.float()), name
