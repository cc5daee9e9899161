"""Regularisation of training batches on the device: RandAugment / TrivialAugment, random erasing, mixup / cutmix.

Every operation works on a whole batch at once with each sample's own random choices (torchvision's v2 transforms
draw one choice per call), from the per-batch generator of the batch makers, so a resumed run draws exactly what
the uninterrupted run drew. `pipeline.to_model_input` calls them in the recipe's fixed order; an option that is
off draws nothing. The ranges follow timm's RandAugment (magnitude M out of 10, every operation stronger as M grows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

# One operation of these per slot and sample (torchvision's RandAugment set: Invert and SolarizeAdd left out).
OPS = ("identity", "autocontrast", "equalize", "rotate", "solarize", "color", "posterize", "contrast", "brightness",
       "sharpness", "shear_x", "shear_y", "translate_x", "translate_y")
MAX_ROTATE, MAX_SHEAR, MAX_TRANSLATE, MAX_ENHANCE = 30.0, 0.3, 0.45, 0.9  # at magnitude 10 (timm's ranges)
GREY = (0.299, 0.587, 0.114)  # ITU-R 601-2 luma, as PIL's convert("L")


@dataclass(frozen=True)
class Regularise:
    """What a training batch gets beyond the crops and flips of --augment; all off by default.

    randaugment: (operations per image, magnitude 0..10), or (1, -1) for TrivialAugment (one operation, its
    magnitude drawn per image). random_erasing: probability per image. mixup / cutmix: Beta(alpha, alpha) for the
    mixing weight (0: off); mix_prob: share of batches mixed; switch_prob: with both on, share mixed by cutmix.
    """

    randaugment: tuple[int, int] | None = None
    random_erasing: float = 0.0
    mixup: float = 0.0
    cutmix: float = 0.0
    mix_prob: float = 1.0
    switch_prob: float = 0.5
    num_classes: int = 0

    @property
    def on_device(self) -> bool:
        """Whether it draws from the batch's device generator (mixing draws on the CPU)."""
        return self.randaugment is not None or self.random_erasing > 0

    @property
    def mixes(self) -> bool:
        return (self.mixup > 0 or self.cutmix > 0) and self.mix_prob > 0


def parse_randaugment(spec: str) -> tuple[int, int] | None:
    """'' -> None; 'trivial' -> (1, -1); 'N,M' -> (N, M). Raises ValueError for anything else."""
    spec = spec.strip().lower()
    if not spec:
        return None
    if spec == "trivial":
        return (1, -1)
    n, m = (int(v) for v in spec.split(","))
    if n < 1 or not 0 <= m <= 10:
        raise ValueError(spec)
    return (n, m)


# -- RandAugment -----------------------------------------------------------------------------------------------
def _grey(x: torch.Tensor) -> torch.Tensor:
    if x.shape[1] == 3:
        return (x * torch.tensor(GREY, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)).sum(1, keepdim=True)
    return x.mean(1, keepdim=True)


def _blend(a: torch.Tensor, b: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """PIL's ImageEnhance: b + factor (a - b), clipped to [0, 1]."""
    return (b + factor * (a - b)).clamp_(0, 1)


def _sharpen_base(x: torch.Tensor) -> torch.Tensor:
    """PIL's SMOOTH filter (3x3, centre weight 5 of 13), the image's border left as it is."""
    c = x.shape[1]
    kernel = torch.ones(3, 3, device=x.device, dtype=x.dtype)
    kernel[1, 1] = 5
    kernel = (kernel / 13).expand(c, 1, 3, 3)
    smooth = x.clone()
    smooth[..., 1:-1, 1:-1] = F.conv2d(x, kernel, groups=c)
    return smooth


def _autocontrast(x: torch.Tensor) -> torch.Tensor:
    low = x.amin((2, 3), keepdim=True)
    high = x.amax((2, 3), keepdim=True)
    span = high - low
    return torch.where(span > 0, (x - low) / span.clamp_min(1e-12), x)


def _equalize(x: torch.Tensor) -> torch.Tensor:
    """PIL's equalize, each image and channel its own histogram (256 bins of the 8-bit values)."""
    b, c, h, w = x.shape
    v = (x * 255).round_().long().clamp_(0, 255).reshape(b * c, h * w)
    hist = torch.zeros(b * c, 256, device=x.device, dtype=x.dtype).scatter_add_(1, v, torch.ones_like(x).view(
        b * c, h * w))
    last = torch.where(hist > 0, torch.arange(256, device=x.device), 0).amax(1, keepdim=True)
    step = ((h * w - hist.gather(1, last)) / 255).floor_()
    lut = ((hist.cumsum(1) + (step / 2).floor_()) / step.clamp_min(1)).floor_()
    lut = F.pad(lut, (1, 0))[:, :-1].clamp_(0, 255)
    out = lut.gather(1, v) / 255
    return torch.where(step > 0, out, v / 255).view(b, c, h, w)


def _warp(x: torch.Tensor, theta: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """Each image through its own affine map (normalised coordinates), outside filled with `fill`."""
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x - fill, grid, mode="bilinear", padding_mode="zeros", align_corners=False) + fill


def randaugment(x: torch.Tensor, n_ops: int, magnitude: int, g: torch.Generator,
                fill: torch.Tensor) -> torch.Tensor:
    """RandAugment (magnitude 0..10) or, with magnitude -1, TrivialAugment, on a float batch in [0, 1] of square
    images: `n_ops` operations per image, each image its own, with its own sign; `fill` (1 x C x 1 x 1) fills what
    rotations, shears and translations uncover."""
    b, dev = x.shape[0], x.device
    for _ in range(n_ops):
        op = torch.randint(0, len(OPS), (b,), generator=g, device=dev)
        level = torch.rand(b, generator=g, device=dev) if magnitude < 0 else torch.full((b,), magnitude / 10,
                                                                                         device=dev)
        sign = torch.where(torch.rand(b, generator=g, device=dev) < 0.5, -1.0, 1.0)
        x = apply_ops(x, op, level, sign, fill)
    return x


def apply_ops(x: torch.Tensor, op: torch.Tensor, level: torch.Tensor, sign: torch.Tensor,
              fill: torch.Tensor) -> torch.Tensor:
    """Operation OPS[op[i]] at strength level[i] (0..1 of the range) in direction sign[i] on image i."""
    b = x.shape[0]
    col = (b, 1, 1, 1)
    signed = level * sign

    def chosen(name: str) -> torch.Tensor:
        return (op == OPS.index(name)).view(col)

    # Geometry: one affine map per image (the identity for images given another operation), one resampling.
    angle = torch.where(op == OPS.index("rotate"), signed * math.radians(MAX_ROTATE), 0.0)
    shear_x = torch.where(op == OPS.index("shear_x"), signed * MAX_SHEAR, 0.0)
    shear_y = torch.where(op == OPS.index("shear_y"), signed * MAX_SHEAR, 0.0)
    move_x = torch.where(op == OPS.index("translate_x"), signed * MAX_TRANSLATE * 2, 0.0)
    move_y = torch.where(op == OPS.index("translate_y"), signed * MAX_TRANSLATE * 2, 0.0)
    cos, sin = angle.cos(), angle.sin()
    theta = torch.stack([torch.stack([cos, -sin + shear_x, move_x], 1),
                         torch.stack([sin + shear_y, cos, move_y], 1)], 1)
    geometric = chosen("rotate") | chosen("shear_x") | chosen("shear_y") | chosen("translate_x") | \
        chosen("translate_y")
    out = torch.where(geometric, _warp(x, theta.to(x.dtype), fill), x)

    # Colour: each operation over the whole batch (cheap, elementwise), kept where it was drawn.
    factor = (1 + signed * MAX_ENHANCE).view(col)
    grey = _grey(x)
    out = torch.where(chosen("brightness"), _blend(x, torch.zeros_like(x), factor), out)
    out = torch.where(chosen("color"), _blend(x, grey.expand_as(x), factor), out)
    out = torch.where(chosen("contrast"), _blend(x, grey.mean((2, 3), keepdim=True).expand_as(x), factor), out)
    out = torch.where(chosen("sharpness"), _blend(x, _sharpen_base(x), factor), out)
    step = torch.exp2((level * 4).round()).view(col)  # keep 8 - round(4 level) bits
    out = torch.where(chosen("posterize"), ((x * 255).round() / step).floor() * step / 255, out)
    out = torch.where(chosen("solarize") & (x > 1 - level.view(col)), 1 - x, out)
    out = torch.where(chosen("autocontrast"), _autocontrast(x), out)
    return torch.where(chosen("equalize"), _equalize(x), out)


# -- random erasing --------------------------------------------------------------------------------------------
def random_erasing(x: torch.Tensor, p: float, g: torch.Generator, attempts: int = 10) -> torch.Tensor:
    """timm's RandomErasing (mode 'pixel') on a normalised batch: each image, with probability p, gets one
    rectangle of 2% to 1/3 of its area and aspect 0.3 to 3.3 filled with normal noise (the first of `attempts`
    draws that fits)."""
    b, c, h, w = x.shape
    dev = x.device
    erase = torch.rand(b, generator=g, device=dev) < p
    area = torch.empty(b, attempts, device=dev).uniform_(0.02, 1 / 3, generator=g) * (h * w)
    aspect = torch.empty(b, attempts, device=dev).uniform_(math.log(0.3), math.log(1 / 0.3), generator=g).exp_()
    eh, ew = (area * aspect).sqrt_().round_(), (area / aspect).sqrt_().round_()
    fits = (eh < h) & (ew < w) & (eh >= 1) & (ew >= 1)
    first = fits.to(torch.uint8).argmax(1, keepdim=True)
    eh, ew = eh.gather(1, first).squeeze(1), ew.gather(1, first).squeeze(1)
    u = torch.rand(b, 2, generator=g, device=dev)
    top, left = (u[:, 0] * (h - eh + 1)).floor_(), (u[:, 1] * (w - ew + 1)).floor_()
    rows = torch.arange(h, device=dev).view(1, h, 1)
    cols = torch.arange(w, device=dev).view(1, 1, w)
    inside = (rows >= top.view(b, 1, 1)) & (rows < (top + eh).view(b, 1, 1)) & \
        (cols >= left.view(b, 1, 1)) & (cols < (left + ew).view(b, 1, 1))
    mask = (inside & (erase & fits.any(1)).view(b, 1, 1)).unsqueeze(1)
    noise = torch.randn(x.shape, generator=g, device=dev, dtype=x.dtype)
    return torch.where(mask, noise, x)


# -- mixup and cutmix ------------------------------------------------------------------------------------------
def mix(x: torch.Tensor, y: torch.Tensor, reg: Regularise, rng: np.random.Generator
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """timm's Mixup in batch mode: with probability mix_prob, the batch is blended with itself reversed (mixup) or
    gets a box of the reversed batch pasted in (cutmix), one weight for the batch from Beta(alpha, alpha); labels
    become the same mixture of one-hot targets (N x classes). Unmixed batches keep their class indices.
    Draws come from `rng`, a NumPy generator of this batch: no device synchronisation."""
    if rng.random() >= reg.mix_prob:
        return x, y
    use_cutmix = reg.cutmix > 0 and (reg.mixup <= 0 or rng.random() < reg.switch_prob)
    alpha = reg.cutmix if use_cutmix else reg.mixup
    lam = float(rng.beta(alpha, alpha))
    other = x.flip(0)
    if use_cutmix:
        h, w = x.shape[-2:]
        cut = math.sqrt(1 - lam)
        ch, cw = int(h * cut), int(w * cut)
        cy, cx = int(rng.integers(0, h)), int(rng.integers(0, w))
        top, bottom = max(cy - ch // 2, 0), min(cy + ch // 2, h)
        left, right = max(cx - cw // 2, 0), min(cx + cw // 2, w)
        x = x.clone()
        x[..., top:bottom, left:right] = other[..., top:bottom, left:right]
        lam = 1 - (bottom - top) * (right - left) / (h * w)  # the share actually kept
    else:
        x = x * lam + other * (1 - lam)
    one_hot = F.one_hot(y, reg.num_classes).float()
    return x, one_hot * lam + one_hot.flip(0) * (1 - lam)
