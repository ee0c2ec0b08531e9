"""The synthetic image-caption data: each caption describes its image (read back from the pixels with a
parser written here), samples are deterministic per (seed, index), the token/label/loss-mask layout, errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from omnitron.core.data import build_tokenizer
from omnitron.core.data.config import DataConfig
from omnitron.core.data.multimodal_dataset import ImageCaptionDataset, build_multimodal_datasets
from omnitron.core.models.multimodal import IMAGE_TOKEN

TOK = build_tokenizer("GPT2BPETokenizer")
KW = dict(seq_length=32, tokenizer=TOK, img_h=32, img_w=32, num_channels=3, num_image_tokens=16)


def read_image(image: np.ndarray) -> str:
    """The caption of an image, from its pixels: foreground = any channel above 0.5; colour from the lit
    channels; quadrant from the bounding-box centre; shape from the box's fill and its top vs bottom row."""
    names = {(1, 0, 0): "red", (0, 1, 0): "green", (0, 0, 1): "blue", (1, 1, 0): "yellow", (1, 0, 1): "purple",
             (0, 1, 1): "cyan"}
    fg = image.max(0) > 0.5
    ys, xs = np.nonzero(fg)
    colour = names[tuple(int(v) for v in image[:, fg].mean(1) > 0.5)]
    box = fg[ys.min():ys.max() + 1, xs.min():xs.max() + 1]
    if box.mean() > 0.97:
        shape = "square"
    else:
        shape = "triangle" if box[0].sum() < box[-1].sum() / 2 else "circle"
    h, w = fg.shape
    vertical = "top" if (ys.min() + ys.max()) / 2 < h / 2 else "bottom"
    horizontal = "left" if (xs.min() + xs.max()) / 2 < w / 2 else "right"
    return f"a {colour} {shape} at the {vertical} {horizontal}"


@pytest.mark.parametrize("size", [(32, 32), (16, 24)])
def test_captions_describe_their_images(size):
    ds = ImageCaptionDataset(300, **{**KW, "img_h": size[0], "img_w": size[1], "num_image_tokens": 4}, seed=9)
    captions = []
    for i in range(len(ds)):
        image, caption = ds.sample(i)
        assert image.shape == (3, *size) and image.dtype == np.float32 and 0 <= image.min() and image.max() <= 1
        assert read_image(image) == caption, i
        captions.append(caption)
    words = {w for c in captions for w in c.split()}
    assert {"red", "green", "blue", "yellow", "purple", "cyan", "square", "circle", "triangle", "top", "bottom",
            "left", "right"} <= words  # every attribute value occurs
    assert len(set(captions)) > 40


def test_deterministic_per_seed_and_index():
    a, b, other = (ImageCaptionDataset(50, **KW, seed=s) for s in (3, 3, 4))
    for i in (0, 7, 49):
        x, y = a[i], b[i]
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    assert torch.equal(a[7]["images"], b[7]["images"]) and not torch.equal(a[7]["images"], a[8]["images"])
    assert sum(torch.equal(a[i]["images"], other[i]["images"]) for i in range(50)) == 0
    with pytest.raises(IndexError):
        a[50]


def test_sample_layout():
    ds = ImageCaptionDataset(20, **KW, seed=1)
    for i in range(20):
        s, (_, caption) = ds[i], ds.sample(i)
        text = TOK.encode(caption) + [TOK.eod]
        n, t = 16, len(text)
        row = torch.cat([s["tokens"], s["labels"][-1:]])
        assert torch.equal(s["labels"][:-1], s["tokens"][1:])  # next-token targets
        assert (row[:n] == IMAGE_TOKEN).all() and row[n:n + t].tolist() == text and (row[n + t:] == TOK.pad).all()
        assert TOK.decode(row[n:n + t - 1].tolist()) == caption
        # targets predicted from text positions: the caption after its first word, and its eod
        assert s["loss_mask"].nonzero().flatten().tolist() == list(range(n, n + t - 1))
        assert s["images"].shape == (3, 32, 32) and torch.equal(s["position_ids"], torch.arange(32))


def test_builder_and_errors():
    cfg = DataConfig(seq_length=32, seed=5)
    calls = []
    train, valid, test = build_multimodal_datasets(cfg, TOK, train_samples=10, valid_samples=4, test_samples=0,
                                                   img_h=32, img_w=32, num_channels=3, num_image_tokens=16,
                                                   barrier=lambda: calls.append(1))
    assert (len(train), len(valid), test, calls) == (10, 4, None, [1])
    assert not torch.equal(train[0]["images"], valid[0]["images"])  # splits draw with their own seeds
    with pytest.raises(ValueError, match="--data-path"):
        build_multimodal_datasets(DataConfig(seq_length=32, data_path=["x"]), TOK, train_samples=1, valid_samples=0,
                                  test_samples=0, img_h=32, img_w=32, num_channels=3, num_image_tokens=16)
    with pytest.raises(ValueError, match="--seq-length 20 cannot hold 16 image tokens"):
        ImageCaptionDataset(1, **{**KW, "seq_length": 20}, seed=0)
    with pytest.raises(ValueError, match="--num-channels 1"):
        ImageCaptionDataset(1, **{**KW, "num_channels": 1}, seed=0)
    with pytest.raises(ValueError, match="at least 16 x 16"):
        ImageCaptionDataset(1, **{**KW, "img_h": 8}, seed=0)
