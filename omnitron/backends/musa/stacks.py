"""The PyTorch each MUSA software stack ships (for ``omnitron info``): torch_musa pins one torch minor.

Sources: torch_musa's GitHub releases (v2.9.0 and v2.9.1 need torch 2.9) and the MUSA SDK 5.2 stack
(torch / torch_musa 2.11.0.post1), as read 2026-12-03.
"""
TORCH_STACKS = {
    (2, 9): "torch_musa v2.9.x",
    (2, 11): "MUSA SDK 5.2 (torch_musa 2.11.0.post1)",
}
