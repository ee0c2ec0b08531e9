"""1-bit compressed all-reduce with error feedback (the communication of 1-bit Adam, DeepSpeed's scheme).

A flat tensor ``x`` of ``N`` elements, padded to ``P`` (a multiple of ``dp x 8``), is cut into ``dp``
chunks of ``n = P / dp`` elements; chunk ``c`` is owned by data-parallel rank ``c``. One call::

    worker (every rank)   z = x + e_w;  per chunk c: s_c = mean|z_c|,  e_w = z - s * sgn(z)
    phase 1 (all-to-all)  rank c receives every rank's (signs of chunk c, s_c)
    server (rank c)       u = mean_r(s_r * sgn_r) + e_s;  t = mean|u|,  e_s = u - t * sgn(u)
    phase 2 (all-gather)  every rank receives every chunk's (signs, t): result = t_c * sgn_c

``sgn(v)`` is +1 for v >= 0 and -1 otherwise. The scale ``mean|z|`` is the least-squares one for a
sign vector (it minimises ||z - s sgn(z)||): then ||z - C(z)||^2 = ||z||^2 - ||z||_1^2 / n <= (1 - 1/n) ||z||^2,
a contraction, so the error buffers stay bounded and the running sum of the results tracks the running
sum of the true averages within ``mean_r(e_w) + e_s`` (telescoping). DeepSpeed takes ||z||_2 / sqrt(n) and one
scale per worker tensor; both are our choices, said here.

Wire format, both phases: one ``uint8`` row per chunk, ``n / 8`` bytes of signs (8 per byte, element
``8k + j`` in bit ``j`` of byte ``k``) followed by the chunk's scale as the raw bytes of one value of the
tensor's dtype (4 bytes for float32). Rows travel as ``uint8`` on every backend, so a transport needs no
dtype support beyond bytes. Per call a rank hands the collectives ``2 x dp x (n/8 + 4)`` bytes.
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


def compress(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of ``z`` [rows, n] -> (packed signs [rows, n/8] uint8, scales [rows] = mean|z|, the
    compressed rows ``scale * sgn(z)`` [rows, n])."""
    scale = z.abs().mean(-1, keepdim=True)
    return pack_signs(z), scale.reshape(-1), torch.where(z >= 0, scale, -scale)


def _rows(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[rows, n/8 + scale bytes] uint8: each row's signs then its scale's bytes (the wire format)."""
    return torch.cat([packed, scale.reshape(-1, 1).contiguous().view(torch.uint8)], dim=1)


def _split(rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`_rows`: (signs [rows, n] in ``dtype`` as +-1, scales [rows])."""
    width = torch.empty((), dtype=dtype).element_size()
    signs = unpack_signs(rows[:, :-width], dtype)
    scale = rows[:, -width:].contiguous().view(dtype).reshape(-1)
    return signs, scale


def padded_size(numel: int, dp: int) -> int:
    """``numel`` rounded up to a multiple of ``dp x 8`` (every chunk a whole number of sign bytes)."""
    m = dp * 8
    return (numel + m - 1) // m * m


@dataclass
class ErrorFeedback:
    """One compressed buffer's error state on one rank: ``worker`` [P] and ``server`` [P / dp] (the chunk
    this rank owns), in the buffer's dtype; zeros at the start."""

    worker: torch.Tensor
    server: torch.Tensor

    @classmethod
    def zeros(cls, numel: int, dp: int, dtype=torch.float32, device=None) -> ErrorFeedback:
        p = padded_size(numel, dp)
        return cls(torch.zeros(p, dtype=dtype, device=device), torch.zeros(p // dp, dtype=dtype, device=device))


def wire_bytes(numel: int, dp: int, dtype=torch.float32) -> int:
    """Bytes one rank hands the collectives per :func:`compressed_all_reduce` of ``numel`` elements:
    phase 1's all-to-all input plus phase 2's all-gather output (``dp`` rows each)."""
    n = padded_size(numel, dp) // dp
    return 2 * dp * (n // 8 + torch.empty((), dtype=dtype).element_size())


def compressed_all_reduce(x: torch.Tensor, state: ErrorFeedback, group, collectives) -> torch.Tensor:
    """Replace the flat ``x`` by the 1-bit compressed mean over ``group`` (the module docstring), in place;
    updates ``state``. Every rank of ``group`` must call it with the same ``x.numel()``. Returns ``x``."""
    dp, numel = group.size, x.numel()
    if dp == 1:
        return x
    p = padded_size(numel, dp)
    n = p // dp
    z = state.worker.clone()
    z[:numel] += x  # NOTE: the zero padding is compressed like any element (its error fed back, its result dropped)
    z = z.view(dp, n)  # [dp, n]: row c goes to rank c
    packed, scale, sent = compress(z)
    state.worker.copy_(z.sub_(sent).reshape(-1))
    received = torch.empty(dp, n // 8 + scale.element_size(), dtype=torch.uint8, device=x.device)
    collectives.all_to_all(received, _rows(packed, scale), group=group.handle)  # phase 1
    signs, scales = _split(received, x.dtype)  # [dp, n], [dp]: every rank's view of my chunk
    u = (scales @ signs).div_(dp).add_(state.server)  # [n]: the mean of the decompressed chunks
    s_packed, s_scale, s_sent = compress(u.unsqueeze(0))
    state.server.copy_(u.sub_(s_sent[0]))
    gathered = torch.empty(dp, received.shape[1], dtype=torch.uint8, device=x.device)
    collectives.all_gather(gathered, _rows(s_packed, s_scale), group=group.handle)  # phase 2
    signs, scales = _split(gathered, x.dtype)
    x.copy_(signs.mul_(scales.unsqueeze(-1)).reshape(-1)[:numel].view_as(x))
    return x
