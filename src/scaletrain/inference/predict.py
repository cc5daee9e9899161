"""Scoring with a trained model, on any number of processes, with exact results, and what is written from it.

Each rank scores its strided shard of the inputs (no padding, no duplicates); the logits are gathered back into
input order, so every rank holds the same N x classes matrix and the main process writes the files: a submission
CSV for `predict`, metrics and the confusion matrix for `evaluate`.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..data.batches import DeviceBatches, LoaderBatches, fits_on_device
from ..data.transforms import Preprocess
from ..data.types import ImageFiles, ImageSet
from ..errors import UserError
from ..parallel import Runtime
from ..runfolder import atomic_write_bytes, atomic_write_text, png_bytes, pyplot
from .inputs import Inputs


@torch.no_grad()
def predict_logits(model: torch.nn.Module, data: ImageSet | ImageFiles, pre: Preprocess, runtime: Runtime,
                   batch_size: int, num_workers: int = 2, channels_last: bool = True) -> torch.Tensor:
    """Logits (float32, N x classes) for every input in input order, identical on every rank."""
    if isinstance(data, torch.utils.data.IterableDataset):
        raise UserError("--data: chunked data (s3://... or prepared with --chunks) is streamed for training only; "
                        "scaletrain predict and evaluate read local data (prepare it into a folder without --chunks)")
    if len(data) == 0:
        raise UserError("no inputs to score")
    common = dict(train=False, rank=runtime.data_rank, world=runtime.data_world, seed=0, channels_last=channels_last)
    if isinstance(data, ImageSet) and fits_on_device(data.nbytes, runtime.device):
        batches = DeviceBatches(data, pre, runtime.device, batch_size, **common)
    else:
        batches = LoaderBatches(data, runtime.device, batch_size, num_workers=num_workers, pre=pre, **common)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = runtime.place(model)  # on the device; only this rank's shard under fsdp
    model.eval()
    parts = []
    with batches:  # its workers end with the pass
        for x, _ in batches.lockstep(runtime.forward_collective):
            with runtime.autocast():
                parts.append(model(x).float())
        if not parts:  # a rank with no inputs (fewer inputs than processes) still gives its empty share
            parts.append(model(batches.empty_batch()[0]).float())
    return runtime.gather_strided(torch.cat(parts), len(data)).cpu()


def classification_report(logits: torch.Tensor, labels: torch.Tensor, classes: list[str]) -> dict[str, Any]:
    """Loss, accuracy, per-class accuracy and the confusion matrix (rows: true class, columns: predicted)."""
    k = len(classes)
    if labels.max() >= k:
        raise UserError(f"label {int(labels.max())} is out of range for a model of {k} classes")
    pred = logits.argmax(1)
    confusion = torch.bincount(labels * k + pred, minlength=k * k).view(k, k)
    support = confusion.sum(1)
    per_class = {c: (confusion[i, i].item() / support[i].item()) if support[i] else None
                 for i, c in enumerate(classes)}
    return {"samples": len(labels), "loss": F.cross_entropy(logits.double(), labels).item(),
            "accuracy": (pred == labels).sum().item() / len(labels), "per_class_accuracy": per_class,
            "support": dict(zip(classes, support.tolist())), "confusion_matrix": confusion.tolist(),
            "classes": classes}


def check_writable(path: Path, name: str | None = None) -> None:
    """Refuse an output path before any work is done if it cannot be written; `name`: how the message names it
    (default `--output PATH`). Every process of a job may check at once: each probes with a file of its own."""
    name = name or f"--output {path}"
    parent = path.parent if path.parent != Path("") else Path(".")
    if path.is_dir():
        raise UserError(f"{name}: is a folder; give a file name")
    if not parent.is_dir():
        raise UserError(f"{name}: folder {parent} does not exist")
    probe = parent / f".{path.name}.{os.getpid()}.probe"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UserError(f"{name}: cannot write there ({e.strerror})") from None


def submission_csv(inputs: Inputs, logits: torch.Tensor, classes: list[str], top_k: int = 1,
                   probabilities: bool = False, raw_logits: bool = False) -> str:
    probs = logits.softmax(1)
    top = probs.topk(min(top_k, len(classes)), dim=1)
    header = [inputs.id_column, inputs.label_column]
    header += [f"{inputs.label_column}_{j + 1}" for j in range(1, top.indices.shape[1])]
    if probabilities:
        header += [f"p_{c}" for c in classes]
    if raw_logits:
        header += [f"logit_{c}" for c in classes]
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    names = np.array(classes, dtype=object)
    labels = names[top.indices.numpy()]
    for i, id_ in enumerate(inputs.ids):
        row = [id_, *labels[i].tolist()]
        if probabilities:
            row += [f"{p:.6f}" for p in probs[i].tolist()]
        if raw_logits:
            row += [f"{v:.7g}" for v in logits[i].tolist()]  # float32's precision
        writer.writerow(row)
    return buf.getvalue()


def confusion_png(report: dict[str, Any], path: Path) -> None:
    matrix = np.array(report["confusion_matrix"])
    classes = report["classes"]
    size = max(4.0, 0.5 * len(classes) + 2)
    fig, ax = pyplot().subplots(figsize=(size, size))
    ax.imshow(matrix, cmap="Blues")
    ax.set_xticks(range(len(classes)), classes, rotation=90 if len(classes) > 12 else 0)
    ax.set_yticks(range(len(classes)), classes)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(f"accuracy {report['accuracy']:.4f} on {report['samples']} samples")
    if len(classes) <= 30:
        high = matrix.max() / 2 if matrix.size else 0
        for (i, j), v in np.ndenumerate(matrix):
            ax.text(j, i, str(v), ha="center", va="center", fontsize=7, color="white" if v > high else "black")
    fig.tight_layout()
    atomic_write_bytes(path, png_bytes(fig, dpi=110))


def write_report(report: dict[str, Any], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rows = io.StringIO()
    writer = csv.writer(rows, lineterminator="\n")
    writer.writerow(["true \\ predicted", *report["classes"]])
    for c, row in zip(report["classes"], report["confusion_matrix"]):
        writer.writerow([c, *row])
    atomic_write_text(folder / "confusion_matrix.csv", rows.getvalue())
    atomic_write_text(folder / "metrics.json", json.dumps(report, indent=2) + "\n")
    confusion_png(report, folder / "confusion_matrix.png")
