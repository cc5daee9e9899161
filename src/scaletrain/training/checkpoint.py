"""Training state: where a run stands, and checkpoints that resume it exactly and load without unpickling.

A checkpoint is a folder `state/step-NNNNNNNN/` in the run folder:
  model.safetensors      the main process's model weights (parameters and buffers)
  optimizer.safetensors  optimizer tensors; the rest of the optimizer, scheduler and scaler state in train.json
  sharded/               instead of the two above where the layout splits the model (fsdp, --tp, pipeline
                         stages): model and optimizer state written by torch.distributed.checkpoint, each process
                         its own part, every tensor under its name in the whole model
  rank-R.safetensors     per rank: its BatchNorm buffers, its epoch loss totals and its torch/CUDA RNG states
  rank-R.json            per rank: Python and NumPy RNG states
  rank-R.step.pt         per rank, with a Step that has state: its state_dict() (loaded without running code)
  ema.safetensors        with --ema-decay: the weight average's whole tensors, gathered from every process's parts
  train.json             epoch, batch within the epoch, optimizer step, world size, the batch plan, the resolved
                         config, scheduler and scaler state
  manifest.json          SHA-256 of every file above; written last
Every rank writes its own files into a temporary folder, then the main process writes the shared ones and the
manifest and renames the folder into place: a checkpoint either exists whole or not at all. Loading checks the
manifest and falls back to the previous checkpoint when a file is missing, truncated or altered.

A run resumes with the settings it was saved with: a change that alters what training computes (data, model,
seed, optimizer, learning rate, schedule, augmentation, precision, global batch) is refused, naming each key.
--epochs may be raised to train on: the learning-rate schedule is re-planned over the new total from the saved
step, and the change is recorded in the run folder's resumes.jsonl.

A run resumes exactly on the process count and layout that saved it. It also resumes on another count and on
another layout (the parallel layer reads either format into any layout, parallel/saved.py) when the global batch is
the same (e.g. given by --global-batch-size): every global batch then holds the same samples, so training continues
with the same steps, up to floating-point summation order; BatchNorm statistics come from rank 0 and the dropout
random streams start afresh.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ..config import BatchPlan, RunConfig, trajectory_changes
from ..errors import UserError
from ..models import is_user_model, model_code
from ..parallel import BEAT, Layout, folder_bytes
from ..runfolder import FORMAT_VERSION, check_format, read_metrics, save_weights
from .own_step import check_step_state

STATE_DIR = "state"


@dataclass
class TrainState:
    """Where training stands: the epoch in progress (0-based), batches of it done, optimizer steps done overall,
    this rank's (loss sum, samples) of the epoch so far, and the epochs finished."""

    epoch: int = 0
    batch: int = 0
    step: int = 0
    totals: torch.Tensor | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    first_step_done: bool = False  # in this process (not saved): the first optimizer step is announced once
    stream: Any = None  # a resumable stream's state_dict() after the last trained batch (see data/streams.py)

    def next_epoch(self) -> None:
        self.epoch, self.batch, self.totals, self.stream = self.epoch + 1, 0, None, None


# -- files and their checksums ---------------------------------------------------------------------------------
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


def _verify(folder: Path) -> str | None:
    """Why this checkpoint cannot be trusted, or None."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
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


# -- may this job continue that checkpoint? --------------------------------------------------------------------
def check_resumable(folder: Path, train: dict[str, Any], recorded: dict[str, dict[str, Any]], plan: BatchPlan,
                    world_size: int, splits: bool) -> None:
    """Refuse, on one line, a checkpoint this job cannot continue step by step: another global batch, settings
    that change the trajectory, fewer epochs than are done, or what an earlier version wrote that this layout
    cannot read (`splits`: whether it splits the model). `recorded`: this job's settings as a checkpoint records
    them (Settings.to_dict()), compared with the checkpoint's; `plan`: this job's batch plan. The launcher runs the
    same check before any worker starts."""
    check_format(train.get("format_version", 1), folder)
    model_name, epochs = recorded["model"]["model"], recorded["optim"]["epochs"]
    saved_world, saved_sharded = train["world_size"], train.get("format") == "sharded"
    if saved_world != world_size and "plan" not in train and not saved_sharded:
        raise UserError(f"{folder}: saved by {saved_world} process(es) by an earlier version, resumed on "
                        f"{world_size}; resume with the same --nproc")
    if saved_world != world_size and (folder / "rank-0.stream.pt").is_file():
        raise UserError(f"{folder}: saved by {saved_world} process(es) reading a stream, whose position is kept per "
                        f"process; resume with --nproc {saved_world} (x --nnodes)")
    if splits and not saved_sharded and "names" not in (train.get("optimizer") or {}):
        raise UserError(f"{folder}: a whole checkpoint written before checkpoints named the optimizer's "
                        f"parameters; resume it where every process holds the model whole (one process, or "
                        f"--strategy ddp)")
    saved_batch, saved_accum = train.get("global_batch", plan.global_batch), train.get("grad_accum", plan.grad_accum)
    if saved_devices(train) != plan.devices:  # the accumulation follows the devices (BatchPlan.continuing)
        saved_accum = plan.grad_accum
    if (saved_batch, saved_accum) != (plan.global_batch, plan.grad_accum):
        raise UserError(f"{folder}: saved with a global batch of {saved_batch} (--grad-accum {saved_accum}), "
                        f"resumed with {plan.global_batch} (--grad-accum {plan.grad_accum}); resume with "
                        f"--global-batch-size {saved_batch} --grad-accum {saved_accum}")
    saved = train.get("config")
    if saved is None:  # written before checkpoints carried their config
        return
    changes = trajectory_changes(saved, recorded)
    saved_lr = train.get("plan", {}).get("lr", plan.lr)
    if saved_lr != plan.lr and not any(c.startswith("lr:") for c in changes):
        changes.append(f"lr (after --lr-scaling): saved {saved_lr!r}, now {plan.lr!r}")
    if changes:
        raise UserError(f"{folder.parent.parent}: cannot resume with settings that change the training ("
                        f"{'; '.join(changes)}); resume with the run's own settings (its config.yaml) or start a "
                        f"new --output-dir")
    saved_code = train.get("model_code")
    if saved_code and is_user_model(model_name):
        now = model_code(model_name)
        if now.sha256 != saved_code["sha256"]:
            raise UserError(f"{folder}: the model's code changed since this checkpoint ({now.file} has another "
                            f"SHA-256 than {saved_code['file']} had); restore the file as it was, or start a new "
                            f"--output-dir")
    done = train["epoch"] + (1 if train["batch"] else 0)
    if epochs < done:
        raise UserError(f"--epochs {epochs}: the run in {folder.parent.parent} has already trained "
                        f"{done} epoch(s); give --epochs {done} or more to continue it")


def read_train_json(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "train.json").read_text())


def newest_train_json(run_dir: str) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint of a run with a readable train.json, and that file, read without the checksums
    (loading checks them, and falls back); None when there is none."""
    if not run_dir:
        return None
    for folder in step_folders(Path(run_dir)):
        try:
            return folder, read_train_json(folder)
        except (OSError, ValueError):  # damaged: the workers report it and take the one before
            continue
    return None


def resumed_plan(run_dir: str, plan: BatchPlan, global_batch_given: bool) -> BatchPlan:
    """The batch plan this job continues the run in `run_dir` with: on another device count than its newest
    checkpoint's, the run's global batch and learning rate kept (see BatchPlan.continuing), unless
    --global-batch-size gives one (then compared as given); otherwise `plan` itself."""
    newest = None if global_batch_given else newest_train_json(run_dir)
    if newest is None or "plan" not in newest[1]:
        return plan
    folder, train = newest
    return plan.continuing(BatchPlan(**train["plan"]), str(folder))


def check_run_folder(r: RunConfig, recorded: dict[str, dict[str, Any]], plan: BatchPlan, resume: bool,
                     world_size: int) -> None:
    """Before any worker starts, in the launcher: the run folder can take this job (`_check_output_dir`), and a
    checkpoint in it can be resumed with these settings (`recorded`, as in `check_resumable`) and batch plan on
    `world_size` processes (`_check_resume`)."""
    _check_output_dir(r.output_dir, resume, recorded["optim"]["epochs"])
    _check_resume(r, recorded, plan, world_size)


def _check_output_dir(path: str, resume: bool, epochs: int) -> None:
    """A new run folder starts a run; one holding training state resumes it (a finished one only to train on,
    with more --epochs); anything else is left alone."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--output-dir {path}: exists and is not a folder")
    has_state = bool(step_folders(folder))
    if (folder / "summary.json").exists():
        done = json.loads((folder / "summary.json").read_text()).get("epochs", 0)
        if not (has_state and epochs > done):
            raise UserError(f"--output-dir {path}: holds a finished run of {done} epoch(s); raise --epochs to train "
                            f"it on, or choose another folder")
    if resume and not has_state:
        raise UserError(f"--resume {path}: no training state (state/step-*) to resume from")
    if not has_state and any((folder / n).exists() for n in ("last.safetensors", "best.safetensors")):
        raise UserError(f"--output-dir {path}: holds weights but no training state to resume from; "
                        f"choose another folder")


def _check_resume(r: RunConfig, recorded: dict[str, dict[str, Any]], plan: BatchPlan, world_size: int) -> None:
    """Refuse before any worker starts what the workers would refuse on resuming (the newest checkpoint's
    train.json, see newest_train_json)."""
    newest = newest_train_json(r.output_dir)
    if newest is not None:
        check_resumable(*newest, recorded, plan, world_size, Layout.of(r, world_size).splits_model)


# -- saving and resuming ---------------------------------------------------------------------------------------
class Checkpointer:
    """Owns a run's training state on disk: when to save, how many checkpoints to keep, writing them and
    resuming from the newest good one. Every process holds one and calls it at the same points of training."""

    def __init__(self, run_dir: Path, runtime, model: torch.nn.Module, optimizer, scheduler, r: RunConfig,
                 recorded: dict[str, dict[str, Any]], plan: BatchPlan, ema=None, hooks: dict[str, str] | None = None,
                 step=None, workers: dict[str, int] | None = None):
        """`r`: when to save, how many checkpoints to keep, the run's seed; `recorded`: the run's settings as every
        checkpoint records them (Settings.to_dict()), which a resume is checked against, its epochs and model
        among them; `plan`: the run's batch plan, recorded beside them."""
        self.run_dir, self.runtime, self.r, self.recorded, self.plan = run_dir, runtime, r, recorded, plan
        self.epochs, self.model_name = recorded["optim"]["epochs"], recorded["model"]["model"]
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler  # the unwrapped model
        self.ema = ema  # a WeightAverage, or None
        self.hooks = hooks or {}  # the user's own loss, optimizer and scheduler, by name (see hooks.UserCode)
        self.step = step  # a user's Step, whose state_dict() is saved per rank
        self.workers = workers or {}  # each split's DataLoader workers (--num-workers auto's decision, kept)

    def due(self, state: TrainState, batches_per_epoch: int | None) -> bool:
        """A periodic save (--checkpoint-every) falls at this step; one at an epoch's last batch is left to the
        end-of-epoch checkpoint."""
        every = self.r.checkpoint_every
        return bool(every) and state.step % every == 0 and (batches_per_epoch is None or
                                                            state.batch < batches_per_epoch)

    def save(self, state: TrainState) -> None:
        """Write a checkpoint cooperatively (every rank; under fsdp every rank writes its shard). A failure to
        write warns and leaves the previous checkpoint in place."""
        with BEAT.during("checkpoint", probe=folder_bytes(self.run_dir / STATE_DIR)):  # progress: bytes written
            self._save(state)

    def _save(self, state: TrainState) -> None:
        runtime = self.runtime
        root = self.run_dir / STATE_DIR
        final, tmp = root / f"step-{state.step:08d}", root / f".tmp-step-{state.step:08d}"
        totals = state.totals if state.totals is not None else torch.zeros(2)
        buffers = {f"buffer.{k}": v.detach().cpu().contiguous().clone() for k, v in self.model.named_buffers()}
        error, opt_plain = None, None
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            save_file({**buffers, **_rng_tensors(), "totals": totals.detach().cpu().clone()},
                      str(tmp / f"rank-{runtime.rank}.safetensors"))
            (tmp / f"rank-{runtime.rank}.json").write_text(json.dumps(_rng_plain()))
            if state.stream is not None:  # loaded back with torch.load(weights_only=True): no code runs
                torch.save(state.stream, tmp / f"rank-{runtime.rank}.stream.pt")
            step_state = self.step.state_dict() if self.step is not None else None
            if step_state:  # likewise
                check_step_state(step_state, type(self.step).__name__)  # a state the resume could not load
                torch.save(step_state, tmp / f"rank-{runtime.rank}.step.pt")
        except OSError as e:
            error = e
        except Exception as e:  # the user's state_dict: reported below by every rank, not raised by this one alone
            error = e
        try:  # collective under fsdp: every rank takes part even if its own files failed
            opt_plain = runtime.save_state(tmp, self.model, self.optimizer)
            if self.ema is not None:  # the average's whole tensors, gathered from every process's parts
                with self.ema.applied() as model:
                    save_weights(tmp / "ema.safetensors" if runtime.is_main else None, runtime.whole_tensors(model),
                                 {})
        except Exception as e:  # torch.distributed.checkpoint reports any rank's failure on every rank
            error = error or e
        # Every rank reports whether its part was written; the main process finishes only if all were.
        failures = runtime.sum(torch.tensor([float(error is not None)], device=runtime.device)).item()
        if runtime.is_main:
            if failures == 0:
                try:
                    self._finish(tmp, final, state, opt_plain)
                    for old in step_folders(self.run_dir)[self.r.keep_checkpoints:]:
                        shutil.rmtree(old, ignore_errors=True)
                except OSError as e:
                    error = e
            if error is not None or failures:
                shutil.rmtree(tmp, ignore_errors=True)
                warnings.warn(f"could not write checkpoint {final.name} ({error or 'another rank failed'}); "
                              f"training goes on and the previous checkpoint stays usable", stacklevel=2)
        runtime.barrier()

    def _finish(self, tmp: Path, final: Path, state: TrainState, opt_plain) -> None:
        train = {"format_version": FORMAT_VERSION, "epoch": state.epoch, "batch": state.batch, "step": state.step,
                 "world_size": self.runtime.world_size, "global_batch": self.plan.global_batch,
                 "grad_accum": self.plan.grad_accum, "plan": self.plan.to_dict(), "config": self.recorded,
                 "format": self.runtime.checkpoint_format, "optimizer": opt_plain,
                 "scheduler": self.scheduler.state_dict(), "scaler": self.runtime.scaler_state(),
                 **({"hooks": self.hooks} if self.hooks else {}), "num_workers": self.workers}
        if is_user_model(self.model_name):
            train["model_code"] = model_code(self.model_name).to_dict()
        (tmp / "train.json").write_text(json.dumps(train))

        manifest = {str(p.relative_to(tmp)): _sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        if final.exists():  # a stop at an epoch's last batch saved this step; now the epoch's end replaces it
            old = final.with_name(f".old-{final.name}")
            shutil.rmtree(old, ignore_errors=True)
            final.replace(old)
            tmp.replace(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.replace(final)

    def resume(self, say=print) -> TrainState | None:
        """Restore model, optimizer, scheduler, scaler, this rank's buffers and random states from the newest
        good checkpoint, and return where training stands; None when there is none.

        On another process count (sharded checkpoints only) every rank takes rank 0's BatchNorm statistics, the
        epoch's loss totals are carried by the main process, and random states stay as seeded."""
        folder = find_resumable(self.run_dir, say)
        if folder is None:
            return None
        runtime = self.runtime
        train = read_train_json(folder)
        check_resumable(folder, train, self.recorded, self.plan, runtime.world_size, runtime.splits_model)
        if train.get("hooks", {}) != self.hooks:
            raise UserError(f"{folder}: saved with {_hooks_text(train.get('hooks', {}))}, resumed with "
                            f"{_hooks_text(self.hooks)}; resume with the loss, optimizer, scheduler and "
                            f"sampler it was trained with")
        runtime.load_state(folder, self.model, self.optimizer, train)
        same_world = train["world_size"] == runtime.world_size
        rank_tensors = load_file(str(folder / f"rank-{runtime.rank if same_world else 0}.safetensors"))
        buffers = {k.removeprefix("buffer."): v for k, v in rank_tensors.items() if k.startswith("buffer.")}
        self.model.load_state_dict(buffers, strict=False)  # this rank's own BatchNorm statistics
        if self.ema is not None:
            if not (folder / "ema.safetensors").is_file():
                raise UserError(f"{folder}: saved without a weight average; resume without --ema-decay, or start a "
                                f"new run")
            self.ema.load(folder / "ema.safetensors")
        self.scheduler.load_state_dict(train["scheduler"])
        runtime.load_scaler_state(train["scaler"])
        if same_world:
            _restore_rng(rank_tensors, json.loads((folder / f"rank-{runtime.rank}.json").read_text()))
            totals = rank_tensors["totals"]
            stream = folder / f"rank-{runtime.rank}.stream.pt"
            stream_state = torch.load(stream, weights_only=True) if stream.is_file() else None
            self._restore_step(folder / f"rank-{runtime.rank}.step.pt")
        else:  # random streams re-derived from the run's seed, this rank and the step: not the run's first draws
            runtime.seed(int(np.random.SeedSequence([self.r.seed, runtime.random_rank, train["step"]])
                             .generate_state(1)[0]))
            stream_state = None
            self._restore_step(folder / "rank-0.step.pt")
            saved = [load_file(str(folder / f"rank-{r}.safetensors"))["totals"] for r in range(train["world_size"])]
            totals = torch.stack(saved).sum(0) if runtime.is_main else torch.zeros_like(saved[0])
        saved_epochs = train.get("config", {}).get("optim", {}).get("epochs", self.epochs)
        if saved_epochs != self.epochs:
            if "scheduler" in self.hooks:
                raise UserError(f"{folder}: your scheduler was made for {saved_epochs} epoch(s) and cannot be "
                                f"re-planned for {self.epochs}; resume with the epochs it was made for")
            self._replan_schedule()
        if runtime.is_main:
            self._record(folder, train, saved_epochs)
        epochs = self.epochs
        # The epoch's optimizer steps done, as micro-batches of this plan: the same samples come next.
        batch = -(-train["batch"] // train.get("grad_accum", self.plan.grad_accum)) * self.plan.grad_accum
        say(f"resuming from {folder}: epoch {train['epoch'] + 1}, batch {batch}, optimizer step "
            f"{train['step']}" + (f"; --epochs {saved_epochs} -> {epochs}: learning-rate schedule re-planned over "
                                  f"the new total" if saved_epochs != epochs else "") +
            _moved(train, self.plan, self.runtime.world_size))
        history = read_metrics(self.run_dir)[:train["epoch"]]
        return TrainState(train["epoch"], batch, train["step"], totals, history, stream=stream_state)

    def _restore_step(self, path: Path) -> None:
        """The user's Step given back its saved state_dict (a checkpoint written before it had one: left as made)."""
        if self.step is not None and path.is_file():
            self.step.load_state_dict(torch.load(path, weights_only=True, map_location=self.runtime.device))

    def _replan_schedule(self) -> None:
        """Continue from the saved step on the schedule of the new total: the rate of this very step too."""
        s = self.scheduler.scheduler  # scaletrain's own LambdaLR (a user's is refused above)
        for group, base, factor in zip(self.optimizer.param_groups, s.base_lrs, s.lr_lambdas):
            group["lr"] = base * factor(s.last_epoch)
        s._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def _record(self, folder: Path, train: dict[str, Any], saved_epochs: int) -> None:
        """One line per resume in resumes.jsonl: when, from which checkpoint, and any change of --epochs."""
        line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "checkpoint": folder.name, "epoch": train["epoch"],
                "batch": train["batch"], "step": train["step"], "world_size": self.runtime.world_size}
        if saved_epochs != self.epochs:
            line["epochs"] = [saved_epochs, self.epochs]
        with (self.run_dir / "resumes.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")


def saved_devices(train: dict[str, Any]) -> int:
    """The data-parallel devices a checkpoint was saved by (its processes, before checkpoints carried the plan)."""
    return train.get("plan", {}).get("devices", train["world_size"])


def _moved(train: dict[str, Any], plan: BatchPlan, processes: int) -> str:
    """What the resume message adds when the run continues on another process or device count (`processes`)."""
    saved = saved_devices(train)
    if (saved, train["world_size"]) == (plan.devices, processes):
        return ""
    return (f"; saved on {saved} device(s) by {train['world_size']} process(es), continuing on {plan.devices} "
            f"device(s) by {processes} process(es): the global batch stays {plan.global_batch} "
            f"({plan.batch_per_device} per device x {plan.grad_accum} accumulated), each step's samples as before")


def _hooks_text(hooks: dict[str, str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in hooks.items()) or "scaletrain's own loss, optimizer and scheduler"
