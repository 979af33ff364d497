"""Vectorised numpy image augmentation for whole batches.

Every function takes a batch of images `(B, H, W, 3)` and, where random, a `np.random.Generator`
from which it draws a fixed number of values (independent of the outcome), so a batch's
augmentation depends only on the generator's seed: resuming a run reproduces it bit for bit.
"""

from __future__ import annotations

import numpy as np

# Random-resized-crop ranges of Inception / torchvision, used by ResMLP's ImageNet recipe.
RESIZED_CROP_SCALE = (0.08, 1.0)
RESIZED_CROP_RATIO = (3.0 / 4.0, 4.0 / 3.0)
_CROP_ATTEMPTS = 10


def pad_crop_flip(images: np.ndarray, rng: np.random.Generator, pad: int = 4) -> np.ndarray:
    """CIFAR augmentation: random H x W crop of the zero-padded image, then a random horizontal flip.

    Args:
      images: (B, H, W, C) any dtype (uint8 here).
      rng: source of the B crop offsets in [0, 2 * pad] per axis and B flips (probability 1/2).
      pad: pixels of zero padding on each side.

    Returns:
      (B, H, W, C), same dtype as `images`.
    """
    b, h, w, _ = images.shape
    padded = np.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    dy = rng.integers(0, 2 * pad + 1, size=b)
    dx = rng.integers(0, 2 * pad + 1, size=b)
    flip = rng.random(b) < 0.5
    rows = dy[:, None] + np.arange(h)
    cols = dx[:, None] + np.arange(w)
    cols = np.where(flip[:, None], cols[:, ::-1], cols)
    # One gather does crop and flip together.
    return padded[np.arange(b)[:, None, None], rows[:, :, None], cols[:, None, :]]


def random_resized_crop(
    images: np.ndarray,
    rng: np.random.Generator,
    size: int,
    scale: tuple[float, float] = RESIZED_CROP_SCALE,
    ratio: tuple[float, float] = RESIZED_CROP_RATIO,
) -> np.ndarray:
    """ImageNet training augmentation: random resized crop to `size` x `size`, random horizontal flip.

    Box sampling follows Inception/torchvision: area fraction uniform in `scale`, log aspect ratio
    uniform in log(`ratio`), first of 10 attempts that fits, else the largest centred box with a
    ratio in range. The box is resampled bilinearly (no antialiasing; with stored images about
    size / 0.875 pixels wide the downscale factor is at most about 1.14).

    Args:
      images: (B, H, W, C) uint8.
      rng: random source (draws a fixed number of values per batch).
      size: output height and width.

    Returns:
      (B, size, size, C) float32 with values in [0, 255].
    """
    b, h, w, _ = images.shape
    area = rng.uniform(scale[0], scale[1], size=(b, _CROP_ATTEMPTS)) * (h * w)
    aspect = np.exp(rng.uniform(np.log(ratio[0]), np.log(ratio[1]), size=(b, _CROP_ATTEMPTS)))
    crop_w = np.round(np.sqrt(area * aspect))
    crop_h = np.round(np.sqrt(area / aspect))
    fits = (crop_w >= 1) & (crop_w <= w) & (crop_h >= 1) & (crop_h <= h)
    first = np.argmax(fits, axis=1)
    found = fits.any(axis=1)
    fallback_w, fallback_h = _centre_box(h, w, ratio)
    crop_w = np.where(found, crop_w[np.arange(b), first], fallback_w)
    crop_h = np.where(found, crop_h[np.arange(b), first], fallback_h)
    uy = rng.random(b)
    ux = rng.random(b)
    top = np.where(found, np.floor(uy * (h - crop_h + 1)), (h - crop_h) // 2)
    left = np.where(found, np.floor(ux * (w - crop_w + 1)), (w - crop_w) // 2)
    flip = rng.random(b) < 0.5
    return _resample_boxes(images, top, left, crop_h, crop_w, size, flip)


def center_crop(images: np.ndarray, size: int) -> np.ndarray:
    """Central `size` x `size` window of (B, H, W, C) images (a view; H, W >= size)."""
    _, h, w, _ = images.shape
    if size > h or size > w:
        raise ValueError(f"image_size must be at most the stored image size {h}x{w}, got {size}")
    top, left = (h - size) // 2, (w - size) // 2
    return images[:, top : top + size, left : left + size]


def normalize(images: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """(B, H, W, 3) pixels in [0, 255] (uint8 or float) -> float32 (pixels / 255 - mean) / std."""
    mean_arr = np.asarray(mean, np.float32)
    std_arr = np.asarray(std, np.float32)
    # One multiply-add instead of three passes over the batch.
    return images.astype(np.float32) * (1.0 / (255.0 * std_arr)) - mean_arr / std_arr


def _centre_box(h: int, w: int, ratio: tuple[float, float]) -> tuple[int, int]:
    """Width and height of the largest centred box whose aspect ratio lies in `ratio`."""
    in_ratio = w / h
    if in_ratio < ratio[0]:
        return w, int(round(w / ratio[0]))
    if in_ratio > ratio[1]:
        return int(round(h * ratio[1])), h
    return w, h


def _resample_boxes(
    images: np.ndarray,
    top: np.ndarray,
    left: np.ndarray,
    box_h: np.ndarray,
    box_w: np.ndarray,
    size: int,
    flip: np.ndarray,
) -> np.ndarray:
    """Bilinear resampling of one box per image (all (B,) float arrays) to (B, size, size, C) float32."""
    b, h, w, _ = images.shape
    centres = (np.arange(size) + 0.5) / size
    # Pixel-centre convention: output pixel i samples the box at (i + 0.5) / size of its extent.
    src_y = np.clip(top[:, None] + centres * box_h[:, None] - 0.5, 0, h - 1)
    src_x = np.clip(left[:, None] + centres * box_w[:, None] - 0.5, 0, w - 1)
    src_x = np.where(flip[:, None], src_x[:, ::-1], src_x)
    y0 = np.floor(src_y).astype(np.int64)
    x0 = np.floor(src_x).astype(np.int64)
    y1 = np.minimum(y0 + 1, h - 1)
    x1 = np.minimum(x0 + 1, w - 1)
    wy = (src_y - y0).astype(np.float32)[:, :, None, None]
    wx = (src_x - x0).astype(np.float32)[:, None, :, None]
    batch = np.arange(b)[:, None, None]

    def gather(rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        return images[batch, rows[:, :, None], cols[:, None, :]].astype(np.float32)

    upper = gather(y0, x0) * (1 - wx) + gather(y0, x1) * wx
    lower = gather(y1, x0) * (1 - wx) + gather(y1, x1) * wx
    return upper * (1 - wy) + lower * wy
