"""Training-state checkpoints that resume a run exactly, and load without unpickling anything.

A checkpoint is a folder `state/step-NNNNNNNN/` in the run folder:
  model.safetensors      the main process's model weights (parameters and buffers)
  optimizer.safetensors  optimizer tensors; the rest of the optimizer, scheduler and scaler state in train.json
  sharded/               instead of the two above under --strategy fsdp: model and optimizer state written by
                         torch.distributed.checkpoint, each process its own shard, loadable on any process count
  rank-R.safetensors     per rank: its BatchNorm buffers, its epoch loss totals and its torch/CUDA RNG states
  rank-R.json            per rank: Python and NumPy RNG states
  train.json             epoch, batch within the epoch, optimizer step, world size, scheduler state
  manifest.json          SHA-256 of every file above; written last
Every rank writes its own files into a temporary folder, then the main process writes the shared ones and the
manifest and renames the folder into place: a checkpoint either exists whole or not at all. Loading checks the
manifest and falls back to the previous checkpoint when a file is missing, truncated or altered.

A run resumes exactly on the process count that saved it. A sharded checkpoint also resumes on another count
when the global batch is the same (e.g. given by --global-batch-size): every global batch then holds the same
samples, so training continues with the same steps, up to floating-point summation order; BatchNorm statistics
come from rank 0 and the dropout random streams start afresh.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .errors import UserError

STATE_DIR = "state"


@dataclass
class TrainingState:
    """Where training stands, as saved or as loaded."""

    epoch: int  # the epoch in progress (0-based)
    batch: int  # batches of that epoch already done
    step: int  # optimizer steps done in the whole run
    world_size: int
    global_batch: int = 0  # samples per optimizer step over all processes
    grad_accum: int = 1
    path: Path | None = None
    shared: dict[str, Any] = field(default_factory=dict)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _rng_tensors() -> dict[str, torch.Tensor]:
    out = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng.cuda.{i}"] = s
    return out


def _rng_plain() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(internal), gauss],
            "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}


def _restore_rng(tensors: dict[str, torch.Tensor], plain: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["rng.torch"])
    if torch.cuda.is_available():  # by device index (as text, "rng.cuda.10" sorts before "rng.cuda.2")
        for k in (k for k in tensors if k.startswith("rng.cuda.")):
            index = int(k.rsplit(".", 1)[1])
            if index < torch.cuda.device_count():  # a GPU no longer visible has no stream to continue
                torch.cuda.set_rng_state(tensors[k], index)
    version, internal, gauss = plain["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = plain["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def step_folders(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, newest first."""
    root = run_dir / STATE_DIR
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-")), reverse=True)


def save_state(run_dir: Path, runtime, model: torch.nn.Module, optimizer, scheduler, state: TrainingState,
               totals: torch.Tensor, keep: int) -> None:
    """Write a checkpoint cooperatively: every rank must call this at the same point of training (under fsdp
    every rank writes its shard of model and optimizer)."""
    root = run_dir / STATE_DIR
    final = root / f"step-{state.step:08d}"
    tmp = root / f".tmp-step-{state.step:08d}"
    rank = runtime.rank
    buffers = {f"buffer.{k}": v.detach().cpu().contiguous().clone() for k, v in model.named_buffers()}
    error = None
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        save_file({**buffers, **_rng_tensors(), "totals": totals.detach().cpu().clone()},
                  str(tmp / f"rank-{rank}.safetensors"))
        (tmp / f"rank-{rank}.json").write_text(json.dumps(_rng_plain()))
    except OSError as e:
        error = e
    opt_plain = None
    try:  # collective under fsdp: every rank takes part even if its own files failed
        opt_plain = runtime.strategy.save(tmp, model, optimizer)
    except Exception as e:  # torch.distributed.checkpoint reports any rank's failure on every rank
        error = error or e
    # Every rank reports whether its part was written; the main process finishes only if all were.
    failures = runtime.sum(torch.tensor([float(error is not None)], device=runtime.device)).item()
    if runtime.is_main:
        if failures == 0:
            try:
                _finish(tmp, final, opt_plain, scheduler, state, runtime)
                _prune(run_dir, keep)
            except OSError as e:
                error = e
        if error is not None or failures:
            shutil.rmtree(tmp, ignore_errors=True)
            warnings.warn(f"could not write checkpoint {final.name} ({error or 'another rank failed'}); "
                          f"training goes on and the previous checkpoint stays usable", stacklevel=2)
    runtime.barrier()


def _finish(tmp: Path, final: Path, opt_plain, scheduler, state: TrainingState, runtime) -> None:
    train = {"epoch": state.epoch, "batch": state.batch, "step": state.step, "world_size": state.world_size,
             "global_batch": state.global_batch, "grad_accum": state.grad_accum,
             "format": runtime.strategy.checkpoint_format, "optimizer": opt_plain,
             "scheduler": scheduler.state_dict(), "scaler": runtime.strategy.scaler_state()}
    (tmp / "train.json").write_text(json.dumps(train))
    manifest = {str(p.relative_to(tmp)): _sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    tmp.replace(final)


def _prune(run_dir: Path, keep: int) -> None:
    for old in step_folders(run_dir)[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def _verify(folder: Path) -> str | None:
    """Why this checkpoint cannot be trusted, or None."""
    manifest_path = folder / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        return "manifest.json missing or unreadable"
    for name, digest in manifest.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if _sha256(path) != digest:
            return f"{name} does not match its checksum (truncated or altered)"
    return None


def find_resumable(run_dir: Path, say=print) -> Path | None:
    """The newest checkpoint that passes its checksums; each one skipped is reported."""
    for folder in step_folders(run_dir):
        problem = _verify(folder)
        if problem is None:
            return folder
        say(f"warning: checkpoint {folder} is unusable ({problem}); trying the one before it")
    return None


def _check_compatible(folder: Path, train: dict[str, Any], runtime, global_batch: int, grad_accum: int) -> None:
    """Refuse, on one line, a checkpoint this job cannot continue from step by step."""
    saved_world, sharded = train["world_size"], train.get("format") == "sharded"
    if saved_world != runtime.world_size and not sharded:
        raise UserError(f"{folder}: saved by {saved_world} process(es), resumed on {runtime.world_size}; resume "
                        f"with the same --nproc (runs with --strategy fsdp can resume on another count)")
    if runtime.sharded and not sharded:
        raise UserError(f"{folder}: saved without sharding; resume it with the --strategy it was trained with")
    saved_batch, saved_accum = train.get("global_batch", global_batch), train.get("grad_accum", grad_accum)
    if (saved_batch, saved_accum) != (global_batch, grad_accum):
        raise UserError(f"{folder}: saved with a global batch of {saved_batch} (--grad-accum {saved_accum}), "
                        f"resumed with {global_batch} (--grad-accum {grad_accum}); resume with "
                        f"--global-batch-size {saved_batch} --grad-accum {saved_accum}")


def load_state(folder: Path, runtime, model: torch.nn.Module, optimizer, scheduler, global_batch: int = 0,
               grad_accum: int = 1) -> TrainingState:
    """Restore model, optimizer, scheduler, scaler and this rank's buffers and RNG from a checkpoint.

    On another process count (sharded checkpoints only) every rank takes rank 0's BatchNorm statistics, the
    epoch's loss totals are carried by the main process, and random states stay as seeded."""
    train = json.loads((folder / "train.json").read_text())
    _check_compatible(folder, train, runtime, global_batch or train.get("global_batch", 0), grad_accum)
    same_world = train["world_size"] == runtime.world_size
    runtime.strategy.load(folder, model, optimizer, train)
    rank_tensors = load_file(str(folder / f"rank-{runtime.rank if same_world else 0}.safetensors"))
    buffers = {k.removeprefix("buffer."): v for k, v in rank_tensors.items() if k.startswith("buffer.")}
    model.load_state_dict(buffers, strict=False)  # this rank's own BatchNorm statistics
    scheduler.load_state_dict(train["scheduler"])
    runtime.strategy.load_scaler_state(train["scaler"])
    if same_world:
        _restore_rng(rank_tensors, json.loads((folder / f"rank-{runtime.rank}.json").read_text()))
        totals = rank_tensors["totals"]
    else:
        saved = [load_file(str(folder / f"rank-{r}.safetensors"))["totals"] for r in range(train["world_size"])]
        totals = torch.stack(saved).sum(0) if runtime.is_main else torch.zeros_like(saved[0])
    return TrainingState(train["epoch"], train["batch"], train["step"], train["world_size"],
                         train.get("global_batch", 0), train.get("grad_accum", 1), folder, {"totals": totals})
