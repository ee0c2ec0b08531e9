"""Capture and restore every random generator a training rank draws from.

Python's ``random``, NumPy's global generator, torch's CPU generator, the backend device's
default generator and the tensor-parallel tracker's named streams. Everything is stored as
tensors and plain numbers so checkpoints load with ``weights_only=True``.
"""
from __future__ import annotations

import random

import numpy as np
import torch


def get_rng_state(backend, tracker=None) -> dict:
    """Every generator's state on this rank."""
    version, internal, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64),
                   "gauss": gauss},
        "numpy": {"name": np_name, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
        "torch_cpu": torch.get_rng_state(),
        "device": backend.get_rng_state(),
    }
    if tracker is not None:
        state["tracker"] = tracker.get_states()
    return state


def set_rng_state(state: dict, backend, tracker=None) -> None:
    """Restore a state from :func:`get_rng_state` (device after CPU: on CPU they are one generator)."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch_cpu"])
    backend.set_rng_state(state["device"])
    if tracker is not None and "tracker" in state:
        tracker.set_states(state["tracker"])
