"""The DeepSeek-V3 presets: ``deepseek_v3`` has the released model's size (counted on the meta device) and
``deepseek_v3_tiny`` (MLA, DeepSeek routing with the expert bias, shared experts, a dense first layer) trains
through ``omnitron train``, its expert bias moving and saved with the checkpoint."""
from __future__ import annotations

import os

import pytest
import torch

from omnitron.core.models.family import get_family
from omnitron.core.models.gpt.config import num_parameters
from omnitron.testing.parity import ADAM_LOOP_REL

# DeepSeek-V3's main model in the released checkpoint (its config.json; the model card's "671B"), without the
# multi-token-prediction module (layer 61: the checkpoint's 685B total; --mtp-num-layers 1 builds it). It
# counts the 58 MoE layers' 256-entry routing bias (`e_score_correction_bias`): a buffer here, as in Megatron.
RELEASED_MAIN = 671_026_419_200
BIAS_ENTRIES = 58 * 256


def _preset(name: str):
    return get_family("gpt").presets[name]()


def test_deepseek_v3_total_and_active_parameters():
    """The formula (held equal to the meta-device model below) against the released total; the parameters one
    token goes through (all but 248 of each MoE layer's 256 routed experts) are the paper's 37B activated."""
    cfg = _preset("deepseek_v3")
    total = num_parameters(cfg)
    assert total + BIAS_ENTRIES == RELEASED_MAIN
    expert = 3 * cfg.hidden_size * cfg.moe_ffn_hidden_size  # SwiGLU: gate, up, down
    active = total - 58 * (cfg.num_experts - cfg.moe_router_topk) * expert
    assert 37e9 <= active < 38e9, active  # 37,552,282,624


def _meta_counts(cfg) -> tuple[int, int]:
    from omnitron.core.models.gpt import GPTModel
    from omnitron.core.parallel.groups import ParallelGroups

    with torch.device("meta"):
        model = GPTModel(cfg, ParallelGroups.single())
    assert all(p.device.type == "meta" for p in model.parameters())
    biases = sum(b.numel() for n, b in model.named_buffers() if n.endswith("expert_bias"))
    return sum(p.numel() for p in model.parameters()), biases


def test_tiny_meta_count_equals_formula():
    cfg = _preset("deepseek_v3_tiny")
    params, biases = _meta_counts(cfg)
    assert params == num_parameters(cfg) and biases == 3 * cfg.num_experts


@pytest.mark.slow  # ~70 s to build 14848 experts on a loaded 2-core machine
def test_deepseek_v3_meta_count_equals_released():
    params, biases = _meta_counts(_preset("deepseek_v3"))
    assert params + biases == RELEASED_MAIN and biases == BIAS_ENTRIES


def test_deepseek_v3_tiny_trains(tmp_path):
    """A few steps from the preset (sequence and vocabulary cut for time): finite losses, and every MoE layer's
    expert bias moved by the update rate and saved in the checkpoint."""
    from omnitron.core.checkpoint.io import read_shard
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train
    from omnitron.backends import get_backend

    args = ["--model", "deepseek_v3_tiny", "--seq-length", "32", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "64", "--num-workers", "0", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "3", "--lr", "1e-3", "--log-interval", "100", "--no-tensorboard", "--eval-interval", "0",
            "--save", str(tmp_path / "ckpt"), "--save-interval", "3", "--ckpt-format", "torch",
            "--log-dir", str(tmp_path), "--moe-router-bias-update-rate", "0.01"]
    settings = parse_settings(args, 1)
    assert settings.model.multi_latent_attention and settings.model.moe_router_enable_expert_bias
    losses = train(settings, get_backend("cpu"))["losses"]
    assert sorted(losses) == [1, 2, 3] and all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    # torch format: in the model's state dict (torch_dist keeps it in the rank state: test_resume_restores_...)
    saved = read_shard(os.path.join(tmp_path, "ckpt", "iter_0000003"), 0)["model"][0]
    biases = [v for k, v in saved.items() if k.endswith("router.expert_bias")]
    assert len(biases) == 3  # layers 1-3 (layer 0 is dense)
    for b in biases:  # three sign steps of 0.01: each entry is a multiple of 0.01 in [-0.03, 0.03], not all 0
        steps = b / 0.01
        assert b.abs().max() <= 0.03 + 1e-6 and torch.allclose(steps, steps.round(), atol=1e-4) and b.any()


def _tiny_args(tmp: str, *extra: str) -> list[str]:
    return ["--model", "deepseek_v3_tiny", "--seq-length", "32", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "64", "--num-workers", "0", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "3", "--lr", "1e-2", "--lr-warmup-iters", "0", "--lr-decay-style", "constant",
            "--log-interval", "100",
            "--no-tensorboard", "--eval-interval", "0", "--log-dir", tmp, "--moe-router-bias-update-rate", "0.05",
            *extra]


LAYOUTS = {"tp2_sp": ("--tensor-model-parallel-size", "2", "--sequence-parallel"),
           "pp2": ("--pipeline-model-parallel-size", "2"),
           "ep2": ("--expert-model-parallel-size", "2")}


def _train_layouts(tmp: str) -> dict[str, dict]:
    """Every rank: the tiny preset under each two-process layout (one spawn for all)."""
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.training.loop import train
    from omnitron.testing.training import settings_in

    return {name: train(settings_in(_tiny_args(f"{tmp}/{name}", *lay), dist.get_world_size(), torch.float64),
                        get_backend())["losses"] for name, lay in LAYOUTS.items()}


@pytest.mark.slow  # three two-process trainings of the tiny preset: 30 s on the loaded 2-core machine
@pytest.mark.multiprocess
def test_deepseek_v3_tiny_layouts_match_one_process(tmp_path):
    """MLA (tp2 + sp, pp2) and the routing with its expert bias (ep2, dp2 counts) train a float64 model as one
    process does: three steps' losses agree to ADAM_LOOP_REL (the expert bias moves by a sign, so a count that differed
    would change the routing and the loss far more)."""
    from omnitron.backends import get_backend
    from omnitron.core.training.loop import train
    from omnitron.testing.distributed import run_distributed
    from omnitron.testing.training import settings_in

    one = train(settings_in(_tiny_args(str(tmp_path / "one")), 1, torch.float64), get_backend("cpu"))["losses"]
    for rank_losses in run_distributed(_train_layouts, 2, str(tmp_path)):
        for name, losses in rank_losses.items():
            assert losses.keys() == one.keys(), name
            for it in one:
                assert losses[it] == pytest.approx(one[it], rel=ADAM_LOOP_REL), (name, it, losses, one)


@pytest.mark.slow  # three short trainings: 40 s on the loaded 2-core machine
@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_resume_restores_the_expert_bias(tmp_path, fmt):
    """Stopping after step 2 and resuming gives step 3 the uninterrupted run's loss bit for bit: the expert
    bias (which steers step 3's routing) comes back from the checkpoint in both formats."""
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    def run(name, *extra):
        args = _tiny_args(str(tmp_path / name), "--ckpt-format", fmt, *extra)
        return train(parse_settings(args, 1), get_backend("cpu"))["losses"]

    whole = run("whole")
    ckpt = str(tmp_path / "ckpt")
    run("first", "--exit-interval", "2", "--save", ckpt)  # the whole run's schedule, stopped (and saved) at 2
    resumed = run("resumed", "--load", ckpt)
    assert resumed[3] == whole[3], (resumed, whole)


FP8_RECIPES = ("tensorwise", "delayed", "blockwise")
EXPERT_LAYOUTS = {"ep2_dp4": ("--expert-model-parallel-size", "2"),
                  "tp2_sp_ep2_etp2": ("--tensor-model-parallel-size", "2", "--sequence-parallel",
                                      "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2")}


def _fp8_args(tmp: str, recipe: str | None, *layout: str) -> list[str]:
    fp8 = () if recipe is None else ("--fp8-format", "hybrid", "--fp8-recipe", recipe)
    return _tiny_args(tmp, "--global-batch-size", "8", *fp8, *layout)


def _train_fp8_layouts(tmp: str) -> dict:
    """Every rank of 4: the tiny preset (MLA, sigmoid routing with expert bias, grouped top-k, shared expert,
    dense first layer) under each expert layout, wide and with each FP8 recipe (one spawn for all)."""
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    return {(name, r): train(parse_settings(_fp8_args(f"{tmp}/{name}-{r}", r, *lay), dist.get_world_size()),
                             get_backend())["losses"]
            for name, lay in EXPERT_LAYOUTS.items() for r in (None, *FP8_RECIPES)}


@pytest.mark.slow  # eight four-process trainings of the tiny preset: about a minute on the 2-core machine
@pytest.mark.multiprocess
def test_deepseek_routing_under_ep_etp_with_fp8_within_the_fp8_bound(tmp_path):
    """DeepSeek routing (the expert bias moving every step) under ep2 x dp4 and tp2 + sp x ep2 x etp2, with
    each FP8 recipe, trains as one process within the FP8 bound.

    Wide runs (no FP8) must equal one process to float32 reduction order (1e-5 relative, as the layouts test
    above). FP8 runs cannot be equal: a per-tensor / per-block scale is a statistic of the rows a GEMM sees,
    and an expert or a tp shard sees other rows than the one-process run. Both runs round the same operands
    to e4m3/e5m2 after scaling, so the parallel run's deviation from the wide one-process run is another
    realisation of a sum of rounding errors of the same number and sizes as the one-process FP8 run's:
    bound = 3 x the one-process FP8 gap (1 for its own size, x2 for an independent realisation whose signs
    need not agree, rounded up for the three steps sampled; tests/parallel/test_expert_fp8.py derives the
    same bound). A routing count or bias update that differed between layouts moves the loss by far more."""
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train
    from omnitron.testing.distributed import run_distributed

    def one(recipe):
        return train(parse_settings(_fp8_args(str(tmp_path / f"one-{recipe}"), recipe), 1),
                     get_backend("cpu"))["losses"]

    wide = one(None)
    gaps = {}
    for r in FP8_RECIPES:
        ref = one(r)
        gaps[r] = max(abs(ref[i] - wide[i]) / abs(wide[i]) for i in wide)
        assert 0 < gaps[r] < 0.05, (r, gaps[r])  # FP8 ran, and trains the same model
    for rank_losses in run_distributed(_train_fp8_layouts, 4, str(tmp_path)):
        for (name, recipe), losses in rank_losses.items():
            assert losses.keys() == wide.keys(), (name, recipe)
            worst = max(abs(losses[i] - wide[i]) / abs(wide[i]) for i in wide)
            bound = 1e-5 if recipe is None else 3 * gaps[recipe]
            assert worst <= bound, f"{name} {recipe}: {worst:.2e} from one process (bound {bound:.2e})"
