"""Regularisation of training batches on the device: RandAugment / TrivialAugment, random erasing, mixup / cutmix.

Every operation works on a whole batch at once with each sample's own random choices (torchvision's v2 transforms
draw one choice per call), from the per-batch generator of the batch makers, so a resumed run draws exactly what
the uninterrupted run drew. `transforms.to_model_input` calls them in the recipe's fixed order; an option that is
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


# -- RandAugment -----------------------------------------------------------------------------------------------
def _grey(x: torch.Tensor) -> torch.Tensor:
    if x.shape[1] == 3:
        return (x * torch.tensor(GREY, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)).sum(1, keepdim=True)
    return x.mean(1, keepdim=True)


def _blend(a: torch.Tensor, b: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """PIL's ImageEnhance: b + factor (a - b), clipped to [0, 1]."""
    return (b + factor * (a - b)).clamp_(0, 1)


def _sharpen_base(x: torch.Tensor) -> torch.Tensor:
    """PIL's SMOOTH filter (3x3, centre weight 5 of 13), the image's border left as it is: the 3x3 sum (an average
    pooling, much faster than a depthwise convolution on CPUs) plus 4 more of the centre."""
    smooth = x.clone()
    smooth[..., 1:-1, 1:-1] = (F.avg_pool2d(x, 3, stride=1) * 9 + 4 * x[..., 1:-1, 1:-1]) / 13
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
    """Operation OPS[op[i]] at strength level[i] (0..1 of the range) in direction sign[i] on image i.

    The batch is grouped by operation (one sort, and one read of the group sizes by the host), so each image goes
    through its own operation only."""
    counts = torch.bincount(op, minlength=len(OPS)).tolist()
    order = op.argsort(stable=True)
    xs, signed, levels = x[order], (level * sign)[order], level[order]
    parts, start = [], 0
    for name, n in zip(OPS, counts):
        if n:
            part = slice(start, start + n)
            parts.append(_OPS[name](xs[part], signed[part], levels[part], fill))
            start += n
    out = torch.empty_like(x)
    out[order] = torch.cat(parts)
    return out


def _col(v: torch.Tensor) -> torch.Tensor:
    return v.view(-1, 1, 1, 1)


def _affine(x: torch.Tensor, fill: torch.Tensor, *rows: torch.Tensor) -> torch.Tensor:
    """Each image through its own affine map, given as its six coefficients (normalised coordinates)."""
    theta = torch.stack(rows, 1).view(-1, 2, 3).to(x.dtype)
    return _warp(x, theta, fill)


def _rotate(x, signed, level, fill):
    angle = signed * math.radians(MAX_ROTATE)
    zero = torch.zeros_like(angle)
    return _affine(x, fill, angle.cos(), -angle.sin(), zero, angle.sin(), angle.cos(), zero)


def _shear(axis: int):
    def op(x, signed, level, fill):
        s, one, zero = signed * MAX_SHEAR, torch.ones_like(signed), torch.zeros_like(signed)
        return _affine(x, fill, one, s if axis == 0 else zero, zero, s if axis == 1 else zero, one, zero)
    return op


def _translate(axis: int):
    def op(x, signed, level, fill):
        move, one, zero = signed * MAX_TRANSLATE * 2, torch.ones_like(signed), torch.zeros_like(signed)
        return _affine(x, fill, one, zero, move if axis == 0 else zero, zero, one, move if axis == 1 else zero)
    return op


def _enhance(base):
    def op(x, signed, level, fill):
        return _blend(x, base(x), _col(1 + signed * MAX_ENHANCE))
    return op


def _posterize(x, signed, level, fill):
    step = torch.exp2(_col((level * 4).round()))  # keep 8 - round(4 level) bits
    return ((x * 255).round() / step).floor() * step / 255


_OPS = {
    "identity": lambda x, signed, level, fill: x,
    "autocontrast": lambda x, signed, level, fill: _autocontrast(x),
    "equalize": lambda x, signed, level, fill: _equalize(x),
    "rotate": _rotate,
    "solarize": lambda x, signed, level, fill: torch.where(x > 1 - _col(level), 1 - x, x),
    "color": _enhance(lambda x: _grey(x).expand_as(x)),
    "posterize": _posterize,
    "contrast": _enhance(lambda x: _grey(x).mean((2, 3), keepdim=True).expand_as(x)),
    "brightness": _enhance(torch.zeros_like),
    "sharpness": _enhance(lambda x: _sharpen_base(x)),
    "shear_x": _shear(0),
    "shear_y": _shear(1),
    "translate_x": _translate(0),
    "translate_y": _translate(1),
}


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
