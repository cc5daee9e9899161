"""How uint8 images become model inputs, a whole batch at a time on its device: the recipe's crops, the --augment
operations, RandAugment, normalisation and resizing, random erasing (`to_model_input`), each sample with its own
random draws from the batch's generator (`augment_seed`). `Preprocess` describes it and is saved with the weights,
so inference needs no flags; `default_preprocess` makes it for a training set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..config import DataConfig
from .regularise import Regularise, randaugment, random_erasing
from .types import ImageFiles, ImageSet, mean_std


@dataclass
class Preprocess:
    """How raw uint8 images become model inputs; saved with the weights so inference needs no flags."""

    channels: int
    image_size: int
    mean: list[float] = field(default_factory=list)
    std: list[float] = field(default_factory=list)
    # digits: the whole image resized to image_size. photo: evaluation takes the central crop_pct of the image
    # (timm's crop_pct), training a RandomResizedCrop of `crop_scale` area and `crop_ratio` aspect when asked.
    recipe: str = "digits"
    crop_pct: float = 0.875
    crop_scale: tuple[float, float] = (0.08, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)


def input_size(data: ImageSet | ImageFiles, d: DataConfig) -> int:
    """The side of the model's square input: --image-size, else the data's own (photos: its central --crop-pct)."""
    return d.image_size or (round(data.image_size * d.crop_pct) if data.recipe == "photo" else data.image_size)


def default_preprocess(data: ImageSet | ImageFiles, d: DataConfig) -> Preprocess:
    """Normalisation by the training images' own statistics, at the configured channels and size, by the data's
    recipe (photos without --image-size: the central --crop-pct of their stored size)."""
    mean, std = mean_std(data)
    channels = d.channels or data.channels
    if len(mean) != channels:  # statistics of the converted images: grey is the mean of the colours
        mean, std = ([sum(mean) / len(mean)] * channels, [sum(std) / len(std)] * channels)
    recipe = data.recipe or "digits"
    size = input_size(data, d)
    if recipe == "digits":  # as saved before recipes existed
        return Preprocess(channels, size, mean, std)
    typed = d.typed()  # the ranges as numbers, whether resolved already or as given
    return Preprocess(channels, size, mean, std, recipe, d.crop_pct, typed.crop_scale, typed.crop_ratio)


def augment_seed(seed: int, rank: int, epoch: int, batch: int) -> int:
    """The augmentation seed of one batch of one rank (distinct across ranks, epochs and batches).

    Seeding per batch, not per epoch, lets a run resumed in the middle of an epoch draw exactly what the
    uninterrupted run drew, without saving a generator's state.
    """
    return (((seed * 1_000_003 + epoch) * 65_537 + rank) * 1_000_033 + batch) % (1 << 63)


def augment_batch(x: torch.Tensor, ops: tuple[str, ...], g: torch.Generator) -> torch.Tensor:
    """Random augmentations of a float batch in [0, 1], each sample with its own parameters."""
    b, c, h, w = x.shape
    dev = x.device

    def coin() -> torch.Tensor:
        return (torch.rand(b, generator=g, device=dev) < 0.5).view(b, 1, 1, 1)

    if "crop" in ops:
        # Random translation by up to ~7% of the side (2 px on 28x28), zero-filled: pad, then one gather.
        # Written by hand because torchvision's RandomCrop draws one offset for the whole batch.
        pad = max(1, round(h / 14))
        xp = F.pad(x, (pad, pad, pad, pad))
        dy = torch.randint(0, 2 * pad + 1, (b,), generator=g, device=dev)
        dx = torch.randint(0, 2 * pad + 1, (b,), generator=g, device=dev)
        rows = (dy[:, None] + torch.arange(h, device=dev))[:, None, :, None]
        cols = (dx[:, None] + torch.arange(w, device=dev))[:, None, None, :]
        x = xp[torch.arange(b, device=dev)[:, None, None, None], torch.arange(c, device=dev)[None, :, None, None],
               rows, cols]
    for op, dim in (("hflip", -1), ("vflip", -2)):
        if op in ops:  # a select, not an indexed copy: no data-dependent shapes, so no GPU sync
            x = torch.where(coin(), x.flip(dim), x)
    if "contrast" in ops or "brightness" in ops:
        # Both as one per-sample affine map x * alpha + beta; a sample not chosen gets alpha 1, beta 0.
        alpha, beta = torch.ones(b, 1, 1, 1, device=dev), torch.zeros(b, 1, 1, 1, device=dev)
        if "contrast" in ops:
            alpha = torch.where(coin(), torch.empty_like(alpha).uniform_(0.8, 1.2, generator=g), alpha)
        if "brightness" in ops:
            beta = torch.where(coin(), torch.empty_like(beta).uniform_(-0.2, 0.2, generator=g), beta)
        x = (x * alpha).add_(beta).clamp_(0, 1)
    return x


def random_resized_crop(x: torch.Tensor, size: int, scale: tuple[float, float], ratio: tuple[float, float],
                        g: torch.Generator, attempts: int = 10) -> torch.Tensor:
    """torchvision's RandomResizedCrop for a whole batch, each sample its own box, resampled in one op.

    A box of `scale` of the area and aspect ratio in `ratio` (log-uniform) is drawn up to `attempts` times per
    sample and the first that fits is taken (else the whole image, its ratio clamped, as torchvision does); then
    all boxes are resampled to size x size by roi_align, which averages several bilinear samples per output pixel
    when it shrinks (so little aliasing)."""
    from torchvision.ops import roi_align

    b, _, h, w = x.shape
    dev = x.device
    area = torch.empty(b, attempts, device=dev).uniform_(scale[0], scale[1], generator=g) * (h * w)
    aspect = torch.empty(b, attempts, device=dev).uniform_(math.log(ratio[0]), math.log(ratio[1]),
                                                           generator=g).exp_()
    cw, ch = (area * aspect).sqrt_().round_(), (area / aspect).sqrt_().round_()
    fits = (cw >= 1) & (cw <= w) & (ch >= 1) & (ch <= h)
    first = fits.to(torch.uint8).argmax(1, keepdim=True)  # the first attempt that fits (0 when none does)
    cw, ch = cw.gather(1, first).squeeze(1), ch.gather(1, first).squeeze(1)
    whole_w, whole_h = (w, h) if ratio[0] <= w / h <= ratio[1] else \
        ((w, round(w / ratio[0])) if w / h < ratio[0] else (round(h * ratio[1]), h))
    found = fits.any(1)
    cw = torch.where(found, cw, torch.full_like(cw, whole_w))
    ch = torch.where(found, ch, torch.full_like(ch, whole_h))
    u = torch.rand(b, 2, generator=g, device=dev)
    top = torch.where(found, (u[:, 0] * (h - ch + 1)).floor_(), ((h - ch) / 2).floor_())
    left = torch.where(found, (u[:, 1] * (w - cw + 1)).floor_(), ((w - cw) / 2).floor_())
    boxes = torch.stack([torch.arange(b, device=dev, dtype=x.dtype), left, top, left + cw, top + ch], 1)
    return roi_align(x, boxes.to(x.dtype), (size, size), spatial_scale=1.0, sampling_ratio=-1, aligned=True)


def center_crop(x: torch.Tensor, size: int, crop_pct: float) -> torch.Tensor:
    """The central crop_pct of the shorter side, resized to size x size when it is not that already."""
    h, w = x.shape[-2:]
    side = min(h, min(w, round(min(h, w) * crop_pct)))
    top, left = round((h - side) / 2), round((w - side) / 2)
    x = x[..., top:top + side, left:left + side]
    if side != size:
        x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return x


def to_model_input(x_uint8: torch.Tensor, pre: Preprocess, channels_last: bool, ops: tuple[str, ...] = (),
                   g: torch.Generator | None = None, reg: Regularise | None = None) -> torch.Tensor:
    """uint8 N x C x H x W on any device -> normalised float input of the model's size.

    Training batches go through the recipe in its fixed order: RandomResizedCrop (or the evaluation crop), the
    --augment operations (flips, ...), RandAugment, normalisation and resizing, random erasing. Mixup and cutmix,
    which need the labels, follow in the batch makers."""
    x = x_uint8.float().div_(255)
    if x.shape[1] != pre.channels:  # grey <-> colour, so a model made for one can read the other
        x = x.mean(1, keepdim=True) if pre.channels == 1 else x.expand(-1, pre.channels, -1, -1).contiguous()
    if "rrc" in ops:  # first, so the other operations work on the model's size
        x = random_resized_crop(x, pre.image_size, tuple(pre.crop_scale), tuple(pre.crop_ratio), g)
    elif pre.recipe == "photo":
        x = center_crop(x, pre.image_size, pre.crop_pct)
    if ops:
        x = augment_batch(x, ops, g)
    if reg is not None and reg.randaugment is not None:
        x = randaugment(x, *reg.randaugment, g, torch.tensor(pre.mean, device=x.device).view(1, -1, 1, 1))
    # Normalise before resizing: both are linear, and the image is smallest now (4x fewer pixels at 28 -> 56).
    mean = torch.tensor(pre.mean, device=x.device).view(1, -1, 1, 1)
    inv_std = 1 / torch.tensor(pre.std, device=x.device).view(1, -1, 1, 1)
    x = x.sub_(mean).mul_(inv_std)
    if x.shape[-1] != pre.image_size or x.shape[-2] != pre.image_size:
        x = F.interpolate(x, size=(pre.image_size, pre.image_size), mode="bicubic", antialias=True,
                          align_corners=False)
        # Bicubic overshoots; clip to what pixels in [0, 1] normalise to (scalar bounds are much faster).
        low, high = -mean * inv_std, (1 - mean) * inv_std
        if len(pre.mean) == 1:
            x = x.clamp_(low.item(), high.item())
        else:
            x = torch.clamp(x, low, high)
    if reg is not None and reg.random_erasing > 0:
        x = random_erasing(x, reg.random_erasing, g)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x
