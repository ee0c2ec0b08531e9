"""A checkpoint whose model weights' names are not this model's is refused in one line naming them and what to do,
never pointing at --no-load-optim (which drops only the optimizer state); a LLaVA checkpoint whose ViT has the old
structure (patch-embedding bias, final norm; now ln_pre, no bias) is named as such."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from omnitron.core.checkpoint import CheckpointError
from omnitron.core.checkpoint.name_mismatch import mismatch_error


def _old_vit(monkeypatch):
    """omnitron's ViT as it was before it became Megatron's CLIP ViT: a patch bias, a norm after the layers (kept
    in the state under its old name; the forward's ln_pre is an identity), no ln_pre."""
    from omnitron.core.models.multimodal import vision

    new_init = vision.VisionTransformer.__init__

    def old_init(self, c, **kw):
        new_init(self, c, **kw)
        bias = nn.Parameter(torch.zeros(self.patch_embedding.out_features))
        self.patch_embedding.bias = vision.set_attributes(bias, parallel=False, init=("zeros",))
        self.decoder.final_layernorm, self.ln_pre = self.ln_pre, nn.Identity()

    monkeypatch.setattr(vision.VisionTransformer, "__init__", old_init)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_a_llava_checkpoint_with_the_old_vit_says_so(tmp_path, monkeypatch, fmt):
    """Fails without the fix: torch_dist said "holds no tensor 'model/vision_model.ln_pre.bias'; ... (pass
    --no-load-optim to take the weights only)", which fails the same way; torch raised load_state_dict's lines."""
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    args = ["--model", "llava_tiny", "--patch-dim", "16", "--seq-length", "16", "--max-position-embeddings", "16",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--num-workers", "0", "--no-tensorboard",
            "--ckpt-format", fmt]
    ck = str(tmp_path / "ck")
    with monkeypatch.context() as m:
        _old_vit(m)
        train(parse_settings(args + ["--train-iters", "1", "--save", ck, "--log-dir", str(tmp_path / "a")],
                             world_size=1), get_backend("cpu"))
    with pytest.raises(CheckpointError) as err:
        train(parse_settings(args + ["--train-iters", "2", "--load", ck, "--log-dir", str(tmp_path / "b")],
                             world_size=1), get_backend("cpu"))
    line = str(err.value)
    assert "\n" not in line and "its vision encoder has the structure omnitron's ViT had before" in line, line
    assert "vision_model.ln_pre.weight" in line and "vision_model.patch_embedding.bias" in line, line
    assert "vision_model.decoder.final_layernorm.weight" in line and "--no-load-optim" not in line, line


def test_other_mismatched_names_point_at_the_model_settings():
    """Any other model-weight mismatch: the names, counts, the model settings; --no-load-optim is said not to help."""
    missing = [f"decoder.layers.{i}.mlp.linear_fc1.bias" for i in range(5)]
    line = str(mismatch_error("/ck/iter_0000002", missing, ["decoder.final_norm.weight"]))
    assert "5 of this model's weights are not in it (decoder.layers.0.mlp.linear_fc1.bias" in line, line
    assert "and 2 more" in line and "it holds 1 this model lacks (decoder.final_norm.weight)" in line, line
    assert "use the model settings it was saved with" in line and "pass --no-load-optim" not in line, line
    assert "vision encoder" not in str(mismatch_error("/ck", ["vision_model.ln_pre.weight"], [])), \
        "only the exact change of structure is named as the old ViT"
