"""Synthetic image-caption data for the multimodal (LLaVA) family: small enough to learn on a CPU.

Sample ``i`` depends only on ``(seed, i)`` (its own ``numpy.random.default_rng([seed, i])``), so every
rank and worker sees the same data and no file is read. The image (``[3, H, W]`` float32 in [0, 1]) is a
dark noisy background (values below 0.15) with ONE filled shape: a ``square``, ``circle`` or ``triangle``
(apex up), side 7/32 to 13/32 of the image (at least 5 pixels), in one quadrant (``top left`` ... ``bottom right``) at a
random offset inside it, in one of six colours (each channel either ~0 or 0.75-1.0). Its caption says exactly
that: ``"a red circle at the top left"``, tokenized by the run's tokenizer (GPT-2 BPE by default).

Sequence (``seq_length`` tokens; GPT-style shift of a ``seq_length + 1`` row): ``n`` image placeholders
(``IMAGE_TOKEN``), the caption, the end-of-document token, padding (eod). ``labels`` are the next tokens
(``IMAGE_TOKEN`` where the next position is an image placeholder); ``loss_mask`` is 1 on the targets
predicted from text positions: the caption after its first word ("a", a fixed prompt), and its eod.
NOTE: the last image position's target (always "a") is not trained: a constant target there teaches the
projector a constant output that drowns the image content (measured: a tiny model trained from scratch
with it stays at the text-only loss floor, without it learns to read colours and positions).
"""
from __future__ import annotations

import numpy as np
import torch

COLOURS = {"red": (1, 0, 0), "green": (0, 1, 0), "blue": (0, 0, 1), "yellow": (1, 1, 0), "purple": (1, 0, 1),
           "cyan": (0, 1, 1)}
SHAPES = ("square", "circle", "triangle")
POSITIONS = ("top left", "top right", "bottom left", "bottom right")


def shape_mask(shape: str, side: int) -> np.ndarray:
    """``[side, side]`` bool mask of a filled square, circle or apex-up triangle."""
    yy, xx = np.mgrid[0:side, 0:side].astype(np.float64)
    centre = (side - 1) / 2.0
    if shape == "square":
        return np.ones((side, side), bool)
    if shape == "circle":
        return (yy - centre) ** 2 + (xx - centre) ** 2 <= (side / 2.0) ** 2
    if shape == "triangle":  # row r spans half-width (r + 1) / 2 around the centre
        return np.abs(xx - centre) <= (yy + 1) / 2.0
    raise ValueError(f"unknown shape {shape!r}; one of {', '.join(SHAPES)}")


def draw_sample(rng: np.random.Generator, height: int, width: int) -> tuple[np.ndarray, str]:
    """One ``(image [3, H, W] float32, caption)`` drawn with ``rng`` (see the module docstring)."""
    colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
    shape, where = SHAPES[int(rng.integers(len(SHAPES)))], POSITIONS[int(rng.integers(len(POSITIONS)))]
    image = rng.uniform(0.0, 0.15, size=(3, height, width))
    qh, qw = height // 2, width // 2
    side = int(rng.integers(max(5, 7 * min(height, width) // 32), max(6, 13 * min(height, width) // 32) + 1))
    top = (0 if where.startswith("top") else qh) + int(rng.integers(0, qh - side + 1))
    left = (0 if where.endswith("left") else qw) + int(rng.integers(0, qw - side + 1))
    mask = shape_mask(shape, side)
    for ch, on in enumerate(COLOURS[colour]):
        value = rng.uniform(0.75, 1.0) if on else rng.uniform(0.0, 0.1)
        patch = image[ch, top:top + side, left:left + side]
        patch[mask] = value
    return image.astype(np.float32), f"a {colour} {shape} at the {where}"


class ImageCaptionDataset(torch.utils.data.Dataset):
    """``num_samples`` synthetic image-caption samples as dicts of ``tokens``, ``labels``, ``loss_mask``,
    ``position_ids`` (``[seq_length]``) and ``images`` (``[3, img_h, img_w]``)."""

    def __init__(self, num_samples: int, *, seq_length: int, seed: int, tokenizer, img_h: int, img_w: int,
                 num_channels: int, num_image_tokens: int) -> None:
        from omnitron.core.models.multimodal.config import IMAGE_TOKEN

        if num_channels != 3:
            raise ValueError(f"--num-channels {num_channels}: the synthetic image-caption data draws RGB images; "
                             "use --num-channels 3")
        if min(img_h, img_w) < 16:
            raise ValueError(f"--img-h {img_h} / --img-w {img_w}: the synthetic shapes need images of at least "
                             "16 x 16 pixels; raise them")
        self.num_samples, self.seq_length, self.seed, self.tokenizer = num_samples, seq_length, seed, tokenizer
        self.img_h, self.img_w, self.n, self.image_token = img_h, img_w, num_image_tokens, IMAGE_TOKEN
        longest = max(len(tokenizer.encode(f"a {c} {s} at the {p}")) for c in COLOURS for s in SHAPES
                      for p in POSITIONS)
        if num_image_tokens + longest + 1 > seq_length + 1:
            raise ValueError(f"--seq-length {seq_length} cannot hold {num_image_tokens} image tokens, a caption of "
                             f"up to {longest} tokens and its end-of-document token; use --seq-length >= "
                             f"{num_image_tokens + longest}")

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, idx: int) -> tuple[np.ndarray, str]:
        """The raw ``(image, caption)`` of sample ``idx``."""
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range [0, {self.num_samples})")
        return draw_sample(np.random.default_rng([self.seed, idx]), self.img_h, self.img_w)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        image, caption = self.sample(idx)
        text = self.tokenizer.encode(caption) + [self.tokenizer.eod]
        row = np.full(self.seq_length + 1, self.tokenizer.pad, np.int64)
        row[:self.n] = self.image_token
        row[self.n:self.n + len(text)] = text
        loss_mask = np.zeros(self.seq_length, np.float32)
        loss_mask[self.n:self.n - 1 + len(text)] = 1.0  # the caption after "a" and its eod (module NOTE)
        return {"tokens": torch.from_numpy(row[:-1].copy()), "labels": torch.from_numpy(row[1:].copy()),
                "loss_mask": torch.from_numpy(loss_mask), "position_ids": torch.arange(self.seq_length),
                "images": torch.from_numpy(image)}


def build_multimodal_datasets(config, tokenizer, *, train_samples: int, valid_samples: int, test_samples: int,
                              img_h: int, img_w: int, num_channels: int, num_image_tokens: int,
                              is_builder_rank: bool = True, barrier=None, is_node_builder: bool = False):
    """(train, valid, test) :class:`ImageCaptionDataset` splits sized for the run (None for an empty split),
    split ``i`` drawn with seed ``--seed + i``; synthetic, so no file is read or cached. ``barrier`` is
    still called (every rank calls it, as for the file-backed builders)."""
    from .builder import DataError

    del is_builder_rank, is_node_builder  # nothing to build
    given = [flag for flag, _ in config.path_flags()]
    if given:
        raise DataError(f"{' '.join(given)}: the multimodal family trains on synthetic image-caption data (drawn per "
                        "sample, no files); drop the data paths")
    if barrier is not None:
        barrier()
    kw = dict(seq_length=config.seq_length, tokenizer=tokenizer, img_h=img_h, img_w=img_w, num_channels=num_channels,
              num_image_tokens=num_image_tokens)
    return tuple(None if n <= 0 else ImageCaptionDataset(int(n), seed=config.seed + i, **kw)
                 for i, n in enumerate((train_samples, valid_samples, test_samples)))
