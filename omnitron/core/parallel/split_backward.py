"""Which half of a split backward a custom autograd function runs in (``pipeline/wgrad.py``).

The zero-bubble schedules run a stage's backward as B (``autograd.grad`` to the stage input) and, later, W (from
each boundary node to its weights only). Autograd's own nodes compute only the gradients the engine needs, but a
custom ``autograd.Function``'s ``ctx.needs_input_grad`` is fixed at forward: a boundary node that is one (the FP8
linear, the sequence-parallel gather linear) would compute its input AND weight gradients in B and again in W,
twice its GEMMs and collectives, every extra result dropped. ``wgrad.py`` marks such a node with the half it runs
in; the function asks :func:`computes_input` / :func:`computes_weight`. Unmarked (no split, a fallback plan,
recomputation) both are computed, as before.

A function whose weight side needs its output gradient only in a form B already makes (the FP8 linear: the
quantized gradient) hands that form to W in B (:func:`defers_weight`, :func:`stash`); W's call then takes it
(:func:`take`) and ``wgrad.py`` keeps only a one-element stand-in for the gradient it would have held
(:func:`holds_operands`): one quantization a backward, as unsplit, and W's held bytes those of the FP8 form.
"""
from __future__ import annotations

_ATTR = "omnitron_split_pass"
_STASH = "omnitron_w_operands"
_IN_B: set = set()
"""The boundary nodes of the B now running (any node type: autograd's own nodes take no attribute)."""


def mark(node, half: str | None) -> None:
    """Mark ``node`` (a custom function's backward node) as running B (``"input"``) or W (``"weight"``); None
    clears. Autograd's built-in nodes take no attribute and need none (they compute only what is needed); every
    node marked ``"input"`` is listed for :func:`keeps_saved`."""
    if half == "input":
        _IN_B.add(node)
    else:
        _IN_B.discard(node)
    try:
        if half is None:
            if hasattr(node, _ATTR):
                delattr(node, _ATTR)
        else:
            setattr(node, _ATTR, half)
    except (AttributeError, TypeError):
        pass


def computes_input(ctx) -> bool:
    """Whether this backward call is to produce the input gradient (not W of a split backward)."""
    return getattr(ctx, _ATTR, None) != "weight"


def computes_weight(ctx) -> bool:
    """Whether this backward call is to produce the weight (and bias) gradients (not B of a split backward)."""
    return getattr(ctx, _ATTR, None) != "input"


def defers_weight(ctx) -> bool:
    """Whether this call is B of a split backward: its weight gradients come in a later W call."""
    return getattr(ctx, _ATTR, None) == "input"


def stash(ctx, operands: tuple) -> None:
    """In B: keep ``operands`` (what W's weight gradient needs of the output gradient) on the node for W."""
    setattr(ctx, _STASH, operands)


def take(ctx) -> tuple | None:
    """In W: the operands B stashed (released from the node), or None where B stashed none."""
    operands = getattr(ctx, _STASH, None)
    if operands is not None:
        delattr(ctx, _STASH)
    return operands


def holds_operands(node) -> bool:
    """Whether B stashed W's operands on ``node``, so W needs no kept output gradient there."""
    return getattr(node, _STASH, None) is not None


def splitting() -> bool:
    """Whether B of a split backward is running (its boundary nodes marked)."""
    return bool(_IN_B)


def keeps_saved(node) -> bool:
    """Whether ``node`` (the one reading a saved tensor) is a weight boundary of the B now running: W runs it
    again, so a recomputed tensor it reads stays for W (``tensor/recompute.py``)."""
    return node is not None and node in _IN_B
