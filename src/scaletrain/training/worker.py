"""Training from a `TrainConfig` in this process: data, model, pretrained weights and freezing
(`data_and_model`, which `tune` starts from too), then `fit`.

What `scaletrain train` runs in each worker and what `scaletrain.train` calls; launching workers, run-folder
checks and flags live in `commands/train.py`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..config import DataConfig, ModelConfig, RunConfig, Settings, TrainConfig
from ..data.transforms import default_preprocess, input_size
from ..models import HUB_WEIGHTS, build_model, freeze_backbone, hub_normalisation, load_matching, read_state_dict
from ..parallel import runtime_for
from ..runfolder import JobHold, atomic_write_text
from .job import launcher_held, worker_data
from .hooks import UserCode
from .loop import FitResult, Launched, fit_launched
from .signals import STOP


def run(cfg: TrainConfig | Settings, job: str | None = None, on_epoch=None, hold: JobHold | None = None) -> FitResult:
    """Train from a config (or the settings scaletrain's launcher resolved) in this process, one of possibly many
    launched; returns fit's FitResult. `job`: the folder where scaletrain's launcher left the checked data (see
    job.py); else it is checked here. `on_epoch`: see `fit`. `hold`: the run folder's hold, when the launcher in
    this very process took it; else this job's main process takes it unless the launcher holds it already. (The
    whole config: a worker's entry point, it hands it to `fit`.)"""
    # SIGTERM / SIGUSR1 (e.g. SLURM preemption): checkpoint at the next step, then stop; a stuck process exits
    STOP.install(patience=cfg.run.timeout)
    runtime = runtime_for(cfg.run)
    try:
        with JobHold.workers(cfg.run.output_dir, runtime, hold or launcher_held(job)) as held:  # one job a folder
            train_set, val_set, model, preprocess = data_and_model(cfg.data, cfg.model, cfg.run, runtime, held, job)
            held.checks_passed()
            return fit_launched(model, train_set, val_set, cfg, UserCode(), on_epoch,
                                Launched(runtime, held, preprocess))
    finally:
        runtime.end()


def data_and_model(d: DataConfig, m: ModelConfig, r: RunConfig, runtime, hold: JobHold, job: str | None = None):
    """(training set, validation set, model, preprocessing or None for the default) as every process of a run
    starts from them: the checked data (see job.py; the samples it skipped listed by the folder's `hold`), the same
    initial weights on every rank (`r`: the seed; the run folder), pretrained weights loaded and the backbone frozen
    as asked. Used by training and by `tune`."""
    train_set, val_set, skipped = worker_data(d, r.seed, r.output_dir, runtime, job)
    hold.list_skipped(skipped)
    runtime.seed(r.seed)  # identical initial weights on every rank
    channels = d.channels or train_set.channels
    hub = m.pretrained == HUB_WEIGHTS
    # a weights file read tensor by tensor where the strategy builds on the meta device; timm's hub weights and a
    # torch file are loaded into the whole model (matched by name and shape)
    by_tensor = m.pretrained.endswith(".safetensors") and runtime.builds_on_meta
    size = input_size(train_set, d) if hasattr(train_set, "image_size") else 0  # a fixed-size timm model's
    if m.pretrained and not by_tensor:
        model = build_model(m.model, channels, len(train_set.classes), hub_weights=hub, image_size=size)
    else:  # on the meta device where the strategy splits the model: each process materialises its part
        model = runtime.build(lambda: build_model(m.model, channels, len(train_set.classes),
                                                           image_size=size))
    preprocess = None
    if hub and (norm := hub_normalisation(m.model)) and len(norm[0]) == channels:
        # inputs normalised as the pretrained weights expect them, not by the data's own statistics
        preprocess = dataclasses.replace(default_preprocess(train_set, d), mean=norm[0], std=norm[1])
    if m.pretrained and not hub:
        skipped_tensors = runtime.pretrained_from(m.pretrained, model) if by_tensor else \
            load_matching(model, read_state_dict(m.pretrained), m.pretrained)
        if runtime.is_main and skipped_tensors:
            listing = Path(r.output_dir) / "pretrained_skipped.txt"
            atomic_write_text(listing, "\n".join(skipped_tensors) + "\n")
            shown = "; ".join(skipped_tensors[:3]) + (f"; and {len(skipped_tensors) - 3} more"
                                                     if len(skipped_tensors) > 3 else "")
            print(f"--pretrained: {len(skipped_tensors)} tensor(s) not loaded ({shown}); "
                  f"all listed in {listing}", flush=True)
    if m.freeze == "backbone":
        trainable = freeze_backbone(model)
        if runtime.is_main:
            print(f"--freeze backbone: training {trainable} head parameters only", flush=True)
    return train_set, val_set, model, preprocess
