"""One job of `scaletrain verify`, in each of its processes: the run trained for a few optimizer steps on one
layout (or on one process: the reference) and recorded at each step.

The job is `fit` itself on the first `steps` global batches of the training set, one epoch, from the same initial
weights and in the same order on every layout, with what cannot draw alike on two layouts turned off (dropout,
drop-path, augmentation, mixing; see `quieted`). A `Recorder` watches each optimizer step: the loss over every
process, the gradients' norm before clipping, and every weight after the step, gathered whole tensor by tensor (the
reference writes them; a layout's main process compares each with the reference's as it arrives, so no process
holds more than its part and one tensor). Before the steps `probe_at` names, every module's input and output in
one forward of a fixed batch (the reference's first, in evaluation mode) is written whole (parallel/capture.py):
the comparison in measure/verify.py names the first module that differs.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..runfolder import atomic_write_text
from .observe import StepObserver

JOB_VARIABLE = "SCALETRAIN_VERIFY_JOB"  # set by verify for the processes of one job: this module's VerifyJob


@dataclass
class VerifyJob:
    layout: str  # "1": the reference
    folder: str  # what the job writes: record.json, the reference's step files, probes
    steps: int
    probe_at: list[int] = field(default_factory=list)  # steps before which every module is captured
    reference: str = ""  # the reference job's folder ("" in the reference itself)

    @classmethod
    def from_environment(cls) -> "VerifyJob | None":
        text = os.environ.get(JOB_VARIABLE)
        return cls(**json.loads(text)) if text else None

    def environment(self) -> dict[str, str]:
        return {JOB_VARIABLE: json.dumps(asdict(self))}


STOCHASTIC = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def quieted(model: nn.Module) -> list[str]:
    """Turn off the modules that draw random numbers of their own, which a layout cannot draw as one process
    does: torch's dropouts, timm's DropPath, DropBlock and PatchDropout (any module with a drop_prob). Returns their
    names (those that were on)."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, STOCHASTIC) and module.p > 0:
            module.p = 0.0
        elif isinstance(getattr(module, "drop_prob", None), (int, float)) and module.drop_prob > 0:
            module.drop_prob = 0.0
        elif type(module).__name__ == "PatchDropout" and getattr(module, "prob", 0) > 0:
            module.prob = 0.0
        else:
            continue
        names.append(name or type(module).__name__)
    return names


def first_batches(data: Any, samples: int) -> Any:
    """The training set's first `samples` items (in its own order): `steps` global batches, one epoch."""
    if len(data) < samples:
        from ..errors import UserError

        raise UserError(f"verify: --steps x the global batch is {samples} samples; the training set has "
                        f"{len(data)}: lower --steps or --global-batch-size")
    if hasattr(data, "subset"):
        return data.subset(torch.arange(samples))
    return torch.utils.data.Subset(data, range(samples))


class Recorder(StepObserver):
    """What a verify job records at each optimizer step (see the module's doc)."""

    def __init__(self, job: VerifyJob, quiet: list[str]):
        self.job, self.folder = job, Path(job.folder)
        self.rows: list[dict[str, Any]] = []
        self.quiet = quiet
        self.previous = (0.0, 0.0)
        self.norm = 0.0
        self.random: list[str] = []
        self.buffers: list[str] = []
        self.optimizer = ""
        self.sync_bn = False

    def started(self, run) -> None:
        from ..parallel.engine import users_model
        from ..parallel.saved import inner_optimizer

        torch.use_deterministic_algorithms(True, warn_only=True)
        self.buffers = [name for name, _ in users_model(run.plain).named_buffers()]
        self.optimizer = type(inner_optimizer(run.optimizer)).__name__
        self.sync_bn = run.settings.model.sync_bn
        if 1 in self.job.probe_at:
            self.probe(run, 1)

    def stepping(self, run) -> None:
        self.norm = float(run.runtime.grad_norm(run.model).item())

    def stepped(self, run, state, step: int) -> None:
        summed = run.runtime.sum(state.totals.clone()).double()
        loss = (summed[0].item() - self.previous[0]) / max(summed[1].item() - self.previous[1], 1.0)
        self.previous = (summed[0].item(), summed[1].item())
        row = {"step": step, "loss": loss, "grad_norm": self.norm, "lr": run.schedule.lr, **self.weights(run, step)}
        self.rows.append(row)
        if step + 1 in self.job.probe_at:
            self.probe(run, step + 1)
        if run.runtime.is_main:
            self.write()

    def write(self) -> None:
        atomic_write_text(self.folder / "record.json", json.dumps(
            {"layout": self.job.layout, "steps": self.rows, "quieted": self.quiet, "random": self.random,
             "buffers": self.buffers, "optimizer": self.optimizer, "sync_bn": self.sync_bn}, indent=1))

    def weights(self, run, step: int) -> dict[str, Any]:
        """The reference: every tensor written (step-K.safetensors). A layout: the largest relative gap of any
        floating tensor to the reference's (its largest difference over the reference's largest value)."""
        from safetensors import safe_open
        from safetensors.torch import save_file

        tensors = run.runtime.whole_tensors(run.plain)
        read = (lambda name: tensors[name]) if isinstance(tensors, dict) else tensors.read
        names = sorted(tensors) if isinstance(tensors, dict) else [s.name for s in tensors.specs]
        if not self.job.reference:
            if run.runtime.is_main:
                save_file({k: read(k).detach().cpu().contiguous() for k in names},
                          str(self.folder / f"step-{step}.safetensors"))
            return {}
        seen = []  # (name, largest difference, the reference's largest value)
        with safe_open(str(Path(self.job.reference) / f"step-{step}.safetensors"), "pt") as ref:
            for name in names:
                t = read(name)
                if t is None or not t.is_floating_point():
                    continue
                r = ref.get_tensor(name).double()
                diff = (t.detach().cpu().double() - r).abs().max().item() if t.shape == r.shape else float("inf")
                seen.append((name, diff, r.abs().max().item()))
        if not run.runtime.is_main or not seen:
            return {}
        # each tensor's difference over its largest value, or the model's typical one (the median of its tensors'
        # largest values) where that is larger: a tensor that starts at zero (a bias) has moved a few steps only
        typical = sorted(s for _, _, s in seen)[len(seen) // 2]
        worst, where = max((diff / max(scale, typical, 1e-12), name) for name, diff, scale in seen)
        return {"weight_gap": worst, "weight_abs_gap": max(d for _, d, _ in seen), "worst_tensor": where}

    def probe(self, run, step: int) -> None:
        """Every module's input and output in one evaluation forward of the probe batch, before step `step`."""
        from safetensors import safe_open
        from safetensors.torch import save_file

        x, y = self.probe_batch(run)
        reference = None
        if self.job.reference:
            reference = {}
            for path in Path(self.job.reference).glob(f"probe-{step}-stage*.safetensors"):
                with safe_open(str(path), "pt") as f:
                    reference.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
        model = run.plain
        runs = 1 if self.job.reference else 2  # the reference forwards twice: what differs draws its own
        captured = []
        model.eval()
        for _ in range(runs):
            with torch.no_grad(), run.runtime.capture(model) as capture, run.runtime.autocast():
                run.calls.score(model, x, y)
            captured.append(run.runtime.captured(capture, reference))
        model.train()
        if captured[0] is None:
            return
        stage, tensors, split = captured[0]
        if runs == 2:
            again = captured[1][1]
            self.random = [k.split("|")[0] for k, t in tensors.items()
                           if k.endswith("|output") and k in again and not torch.equal(t, again[k])]
        save_file(tensors, str(self.folder / f"probe-{step}-stage{stage}.safetensors"),
                  metadata={"order": json.dumps(list(tensors)), "split": json.dumps(split)})

    def probe_batch(self, run):
        """The reference's first training batch, the same on every process of every layout."""
        path = Path(self.job.reference or self.job.folder) / "probe-batch.pt"
        if not self.job.reference and not path.exists():  # the reference's first probe: made here, kept for the rest
            x, y = run.train_batches.first_batch()
            torch.save({"x": x, "y": y}, str(path))
            return x, y
        batch = torch.load(str(path), map_location="cpu", weights_only=False)
        return _on(batch["x"], run.runtime.device), _on(batch["y"], run.runtime.device)


def _on(value: Any, device: torch.device) -> Any:
    """A batch's tensors (in tuples, lists, dicts, or an object with its own `to`) on `device`."""
    if isinstance(value, dict):
        return {k: _on(v, device) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_on(v, device) for v in value)
    return value.to(device) if hasattr(value, "to") else value


def job_config(config, job: VerifyJob):
    """The user's TrainConfig as this job trains it: the layout's settings, one epoch of the global batch the
    user gave (--global-batch-size, else --batch-size as the global batch) at the learning rate it gives, held
    constant (a schedule over a few steps would end at zero), in fp32, deterministic, nothing drawn that differs
    between layouts (augmentation, mixing), nothing logged or checkpointed, in the job's folder. (The whole
    config: it makes the job's.)"""
    import copy

    from ..parallel import layout_settings

    _, settings = layout_settings(job.layout)
    c = copy.deepcopy(config)
    batch = c.optim.global_batch_size or c.optim.batch_size
    c.optim = dataclasses.replace(c.optim, epochs=1, global_batch_size=batch, scheduler="constant", warmup_epochs=0)
    c.data = dataclasses.replace(c.data, augment=(), randaugment=None, mixup=0.0, cutmix=0.0)
    c.run = dataclasses.replace(c.run, **settings, output_dir=str(Path(job.folder) / "run"), deterministic=True,
                                mixed_precision="no", log_with="none", checkpoint_every=0, nnodes=1)
    return c.validate(), batch


def record(job: VerifyJob, model: Any, train_data: Any, config, batch: int, code=None, launched=None) -> None:
    """Train `model` (a module, or a function building it) on the job's batches with a Recorder watching; every
    process of the job calls it. (The whole config, the job's: it trains through fit.)"""
    from .hooks import UserCode
    from .loop import Launched, fit_launched
    from .signals import LoopControls

    Path(job.folder).mkdir(parents=True, exist_ok=True)
    quiet: list[str] = []

    def quiet_built():  # a function building the model (on the meta device where the layout splits it)
        built = model()
        quiet.extend(quieted(built))
        return built

    if isinstance(model, nn.Module):
        quiet = quieted(model)
    recorder = Recorder(job, quiet)
    launched = dataclasses.replace(launched or Launched(), controls=LoopControls.of_this_process(recorder))
    fit_launched(model if isinstance(model, nn.Module) else quiet_built, first_batches(train_data, job.steps * batch),
                 None, config, code or UserCode(), None, launched)


def run_command_job(job: VerifyJob, config) -> None:
    """A job of `scaletrain verify` from the command line, in each of its processes: data and model as `train`
    makes them (on the meta device where the layout splits the model), then `record`. (The whole config: a
    worker's entry point.)"""
    from ..parallel import runtime_for
    from ..runfolder import JobHold
    from .loop import Launched
    from .signals import STOP
    from .worker import data_and_model

    config, batch = job_config(config, job)
    STOP.install(patience=config.run.timeout)
    runtime = runtime_for(config.run)
    try:
        with JobHold.workers(config.run.output_dir, runtime, False) as held:
            train_set, _, model, preprocess = data_and_model(config.data, config.model, config.run, runtime, held)
            held.checks_passed()
            record(job, model, train_set, config, batch, launched=Launched(runtime, held, preprocess))
    finally:
        runtime.end()
