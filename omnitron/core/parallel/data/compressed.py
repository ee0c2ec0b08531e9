"""1-bit compressed all-reduce with error feedback (the communication of 1-bit Adam, DeepSpeed's scheme).

A flat tensor ``x`` of ``N`` elements, padded to ``P`` (a multiple of ``dp x 8``), is cut into ``dp``
chunks of ``n = P / dp`` elements; chunk ``c`` is owned by data-parallel rank ``c``. One call::

    worker (every rank)   z = x + e_w;  per block b: s_b = mean|z_b|,  e_w = z - s * sgn(z)
    phase 1 (all-to-all)  rank c receives every rank's (signs of chunk c, its blocks' scales)
    server (rank c)       u = mean_r(s_r * sgn_r) + e_s;  per block t = mean|u|,  e_s = u - t * sgn(u)
    phase 2 (all-gather)  every rank receives every chunk's (signs, scales t): result = t * sgn

A block is ``block`` consecutive elements of a chunk (``ErrorFeedback.block``; None: the whole chunk, one
scale per chunk and rank, DeepSpeed's granularity is one per rank's whole tensor).

``sgn(v)`` is +1 for v >= 0 and -1 otherwise. The scale ``mean|z|`` is the least-squares one for a
sign vector (it minimises ||z - s sgn(z)||): then ||z - C(z)||^2 = ||z||^2 - ||z||_1^2 / n <= (1 - 1/n) ||z||^2,
a contraction, so the error buffers stay bounded and the running sum of the results tracks the running
sum of the true averages within ``mean_r(e_w) + e_s`` (telescoping). DeepSpeed takes ||z||_2 / sqrt(n) and one
scale per worker tensor; both are our choices, said here.

Wire format, both phases: one ``uint8`` row per chunk, ``n / 8`` bytes of signs (8 per byte, element
``8k + j`` in bit ``j`` of byte ``k``) followed by the chunk's scales as the raw bytes of values of the
tensor's dtype (4 bytes each for float32). Rows travel as ``uint8`` on every backend, so a transport needs
no dtype support beyond bytes. Per call a rank hands the collectives ``2 x dp x (n/8 + 4 n/block)`` bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

def _bit_weights(device) -> torch.Tensor:
    """[8] uint8: 1, 2, 4, ..., 128 (bit j of a byte holds element j of its group of 8)."""
    return (2 ** torch.arange(8, device=device)).to(torch.uint8)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., 8k] -> [..., k] uint8: bit j of byte i is 1 where ``x[..., 8i + j] >= 0``."""
    if x.shape[-1] % 8:
        raise ValueError(f"pack_signs needs a last dimension divisible by 8, got {tuple(x.shape)}")
    bits = (x >= 0).view(torch.uint8).reshape(*x.shape[:-1], -1, 8)  # [..., k, 8] of 0 / 1
    out = bits[..., 0].clone()
    for j in range(1, 8):
        out |= bits[..., j] << j
    return out


def _sign_table(dtype: torch.dtype, device) -> torch.Tensor:
    """[256, 8]: row b holds the +1 / -1 of the 8 elements packed in byte b."""
    byte = torch.arange(256, device=device).to(torch.uint8).unsqueeze(-1)
    return byte.bitwise_and(_bit_weights(device)).ne(0).to(dtype) * 2 - 1


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., k] uint8 -> [..., 8k] of +1 / -1 in ``dtype`` (the inverse of :func:`pack_signs` on signs)."""
    return _sign_table(dtype, packed.device)[packed.long()].reshape(*packed.shape[:-1], -1)


PIECE = 1 << 22
"""Elements compressed or decompressed at a time. The temporaries (absolute values, signs, the +-1 expansion,
the compressed values: about 14 bytes per element) are one piece's, at most ~56 MiB, not the buffer's (the
model's: with the optimizer's own, 6.6x the fp32 model per step at dp2 before). NOTE: each piece is a handful
of kernel launches; 4M elements keep a billion-parameter model's step at a few hundred pieces."""


def _pieces(n: int, block: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` spans covering ``n`` elements, each a whole number of scale blocks (and sign bytes)."""
    step = max(block, PIECE // block * block)
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]


def compress_into(z: torch.Tensor, block: int, row: torch.Tensor) -> None:
    """Compress the flat chunk ``z`` ([n], blocks of ``block``) into the uint8 wire ``row`` ([n/8 + scale
    bytes]: signs, then each block's mean|z| as raw bytes), and replace ``z`` by its error ``z - scale sgn(z)``."""
    n, size = z.numel(), z.element_size()
    for lo, hi in _pieces(n, block):
        zb = z[lo:hi].view(-1, block)
        scale = zb.abs().mean(-1, keepdim=True)  # [blocks, 1]
        row[lo // 8:hi // 8] = pack_signs(z[lo:hi])
        row[n // 8 + lo // block * size:n // 8 + hi // block * size] = scale.reshape(-1).view(torch.uint8)
        zb.sub_(torch.where(zb >= 0, scale, -scale))


def decompress_span(row: torch.Tensor, n: int, block: int, dtype: torch.dtype, lo: int, hi: int,
                    scales: torch.Tensor | None = None) -> torch.Tensor:
    """Elements ``[lo, hi)`` of the chunk a wire ``row`` holds (the inverse of :func:`compress_into`):
    ``scale * sgn``. ``scales``: the row's scales already read (:func:`row_scales`)."""
    scales = row_scales(row, n, dtype) if scales is None else scales
    signs = unpack_signs(row[lo // 8:hi // 8], dtype)
    return signs.view(-1, block).mul_(scales[lo // block:hi // block].unsqueeze(-1)).view(-1)


def row_scales(row: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The scales of a wire row as ``dtype`` values (copied: the bytes need not be aligned)."""
    return row[n // 8:].clone().view(dtype)


def padded_size(numel: int, dp: int, block: int | None = None) -> int:
    """``numel`` rounded up to a multiple of ``dp x block`` (``dp x 8`` without a block: every chunk a whole
    number of sign bytes)."""
    m = dp * (block or 8)
    return (numel + m - 1) // m * m


@dataclass
class ErrorFeedback:
    """One compressed buffer's error state on one rank: ``worker`` [P] and ``server`` [P / dp] (the chunk
    this rank owns), in the buffer's dtype; zeros at the start. ``block``: elements per scale (a multiple
    of 8); None: one scale per chunk."""

    worker: torch.Tensor
    server: torch.Tensor
    block: int | None = None

    @classmethod
    def zeros(cls, numel: int, dp: int, dtype=torch.float32, device=None, block: int | None = None) -> ErrorFeedback:
        if block is not None and (block < 8 or block % 8):
            raise ValueError(f"a scale block must be a positive multiple of 8 elements, got {block}")
        p = padded_size(numel, dp, block)
        return cls(torch.zeros(p, dtype=dtype, device=device), torch.zeros(p // dp, dtype=dtype, device=device), block)


def wire_bytes(numel: int, dp: int, dtype=torch.float32, block: int | None = None) -> int:
    """Bytes one rank hands the collectives per :func:`compressed_all_reduce` of ``numel`` elements:
    phase 1's all-to-all input plus phase 2's all-gather output (``dp`` rows each)."""
    n = padded_size(numel, dp, block) // dp
    return 2 * dp * (n // 8 + n // (block or n) * torch.empty((), dtype=dtype).element_size())


def compressed_all_reduce(x: torch.Tensor, state: ErrorFeedback, group, collectives) -> torch.Tensor:
    """Replace the flat ``x`` by the 1-bit compressed mean over ``group`` (the module docstring), in place;
    updates ``state``. Every rank of ``group`` must call it with the same ``x.numel()``. Returns ``x``.

    The error buffers hold the values being compressed (``z = x + e_w``, ``u = mean + e_s``) and become the
    new errors in place; the rest is done :data:`PIECE` elements at a time."""
    dp, numel = group.size, x.numel()
    if dp == 1:
        return x
    n = state.worker.numel() // dp
    block = state.block or n
    row = n // 8 + n // block * x.element_size()
    flat = x.view(-1)
    # NOTE: the zero padding is compressed like any element (its error fed back, its result dropped)
    state.worker[:numel] += flat
    z = state.worker.view(dp, n)  # row c goes to rank c
    sent = torch.empty(dp, row, dtype=torch.uint8, device=x.device)
    for c in range(dp):
        compress_into(z[c], block, sent[c])
    received = torch.empty(dp, row, dtype=torch.uint8, device=x.device)
    collectives.all_to_all(received, sent, group=group.handle)  # phase 1
    del sent
    scales = [row_scales(received[r], n, x.dtype) for r in range(dp)]
    for lo, hi in _pieces(n, block):  # u = mean_r(decompressed chunks) + e_s, in the server buffer
        total = decompress_span(received[0], n, block, x.dtype, lo, hi, scales[0])
        for r in range(1, dp):
            total += decompress_span(received[r], n, block, x.dtype, lo, hi, scales[r])
        state.server[lo:hi] += total.div_(dp)
    del received
    mine = torch.empty(1, row, dtype=torch.uint8, device=x.device)
    compress_into(state.server, block, mine[0])
    gathered = torch.empty(dp, row, dtype=torch.uint8, device=x.device)
    collectives.all_gather(gathered, mine, group=group.handle)  # phase 2
    for c in range(dp):
        scale = row_scales(gathered[c], n, x.dtype)
        for lo, hi in _pieces(n, block):
            end = min(hi, numel - c * n)
            if end > lo:
                flat[c * n + lo:c * n + end] = decompress_span(gathered[c], n, block, x.dtype, lo, hi, scale)[:end - lo]
    return x
