"""JPEGs decoded on the training device in batches (`--decode device`): DataLoader workers only read each file's
bytes; torchvision's batched decoder (nvJPEG on a GPU, libjpeg-turbo on the CPU) decodes a whole batch at once and
each image is brought to the stored size there, as `read_image` brings it on the CPU. Cropping, resizing, flipping
and normalising then happen on the device as for any batch (see transforms.to_model_input).

`DeviceDecoder` decodes one batch ahead of the training, on a thread of its own (the decoder holds the thread until
its batch is done) and, on CUDA, on a stream of its own: the training's kernels and the decode overlap.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ..errors import UserError

JPEG_SUFFIXES = (".jpg", ".jpeg")


class EncodedFiles(Dataset):
    """Image files whose JPEGs are handed over undecoded, as bytes, for one batched decode on the device; other
    formats are decoded here, as their ImageFiles decodes them. Item i: (bytes or image, label)."""

    def __init__(self, files):
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, int]:
        path = self.files.paths[i]
        if os.path.splitext(path)[1].lower() in JPEG_SUFFIXES:
            with open(path, "rb") as f:
                return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8), int(self.files.labels[i]), i
        return (*self.files[i], i)


def encoded_batch(batch):
    """The collate of EncodedFiles: (the items as a list, the labels as a tensor, the items' indices)."""
    items, labels, indices = zip(*batch)
    return list(items), torch.tensor(labels), list(indices)


def fit_to_stored(image: torch.Tensor, size: int, recipe: str) -> torch.Tensor:
    """A decoded uint8 C x H x W image brought to the stored size x size on its device, as read_image does on the
    CPU: photo resizes the shorter side (bilinear, antialiased) and keeps the central square; digits resizes the
    whole image (bicubic, antialiased)."""
    x = image[None].float()
    h, w = x.shape[-2:]
    if recipe == "photo":
        scale = size / min(h, w)
        nh, nw = max(size, round(h * scale)), max(size, round(w * scale))
        if (nh, nw) != (h, w):
            x = F.interpolate(x, size=(nh, nw), mode="bilinear", antialias=True, align_corners=False)
        top, left = (nh - size) // 2, (nw - size) // 2
        x = x[..., top:top + size, left:left + size]
    elif (h, w) != (size, size):
        x = F.interpolate(x, size=(size, size), mode="bicubic", antialias=True, align_corners=False)
    return x.round_().clamp_(0, 255)[0].to(torch.uint8)


def decode_batch(items: list[torch.Tensor], files, device: torch.device, indices: list[int] | None = None
                 ) -> torch.Tensor:
    """One batch of EncodedFiles items: its JPEGs decoded together by torchvision's decoder on `device`, every
    image brought to the stored size there; N x C x S x S uint8 on the device. A JPEG the decoder refuses is a
    UserError naming its file (`indices`: the items' rows of `files`). On CUDA, call it with nothing queued on the
    current stream (see DeviceDecoder)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    mode = ImageReadMode.GRAY if files.channels == 1 else ImageReadMode.RGB
    jpegs = [k for k, item in enumerate(items) if item.ndim == 1]
    out = [item.to(device, non_blocking=True) if item.ndim == 3 else None for item in items]
    if jpegs:
        try:
            decoded = decode_jpeg([items[k] for k in jpegs], mode=mode, device=device)
        except RuntimeError as e:  # one file of the batch: found by decoding them one at a time
            for k in jpegs:
                try:
                    decode_jpeg(items[k], mode=mode, device=device)
                except RuntimeError as one:
                    where = files.paths[indices[k]] if indices is not None else f"item {k} of a batch"
                    raise UserError(f"{where}: cannot decode image on {device} ({_said(one)})") from None
            raise UserError(f"a batch of JPEGs cannot be decoded on {device} ({_said(e)}); --decode workers "
                            f"decodes them with Pillow") from None
        for k, image in zip(jpegs, decoded):
            out[k] = fit_to_stored(image, files.size, files.recipe)
    return torch.stack(out)  # type: ignore[arg-type]


def _said(error: Exception) -> str:
    """The decoder's reason without its source location ("decode_jpeg, <file>:<line>, <reason>")."""
    return str(error).strip().splitlines()[0].split(", ")[-1]


class DeviceDecoder:
    """Batches of EncodedFiles items decoded on `device` one batch ahead of their use, on one thread (and on CUDA
    one stream) of their own; with `to_host`, each batch's pixels also come back to the CPU (to be kept).

    nvJPEG's hardware decoder writes its output before the work already queued on its stream has run (torchvision
    issue 9606): the caching allocator may hand it memory that queued kernels are still to read, and the training
    reads garbage (a loss of NaN within a few steps). Here the decode stream carries nothing but the decodes and is
    drained before each one, and the training's stream waits for a batch before reading it and keeps its memory
    from reuse until it is done with it (record_stream)."""

    def __init__(self, files, device: torch.device, to_host: bool = False):
        self.files, self.device, self.to_host = files, device, to_host
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _decode(self, items: list[torch.Tensor], indices: list[int]):
        if self.stream is None:
            x = decode_batch(items, self.files, self.device, indices)
            return x, (x.cpu() if self.to_host else None), None
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.stream.synchronize()  # nothing queued when the hardware decoder writes (see the class)
            x = decode_batch(items, self.files, self.device, indices)
            host = x.cpu() if self.to_host else None  # waits for this stream only, never the training's
            done = torch.cuda.Event()
            done.record(self.stream)
        return x, host, done

    def _arrived(self, future: Future, labels: torch.Tensor):
        x, host, done = future.result()
        if done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)
            x.record_stream(current)
        return x, labels, host

    def each(self, batches: Iterable) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """(images on the device, labels as they came, the images on the CPU or None) for each (items, labels,
        indices) of encoded_batch."""
        pending = None
        with ThreadPoolExecutor(1, thread_name_prefix="scaletrain-decode") as pool:
            for items, labels, indices in batches:
                ahead = (pool.submit(self._decode, items, indices), labels)
                if pending is not None:
                    yield self._arrived(*pending)
                pending = ahead
            if pending is not None:
                yield self._arrived(*pending)
