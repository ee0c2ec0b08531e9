"""What the Megatron converters share: names, the safe reading of Megatron's pickles, the full-state check,
the final rename (:mod:`omnitron.core.checkpoint.megatron` for ``--ckpt-format torch`` and the dispatch,
:mod:`omnitron.core.checkpoint.megatron_dist` for ``torch_dist``; both import this, megatron_dist never imports
megatron).
"""
from __future__ import annotations

import argparse
import os
import signal

import numpy as np

from omnitron.core.checkpoint.io import CheckpointError, _fsync_dir, _write_file
from omnitron.core.checkpoint.safe_load import Opaque, load_untrusted

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0
_TE_NORMS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
             "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
             "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
             "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias"}
_TE_EXTRA = ("self_attention.core_attention._extra_state", "self_attention.linear_qkv._extra_state",
             "self_attention.linear_proj._extra_state", "mlp.linear_fc1._extra_state", "mlp.linear_fc2._extra_state")
_ROWS = ("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias",
         "linear_fc1.weight", "linear_fc1.bias")
_COLUMNS = ("linear_proj.weight", "linear_fc2.weight")
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
BUFFERS = (".mlp.router.expert_bias",)
"""Buffers a full state may carry beside the parameters: the routers' expert bias (auxiliary-loss-free balancing)."""


class MegatronConversionError(CheckpointError):
    """A Megatron checkpoint omnitron cannot map, or a model Megatron's layout cannot hold (names the field)."""


def _extra_classes() -> dict[str, object]:
    """What a Megatron file holds beside tensors, by exact name: the run's ``argparse.Namespace`` (whose
    ``exit_signal`` is a ``signal.Signals``, SIGTERM by default: an enum, built from its number) and numpy's RNG
    state (arrays, dtypes and scalars; numpy 1 and 2 spell the module differently)."""
    reconstruct, scalar = np.zeros(0).__reduce__()[0], np.float64(0).__reduce__()[0]
    out = {"argparse.Namespace": argparse.Namespace, "numpy.ndarray": np.ndarray, "numpy.dtype": np.dtype,
           "signal.Signals": signal.Signals}
    for core in ("numpy.core.multiarray", "numpy._core.multiarray"):
        out.update({f"{core}._reconstruct": reconstruct, f"{core}.scalar": scalar})
    for code in np.typecodes["All"]:  # the dtype classes: never named in a file, but unpickled dtypes are theirs
        cls = type(np.dtype(code))
        out[f"numpy.dtypes.{cls.__name__}"] = cls
    return out


def _megatron_name(module: str, name: str) -> bool:
    """Megatron's own classes (enums in ``args``, such as ``AttnBackend``) become inert placeholders."""
    return module == "megatron" or module.startswith("megatron.")


def load_file(path: str, data: bytes | None = None):
    """A Megatron ``model_optim_rng.pt`` or ``common.pt`` (or such a payload's bytes ``data``, held inside a
    ``torch_dist`` file) read safely (:func:`~omnitron.core.checkpoint.safe_load.load_untrusted`): tensors,
    containers, the args Namespace, numpy RNG state; ``megatron.*`` classes become :class:`Opaque`."""
    try:
        return load_untrusted(path, what="a Megatron checkpoint", extra=_extra_classes(), vouch=_megatron_name,
                              fix="import only checkpoints from a trusted Megatron run", data=data)
    except CheckpointError as err:
        raise MegatronConversionError(str(err)) from None


def checkpoint_dict(ckpt, path: str) -> dict:
    """``ckpt``, the top-level object of Megatron file ``path``, when it is a dict (one line naming it otherwise)."""
    if not isinstance(ckpt, dict):
        raise MegatronConversionError(f"{path}: holds a {type(ckpt).__name__}, not Megatron's checkpoint dict; the "
                                      f"file is not a Megatron checkpoint")
    return ckpt


def run_args(ckpt: dict, path: str) -> dict:
    """The run's args (a dict) of a Megatron checkpoint's top-level dict ``ckpt``."""
    args = checkpoint_dict(ckpt, path).get("args")
    if isinstance(args, (argparse.Namespace, Opaque)):
        args = dict(vars(args)) if isinstance(args, argparse.Namespace) else args.state
    if not isinstance(args, dict):
        raise MegatronConversionError(f"{path}: no 'args' (the run's argparse Namespace) in the checkpoint, so the "
                                      f"model's shape is unknown; save it with a Megatron version that records args")
    return args


_NOT_WEIGHTS = ("._extra_state", ".inv_freq")
"""Entries the importers skip: TE's FP8 metadata (bytes, or a uint8 tensor of them) and RoPE frequencies."""


def check_weights(tensors: dict, path: str) -> None:
    """Refuse, naming the tensor and ``path``, a NaN / inf or integer tensor among the weights of ``tensors``
    (:mod:`~omnitron.core.checkpoint.weight_values`; what the importers skip is not read)."""
    from omnitron.core.checkpoint.weight_values import first_bad_weight, fix_for

    bad = first_bad_weight((n, t) for n, t in tensors.items() if t is not None and not n.endswith(_NOT_WEIGHTS))
    if bad is not None:
        raise MegatronConversionError(f"{path}: tensor {bad[0]!r} {bad[1]}; {fix_for(bad[1])}")


def _tp_dim(name: str) -> int | None:
    """The dimension Megatron splits ``name`` over tensor-parallel ranks (None: replicated)."""
    return 0 if name.endswith(_ROWS) else 1 if name.endswith(_COLUMNS) else None


def _check_state(full: dict, cfg, path: str) -> None:
    from omnitron.core.checkpoint.reshard import full_shapes

    want = full_shapes(cfg)
    for name, shape in want.items():
        if name not in full:
            raise MegatronConversionError(f"{path}: no tensor {name} in the shards, which the args' model needs; "
                                          f"the checkpoint and its args do not match")
        if tuple(full[name].shape) != shape:
            raise MegatronConversionError(f"{path}: {name} has shape {tuple(full[name].shape)}, the args' model "
                                          f"{shape}; the checkpoint and its args do not match")
    extra = sorted(n for n in set(full) - set(want) if not (n.endswith(BUFFERS) and full[n].shape == (cfg.num_experts,)
                                                            and cfg.moe_router_enable_expert_bias))
    if extra:
        raise MegatronConversionError(f"{path}: {len(extra)} tensors have no place in omnitron's GPT model (first: "
                                      f"{extra[0]}); the args do not describe these weights")


def commit_iteration(out_dir: str, it: int) -> str:
    """Rename the written ``iter_N.tmp`` of ``out_dir`` to ``iter_N``, then point Megatron's tracker file at it."""
    final = os.path.join(out_dir, f"iter_{it:07d}")
    os.replace(final + ".tmp", final)
    _write_file(os.path.join(out_dir, TRACKER + ".tmp"), lambda f: f.write(str(it).encode()))
    os.replace(os.path.join(out_dir, TRACKER + ".tmp"), os.path.join(out_dir, TRACKER))
    _fsync_dir(out_dir)
    return final
