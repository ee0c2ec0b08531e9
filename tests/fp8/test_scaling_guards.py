"""Delayed scaling's state at its edges: a per-step push gathers its roles on the device the layers run on
(a role never used is still on the host where it was made), and a checkpoint's amax history of another length than
``--fp8-amax-history-len`` (longer as well as shorter) is refused in one line.

Reference: the push written out here in float64 from the recipe's definition (scaling.py's docstring).
"""
from __future__ import annotations

import pytest
import torch

from omnitron.core.config.parallel import ConfigError
from omnitron.core.precision.fp8.scaling import AmaxReducer, DelayedScaling

FP8_MAX = 448.0


@pytest.mark.parametrize("host_first", [True, False], ids=["host-role-first", "device-role-first"])
def test_a_step_moves_an_unused_host_role_to_the_layers_device(host_first):
    """Two roles of one reducer: one made on the host and never used, one on the layers' device (``meta`` stands in
    for an accelerator: a host tensor cannot be combined with it, nor a meta one copied to the host). The push
    runs on the device whichever role was registered first; both roles end there."""
    reducer = AmaxReducer((), None, per_step=True)
    host = DelayedScaling("e4m3", 4, "max", 0)  # device None: made on the host
    dev = DelayedScaling("e4m3", 4, "max", 0, device="meta")
    for s in ((host, dev) if host_first else (dev, host)):
        reducer.register(s)
    reducer.observe(dev, torch.ones((), device="meta"))
    reducer.step()
    for s in (host, dev):
        assert {t.device.type for t in (s.amax_history, s.scale, s.scale_inv, s.step_amax)} == {"meta"}


def test_a_step_push_follows_the_recipe_in_float64():
    """Three steps of one role on the host against the definition: ``history <- [a, history[:-1]]``,
    ``scale = fp8_max / max(history)``; a step without a use leaves both."""
    reducer = AmaxReducer((), None, per_step=True)
    s = DelayedScaling("e4m3", 3, "max", 0)
    reducer.register(s)
    hist, scale = [0.0, 0.0, 0.0], 1.0
    for amaxes in ([0.5, 2.0], [], [0.25], [3.0, 0.125]):
        for a in amaxes:
            reducer.observe(s, torch.tensor(a))
        reducer.step()
        if amaxes:
            hist = [max(amaxes)] + hist[:-1]
            scale = FP8_MAX / max(hist)
        assert s.amax_history.double().tolist() == hist  # powers of two: exact in float32
        assert s.scale.item() == pytest.approx(scale, rel=2 ** -24)  # one float32 division: half an ulp


@pytest.mark.parametrize("saved_len", [2, 6], ids=["shorter", "longer"])
def test_a_history_of_another_length_is_refused_naming_the_flag(saved_len):
    s = DelayedScaling("e4m3", 4, "max", 0)
    state = {"amax_history": torch.rand(saved_len), "scale": torch.tensor(2.0), "uses": torch.tensor(3)}
    with pytest.raises(ConfigError) as err:
        s.load_state_dict(state)
    msg = str(err.value)
    assert f"length {saved_len}" in msg and "--fp8-amax-history-len" in msg and "\n" not in msg
    assert s.amax_history.tolist() == [0.0] * 4 and s.uses == 0  # nothing loaded
