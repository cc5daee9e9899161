"""A trained model as `predict`, `evaluate` and `export` take it: a run folder (its best.safetensors, else last)
or a .safetensors file, rebuilt from the metadata saved with the weights (model, classes, preprocessing) and
loaded without unpickling anything."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..data.transforms import Preprocess
from ..errors import UserError
from ..models import build_model, checkpoint_model
from ..runfolder import load_weights


def resolve_checkpoint(path: str) -> Path:
    """A run folder (its best.safetensors, else last) or a .safetensors file."""
    p = Path(path)
    if p.is_dir():
        for name in ("best.safetensors", "last.safetensors"):
            if (p / name).is_file():
                return p / name
        raise UserError(f"--checkpoint {path}: the folder holds no best.safetensors or last.safetensors")
    if not p.exists():
        raise UserError(f"--checkpoint {path}: no such file or folder")
    return p


@dataclass
class Checkpoint:
    model: torch.nn.Module
    model_name: str
    classes: list[str]
    preprocess: Preprocess
    meta: dict[str, Any]


def load_checkpoint(path: str, model_spec: str = "") -> Checkpoint:
    """Rebuild the model a checkpoint describes and load its weights (safetensors only: nothing is unpickled). A
    model of the user's code is built from `model_spec` (--model), else from the file it was trained with when
    that is unchanged and was trained with on this machine (see models.checkpoint_model)."""
    file = resolve_checkpoint(path)
    weights, meta = load_weights(file)
    if not meta.get("model") or not meta.get("preprocess") or not meta.get("classes"):
        raise UserError(f"{file}: not a scaletrain checkpoint (no model, classes or preprocessing in its metadata)")
    pre = Preprocess(**meta["preprocess"])
    spec, note = checkpoint_model(meta, model_spec)
    if note and os.environ.get("RANK", "0") == "0":
        print(note, file=sys.stderr, flush=True)
    model = build_model(spec, pre.channels, len(meta["classes"]), image_size=pre.image_size)
    broken = next((k for k, v in weights.items() if v.is_floating_point() and not torch.isfinite(v).all()), None)
    if broken is not None:
        raise UserError(f"{file}: tensor {broken} holds NaN or infinite values (weights of a run that diverged?); "
                        f"use an earlier checkpoint")
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[1].strip() if len(str(e).splitlines()) > 1 else str(e)
        raise UserError(f"{file}: weights do not fit model '{meta['model']}' ({first})") from None
    model.eval()
    return Checkpoint(model, meta["model"], list(meta["classes"]), pre, meta)
