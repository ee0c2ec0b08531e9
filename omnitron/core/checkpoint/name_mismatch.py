"""The one line for a checkpoint whose model weights' names are not this model's.

A name missing from a checkpoint, or one it holds that this model lacks, is a different model, never an
optimizer matter: the line lists a few of each and says what to do, and never points at --no-load-optim (which
only drops the optimizer state). One case is named on its own: a LLaVA checkpoint written before omnitron's ViT
became Megatron's CLIP ViT (its patch embedding had a bias and a norm followed the last layer; now ``ln_pre``
normalises the embedded patches and the patch embedding has no bias), whose vision encoder cannot be mapped onto
the new one (the old norm sat after the layers, the new one sits before them).
"""
from __future__ import annotations

from omnitron.core.checkpoint.io import CheckpointError

_OLD_VIT = {"vision_model.patch_embedding.bias", "vision_model.decoder.final_layernorm.weight"}
_NEW_VIT = {"vision_model.ln_pre.weight"}


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def old_vision_encoder(missing, unexpected) -> bool:
    """Whether the mismatch is exactly the ViT's change of structure (module docstring)."""
    names = set(missing) | set(unexpected)
    return all(n.startswith("vision_model.") for n in names) and bool(_OLD_VIT & set(unexpected)) and \
        bool(_NEW_VIT & set(missing))


def mismatch_error(path: str, missing, unexpected) -> CheckpointError:
    """CheckpointError naming ``missing`` (this model's weights the checkpoint lacks) and ``unexpected`` (the
    checkpoint's that this model lacks), bare parameter names."""
    missing, unexpected = sorted(missing), sorted(unexpected)
    found = "; ".join(part for part in (
        f"{len(missing)} of this model's weights are not in it ({_few(missing)})" if missing else "",
        f"it holds {len(unexpected)} this model lacks ({_few(unexpected)})" if unexpected else "") if part)
    if old_vision_encoder(missing, unexpected):
        return CheckpointError(
            f"--load {path}: its vision encoder has the structure omnitron's ViT had before it became Megatron's "
            f"CLIP ViT (a patch-embedding bias and a norm after the last layer; now ln_pre before the layers and no "
            f"bias), which does not map onto the new one ({found}): train the vision encoder again in a new run "
            f"(without --load), or finish this run with the omnitron version that wrote the checkpoint")
    return CheckpointError(f"--load {path}: the checkpoint's model weights are not this model's ({found}); it was "
                           f"saved for another model: use the model settings it was saved with (--no-load-optim would "
                           f"not help: these are model weights, not optimizer state)")
