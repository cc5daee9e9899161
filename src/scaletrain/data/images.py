"""One image file (or the bytes of one) as scaletrain reads it: checked from its header, decoded once, converted
to the channels asked for and brought to one square size by its recipe.

Nothing here knows about datasets: the sources call `read_image` for each file they hold, `ImageFiles` for each
item it serves. `read_image` never raises for a bad file; it says why the file cannot be used.
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp"}
# Larger images are refused: decoding one would take gigabytes (a decompression bomb, or a mistake).
MAX_IMAGE_PIXELS = 64_000_000
PHOTO_MIN_SIDE = 64  # colour images at least this large on their shorter side get the photo recipe
GREY_MODES = {"1", "L", "LA", "I", "I;16", "F"}
DEFAULT_FOLDER_SIZE = 224  # image files are decoded to this square size unless --image-size says otherwise


def read_image(path: str | Path | bytes, channels: int = 0, size: int = 0, recipe: str = "digits") -> tuple[
        np.ndarray | None, str | None]:
    """(pixels, None) or (None, why the file cannot be used); never raises for a bad file.

    The size is read from the header before anything is decoded (a decompression bomb is refused unread); then
    the image is decoded once, so a truncated or corrupt file is found before training, not during it. JPEGs are
    decoded at a reduced scale where that is enough (DCT scaling still reads every byte of the scan, so a file cut
    short is still found). With channels 0 the file is only checked (at 1/8 scale); else it is converted to
    `channels` and brought to size x size: digits resize the whole image (Lanczos); photo resizes the shorter side
    to `size` keeping the aspect ratio and keeps the central square (bilinear, as timm's evaluation resize); size 0
    keeps the image's own size. `path` may also be the bytes of an encoded image (an image column of a table).
    """
    from PIL import Image, UnidentifiedImageError

    try:
        if (len(path) if isinstance(path, bytes) else os.stat(path).st_size) == 0:
            return None, "empty file"
        with Image.open(io.BytesIO(path) if isinstance(path, bytes) else path) as img:
            w, h = img.size
            if w * h > MAX_IMAGE_PIXELS:
                return None, f"{w}x{h} pixels is larger than the safe limit of {MAX_IMAGE_PIXELS} pixels"
            mode = "L" if channels == 1 else "RGB"
            if not channels:
                if img.format == "JPEG":
                    img.draft(img.mode, (max(1, w // 8), max(1, h // 8)))
                img.load()
                return None, None
            if not size:
                img = img.convert(mode)
            elif recipe == "photo":
                scale = size / min(w, h)
                if img.format == "JPEG" and scale < 1:  # decode at the smallest DCT scale still >= the target
                    img.draft(mode, (math.ceil(w * scale), math.ceil(h * scale)))
                img = img.convert(mode)
                dw, dh = img.size  # after draft
                side = min(dw, dh)
                box = ((dw - side) / 2, (dh - side) / 2, (dw + side) / 2, (dh + side) / 2)
                if (dw, dh) != (size, size):
                    img = img.resize((size, size), Image.Resampling.BILINEAR, box=box)
            else:
                img = img.convert(mode)
                if img.size != (size, size):
                    img = img.resize((size, size), Image.Resampling.LANCZOS)
            array = np.array(img, dtype=np.uint8)  # a writable copy
    except UnidentifiedImageError:
        return None, "not an image file (format not recognised)"
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        return None, f"corrupt image ({e})"
    return (array[None] if array.ndim == 2 else array.transpose(2, 0, 1)), None


def check_image(path: str | Path) -> str | None:
    """Why the file cannot be used, or None: `read_image`'s check without decoding the common case. A JPEG or PNG
    whose header gives a size within the limit and whose last bytes are its end marker (a file cut short has none)
    is taken as it is; any other file is decoded at 1/8 scale as `read_image` checks it."""
    try:
        with open(path, "rb") as f:
            found = _jpeg_or_png_size(f)
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return "empty file"
            f.seek(-12, os.SEEK_END) if f.tell() >= 12 else f.seek(0)
            tail = f.read()
    except OSError:
        found = None
    if found is not None:
        kind, w, h = found
        if w * h > MAX_IMAGE_PIXELS:
            return f"{w}x{h} pixels is larger than the safe limit of {MAX_IMAGE_PIXELS} pixels"
        if tail.endswith(b"\xff\xd9") if kind == "JPEG" else b"IEND" in tail:
            return None
    return read_image(path)[1]


_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}  # JPEG frame headers


def _jpeg_or_png_size(f) -> tuple[str, int, int] | None:
    """("JPEG" or "PNG", width, height) from the header of the open file `f`, walking a JPEG's segments to its
    frame header (no more is read); None for any other file or a header that does not parse (then the caller
    decodes the file, which names what is wrong)."""
    head = f.read(24)
    if head.startswith(b"\x89PNG\r\n\x1a\n") and head[12:16] == b"IHDR":
        return "PNG", int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    if not head.startswith(b"\xff\xd8"):
        return None
    at = 2
    for _ in range(256):  # a JPEG has a few dozen segments before its frame at most
        f.seek(at)
        seg = f.read(9)
        if len(seg) < 4 or seg[0] != 0xFF:
            return None
        if seg[1] in _SOF:
            h, w = int.from_bytes(seg[5:7], "big"), int.from_bytes(seg[7:9], "big")
            return ("JPEG", w, h) if len(seg) == 9 and w and h else None
        if seg[1] == 0xFF:  # a fill byte
            at += 1
            continue
        at += 2 + int.from_bytes(seg[2:4], "big")
    return None


def decode_image(path: Path, channels: int, size: int, recipe: str = "digits") -> torch.Tensor:
    """uint8 C x size x size, as `read_image` makes it; a bad file is a UserError naming it."""
    array, why = read_image(path, channels, size, recipe)
    if array is None:
        raise UserError(f"{path}: cannot decode image ({why})")
    return torch.from_numpy(np.ascontiguousarray(array))


def stored_side(image_size: int, crop_pct: float) -> int:
    """The side photos are kept at (shorter side resized to it, then the central square): room for the crop, as
    timm's evaluation resizes to image_size / crop_pct before cropping image_size."""
    return max(image_size, math.floor(image_size / crop_pct))


def stored_size(recipe: str, image_size: int, crop_pct: float) -> int:
    """The side image files are decoded to for a model input of `image_size`: photos keep room for the crop."""
    return stored_side(image_size, crop_pct) if recipe == "photo" else image_size


def looks_like_photos(paths: list[str] | list[Path], sample: int = 16) -> bool:
    """Whether most of an evenly spaced sample of the files are colour images with a shorter side of at least
    PHOTO_MIN_SIDE pixels (headers only)."""
    from PIL import Image

    picked = paths[::max(1, len(paths) // sample)][:sample]
    votes = 0
    for path in picked:
        try:
            with Image.open(path) as img:
                votes += img.mode not in GREY_MODES and min(img.size) >= PHOTO_MIN_SIDE
        except (OSError, ValueError, SyntaxError):
            pass
    return votes * 2 > len(picked)
