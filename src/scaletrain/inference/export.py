"""A trained checkpoint as a file for serving without scaletrain: ONNX or TorchScript, with its preprocessing.

The model takes float32 N x C x H x W (only N free) and returns N x classes logits; the preprocessing, class names
and run it came from are recorded in the file. An export is written only after it has given PyTorch's logits on
real images, preprocessed as `predict` preprocesses them, in batches of more than one size.
"""

from __future__ import annotations

import dataclasses
import io
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..data.batches import DeviceBatches, LoaderBatches
from ..data.images import stored_size
from ..data.transforms import Preprocess
from ..data.types import ImageFiles, ImageSet, StoredPixels
from ..errors import UserError
from .checkpoint import Checkpoint, resolve_checkpoint
from .inputs import labelled_set, load_inputs

FORMATS = ("onnx", "torchscript")  # commands/export.py lists them too (to keep --help light)
INPUT_NAME, OUTPUT_NAME, BATCH_AXIS = "input", "logits", "batch"
META_KEY = "scaletrain"  # ONNX metadata_props key; TorchScript's extra file is META_KEY + ".json"
ONNX_PACKAGES = ("onnx", "onnxscript", "onnxruntime")


def require_packages(fmt: str) -> None:
    """Fail on one line, before any work, when the packages a format needs are not installed."""
    if fmt != "onnx":
        return  # TorchScript is part of torch
    try:
        for name in ONNX_PACKAGES:
            __import__(name)
    except ImportError:
        raise UserError("--format onnx needs onnx, onnxscript and onnxruntime: pip install 'scaletrain[export]'") \
            from None


# -- what the file records -------------------------------------------------------------------------------------
def serving_metadata(ckpt: Checkpoint, file: Path, fmt: str) -> dict[str, Any]:
    """Everything a server needs besides the graph: input layout, classes, and how images become inputs."""
    from .. import __version__

    pre = ckpt.preprocess
    side = stored_size(pre.recipe, pre.image_size, pre.crop_pct)
    if pre.recipe == "photo":
        steps = [f"convert to {'grey' if pre.channels == 1 else 'RGB'}",
                 f"resize the shorter side to {side} (bilinear, antialiased), keep the central {side}x{side}",
                 f"crop the central {pre.image_size}x{pre.image_size} (crop_pct {pre.crop_pct})"]
    else:
        steps = [f"convert to {'grey' if pre.channels == 1 else 'RGB'}",
                 f"resize the whole image to {pre.image_size}x{pre.image_size}"]
    steps += ["scale pixels to [0, 1] (divide by 255)", "subtract mean and divide by std, per channel",
              "lay out as float32 N x C x H x W"]
    return {
        "scaletrain_version": __version__, "format": fmt, "model": ckpt.model_name,
        "checkpoint": str(file), "epoch": ckpt.meta.get("epoch"),
        "input": {"name": INPUT_NAME, "dtype": "float32", "layout": "NCHW",
                  "shape": [BATCH_AXIS, pre.channels, pre.image_size, pre.image_size]},
        "output": {"name": OUTPUT_NAME, "shape": [BATCH_AXIS, len(ckpt.classes)], "meaning": "logits"},
        "classes": ckpt.classes,
        "preprocess": {**dataclasses.asdict(pre), "stored_size": side, "steps": steps},
    }


# -- the two formats -------------------------------------------------------------------------------------------
def _onnx_bytes(model: torch.nn.Module, example: torch.Tensor, metadata: str) -> bytes:
    batch = torch.export.Dim(BATCH_AXIS, min=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(model, (example,), dynamo=True, input_names=[INPUT_NAME],
                                    output_names=[OUTPUT_NAME], dynamic_shapes=({0: batch},), verbose=False)
    proto = program.model_proto
    entry = proto.metadata_props.add()
    entry.key, entry.value = META_KEY, metadata
    return proto.SerializeToString()


def _onnx_runner(data: bytes) -> Callable[[torch.Tensor], torch.Tensor]:
    import onnxruntime

    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    return lambda x: torch.from_numpy(session.run([OUTPUT_NAME], {INPUT_NAME: x.numpy()})[0])


def _torchscript_bytes(model: torch.nn.Module, example: torch.Tensor, metadata: str) -> bytes:
    buf = io.BytesIO()
    with warnings.catch_warnings():  # torch.jit is deprecated in favour of torch.export, but still what C++ reads
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(model, (example,))
        torch.jit.save(traced, buf, _extra_files={f"{META_KEY}.json": metadata})
    return buf.getvalue()


def _torchscript_runner(data: bytes) -> Callable[[torch.Tensor], torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = torch.jit.load(io.BytesIO(data), map_location="cpu")
    return lambda x: module(x)


EXPORTERS = {"onnx": (_onnx_bytes, _onnx_runner), "torchscript": (_torchscript_bytes, _torchscript_runner)}


# -- the check against PyTorch ---------------------------------------------------------------------------------
def check_images(ckpt: Checkpoint, data: str, data_format: str, limit: int) -> ImageSet | ImageFiles:
    """The images to check on: --data read as predict reads it, else the validation part of the run's own data
    (split as training split it); the first `limit` of them (0: all)."""
    if data:
        images = load_inputs(data, ckpt.preprocess, data_format).images
    else:
        saved = ckpt.meta.get("config", {}).get("data", {})
        run_data = saved.get("data", "default")
        try:
            images = labelled_set(run_data, "val", ckpt, saved.get("data_format", "auto"))
        except UserError as e:
            raise UserError(f"the run's data cannot be read here to check the export ({e}); give --data with "
                            f"images to check it on") from None
    if len(images) == 0:
        raise UserError(f"--data {data or 'of the run'}: no images to check the export on")
    if limit and len(images) > limit:
        images = (ImageSet(images.images[:limit], images.labels[:limit], images.classes, images.recipe)
                  if isinstance(images, ImageSet) else images.subset(torch.arange(limit))
                  if isinstance(images, StoredPixels) else
                  dataclasses.replace(images, paths=images.paths[:limit], labels=images.labels[:limit]))
    return images


def model_inputs(images: ImageSet | ImageFiles, pre: Preprocess, batch_size: int) -> Iterator[torch.Tensor]:
    """Float32 input batches on the CPU, preprocessed exactly as predict preprocesses them."""
    common = dict(train=False, rank=0, world=1, seed=0, channels_last=False)
    cpu = torch.device("cpu")
    if isinstance(images, ImageSet):
        batches = DeviceBatches(images, pre, cpu, batch_size, **common)
    else:
        batches = LoaderBatches(images, cpu, batch_size, num_workers=0, pre=pre, **common)
    for x, _ in batches.epoch(0):
        yield x.contiguous()


@dataclass
class Check:
    images: int = 0
    agreeing: int = 0  # images whose exported argmax is PyTorch's
    max_abs_diff: float = 0.0
    max_abs_logit: float = 0.0
    batch_sizes: set[int] = dataclasses.field(default_factory=set)

    def add(self, reference: torch.Tensor, exported: torch.Tensor, counted: bool = True) -> None:
        if exported.shape != reference.shape:
            raise UserError(f"the export gave logits of shape {tuple(exported.shape)} for a batch of "
                            f"{len(reference)}, PyTorch {tuple(reference.shape)}; nothing written")
        self.batch_sizes.add(len(reference))
        self.max_abs_diff = max(self.max_abs_diff, (exported - reference).abs().max().item())
        self.max_abs_logit = max(self.max_abs_logit, reference.abs().max().item())
        if counted:
            self.images += len(reference)
            self.agreeing += (exported.argmax(1) == reference.argmax(1)).sum().item()

    def passed(self, tolerance: float) -> bool:
        return self.agreeing == self.images and self.max_abs_diff <= tolerance * max(1.0, self.max_abs_logit)


@torch.no_grad()
def compare(model: torch.nn.Module, run: Callable[[torch.Tensor], torch.Tensor], batches: Iterator[torch.Tensor]
            ) -> Check:
    """PyTorch's logits against the export's on every batch, and on the first image alone as well (a batch
    size the others do not have unless there is a single image, then doubled), so the batch axis is exercised."""
    def exported(x: torch.Tensor) -> torch.Tensor:
        try:
            return run(x).float()
        except Exception as e:  # e.g. a runtime refusing a batch size the export fixed
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise UserError(f"the export failed on a batch of {len(x)} ({reason}); nothing written") from None

    check = Check()
    for k, x in enumerate(batches):
        check.add(model(x).float(), exported(x))
        if k == 0:
            alone = x[:1] if len(x) > 1 else x.expand(2, -1, -1, -1).contiguous()
            check.add(model(alone).float(), exported(alone), counted=False)
    return check


# -- the whole export ------------------------------------------------------------------------------------------
def export_checkpoint(ckpt: Checkpoint, checkpoint: str, fmt: str, output: Path, images: ImageSet | ImageFiles,
                      batch_size: int, tolerance: float) -> str:
    """Export, check against PyTorch, and only then write `output` atomically; returns the line to print."""
    from ..runfolder import atomic_write_bytes

    file = resolve_checkpoint(checkpoint)
    model = ckpt.model.float().eval()
    pre = ckpt.preprocess
    example = torch.zeros(2, pre.channels, pre.image_size, pre.image_size)  # 2: a batch of 1 would be fixed
    metadata = serving_metadata(ckpt, file, fmt)
    to_bytes, runner = EXPORTERS[fmt]
    try:
        data = to_bytes(model, example, json.dumps(metadata))
        run = runner(data)
    except Exception as e:  # the exporters raise many types; the model is fine, it just cannot be expressed
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UserError(f"--format {fmt}: model '{ckpt.model_name}' could not be exported ({reason})") from None
    check = compare(model, run, model_inputs(images, pre, batch_size))
    sizes = ", ".join(map(str, sorted(check.batch_sizes)))
    figures = (f"max abs logit difference {check.max_abs_diff:.3g} (largest logit {check.max_abs_logit:.3g}), "
               f"argmax agrees on {check.agreeing}/{check.images} images, batches of {sizes}")
    if not check.passed(tolerance):
        raise UserError(f"the {fmt} export does not match PyTorch ({figures}; --tolerance {tolerance:g}); "
                        f"{output} not written")
    atomic_write_bytes(output, data)
    return (f"wrote {output} ({fmt}, {len(data) / 1e6:.2f} MB, model {ckpt.model_name} from {file}); checked "
            f"against PyTorch: {figures}")
