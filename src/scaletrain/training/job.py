"""What a job settles once and every worker reads: the resolved settings and the checked data, and the launcher's
side of a job (`launch_job`).

Reading `--data` checks it (every CSV row, every image file's header) and, for image folders, builds the index
of files that passed. That happens once per machine, not once per process:

- `scaletrain train --nproc N` checks the data in the launching process before any worker starts (a bad file is
  reported there, once, exit 2), writes the resolved settings (config.Settings), the checked data and whether
  it holds the run folder for them (runfolder.JobHold) into the run folder's `.job/<host>/`, and starts the
  workers with `--job` pointing there: they read it and check and resolve nothing again. The folder is removed
  when the workers have finished.
- Workers started by another launcher (torchrun, accelerate launch, srun) do the same among themselves: the
  first process on each machine (local rank 0) checks and writes `.job/<host>/`, the others wait and read it;
  a failed check is reported by the main process alone.
- On several machines each machine checks its own view of the data once, into a folder named after its host,
  so the run folder may sit on a shared filesystem or not.

The checked data is stored without pickle: in-memory images and labels as safetensors, image-file indexes as
JSON (paths, labels, classes, channels, size).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ..config import BatchPlan, DataConfig, Settings
from ..data.read import load_image_sets
from ..data.sources.chunks import ChunkSet, open_chunks
from ..data.sources.prepared import open_prepared
from ..data.types import ImageFiles, ImageSet, PreparedSet, Skipped, StoredPixels
from ..errors import UserError
from ..runfolder import JobHold


JOB_DIR = ".job"


def job_folder(run_dir: str | Path, node_rank: int = 0) -> Path:
    """Where this machine's launcher (or first worker) writes what the job settled: one folder per host, and per
    node where several nodes of a job share a host (each launcher tells its own workers whether it holds the run
    folder for them)."""
    return Path(run_dir) / JOB_DIR / (socket.gethostname() + (f"-node{node_rank}" if node_rank else ""))


def remove_job(folder: Path) -> None:
    """Remove what `write_job` wrote, and .job/ itself once no machine's folder is left in it."""
    shutil.rmtree(folder, ignore_errors=True)
    try:
        folder.parent.rmdir()
    except OSError:  # another machine's folder is still there, or it is gone already
        pass


def check_data(data: DataConfig, seed: int) -> tuple[ImageSet | ImageFiles, ImageSet | ImageFiles, list[str]]:
    """Read and check --data: (train, validation, the samples skipped with --skip-bad-samples); `seed` splits off
    the validation set when the data has none."""
    skipped = Skipped() if data.skip_bad_samples else None
    train, val = load_image_sets(data, seed=seed, skipped=skipped)
    present = np.unique(np.asarray(train.labels))
    if len(present) < 2:
        raise UserError(f"--data {data.data}: the training samples are all of one class "
                        f"({train.classes[int(present[0])] if len(present) else 'none'}); a classifier learns from "
                        f"two or more")
    return train, val, list(skipped.entries) if skipped else []


def write_job(folder: Path, train, val, cache_dir: str, recorded: dict[str, dict[str, Any]] | None = None,
              plan: BatchPlan | None = None, held: bool = False) -> tuple:
    """The checked data (and, from scaletrain's launcher, the resolved settings as `recorded` by Settings.to_dict()
    with their batch `plan`, and whether it holds the run folder for the workers), for the workers to read (see
    `read_settings`); returns the data as written (a folder wanted in memory decoded)."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    meta: dict[str, Any] = {"classes": train.classes, "recipe": train.recipe, "held": held}
    if recorded is not None and plan is not None:
        meta.update(config=recorded, plan=plan.to_dict())
    # A folder wanted in memory is decoded here, once, for all the processes.
    train, val = (p.in_memory() if isinstance(p, ImageFiles) and p.wanted_in_memory else p for p in (train, val))
    # One larger than --cache-memory is decoded here to the folder's cache on disk, which every process reads.
    on_disk = [isinstance(p, ImageFiles) and p.keep is not None for p in (train, val)]
    for part, first_run in zip((train, val), on_disk):
        if first_run:
            part.to_disk()
    train, val = (p.stored() if first_run else p for p, first_run in zip((train, val), on_disk))
    if isinstance(train, PreparedSet):  # the workers map the shards verified here
        meta["prepared"] = {"location": train.store.location, "cache_dir": cache_dir}
    elif isinstance(train, ChunkSet):  # each worker streams its part
        meta["chunks"] = {"location": train.location, "cache_dir": cache_dir, "cache_limit": train.cache_limit}
    elif isinstance(train, (ImageFiles, StoredPixels)):
        meta["files"] = {"channels": train.channels, "size": train.size}
        for name, part in (("train", train), ("val", val)):
            files = part.files if isinstance(part, StoredPixels) else part
            meta["files"][name] = {"paths": [str(p) for p in files.paths], "labels": files.labels.tolist()}
            if isinstance(part, StoredPixels):  # read from the decoded pixels on disk
                meta["files"][name].update(stored=str(part.path), rows=part.rows.tolist())
    else:
        save_file({"train.images": train.images.contiguous(), "train.labels": train.labels.contiguous(),
                   "val.images": val.images.contiguous(), "val.labels": val.labels.contiguous()},
                  str(tmp / "data.safetensors"))
    (tmp / "job.json").write_text(json.dumps(meta))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.replace(folder)
    return train, val


def read_settings(folder: str | Path) -> Settings:
    """The settings the launcher resolved (defaults, --config file and flags, the run folder, the data's recipe
    and the batch plan), read back as they were resolved."""
    try:
        meta = json.loads((Path(folder) / "job.json").read_text())
        return Settings.from_dict(meta["config"], meta["plan"])
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"--job {folder}: cannot read its settings from job.json ({e})") from None


def launcher_held(job: str | None) -> bool:
    """Whether the launcher that wrote the job folder `job` holds the run folder for its workers."""
    if not job:
        return False
    try:
        return bool(json.loads((Path(job) / "job.json").read_text()).get("held"))
    except (OSError, ValueError) as e:
        raise UserError(f"--job {job}: cannot read job.json ({e})") from None


def read_data(folder: str | Path) -> tuple[ImageSet | ImageFiles, ImageSet | ImageFiles]:
    """The checked (train, validation) data that `write_job` stored."""
    folder = Path(folder)
    meta = json.loads((folder / "job.json").read_text())
    classes, recipe = meta["classes"], meta["recipe"]
    if "prepared" in meta:
        return open_prepared(meta["prepared"]["location"], meta["prepared"]["cache_dir"], check=False)
    if "chunks" in meta:
        return open_chunks(**meta["chunks"])
    if "files" in meta:
        f = meta["files"]
        parts = []
        for name in ("train", "val"):
            files = ImageFiles(f[name]["paths"], np.array(f[name]["labels"], dtype=np.int64),
                               classes, f["channels"], f["size"], recipe)
            stored = f[name].get("stored")
            parts.append(StoredPixels(Path(stored), np.array(f[name]["rows"], np.int64), files) if stored else files)
        return tuple(parts)  # type: ignore[return-value]
    t = load_file(str(folder / "data.safetensors"))
    return (ImageSet(t["train.images"], t["train.labels"], list(classes), recipe),
            ImageSet(t["val.images"], t["val.labels"], list(classes), recipe))


def worker_data(data: DataConfig, seed: int, run_dir: str, runtime, job: str | None = None):
    """This worker's (train, validation, skipped samples): read from `job` when scaletrain's launcher checked the
    data; else checked here when alone, or by the first process on each machine (into `run_dir`'s job folder) and
    read by the others."""
    if job:
        return (*read_data(job), [])  # the launcher listed the skipped samples
    if runtime.world_size == 1:
        return check_data(data, seed)
    folder = job_folder(run_dir, int(os.environ.get("GROUP_RANK", "0")))  # two nodes of a job may share a host
    first_here = int(os.environ.get("LOCAL_RANK", "0")) == 0
    error, loaded = None, None
    if first_here:
        try:
            checked = check_data(data, seed)
            loaded = (*write_job(folder, *checked[:2], data.cache_dir), checked[2])  # decoded once, kept here too
        except UserError as e:
            error = str(e)
    failed = runtime.sum(torch.tensor([float(error is not None)], device=runtime.device)).item()
    if failed:  # every process stops; the main process says why, once
        if runtime.is_main:
            raise UserError(error or "--data: the check failed on another machine (its log says why)")
        raise UserError("", quiet=True)
    if loaded is None:
        loaded = (*read_data(folder), [])
    runtime.barrier()  # everyone has read it before it goes
    if first_here:
        remove_job(folder)
    return loaded


# -- the launcher's side ------------------------------------------------------------------------------------
def launch_job(settings: Settings, nproc: int, command: list[str], hold: JobHold) -> int:
    """The launcher's side of a job: start `nproc` workers running `scaletrain *command --job FOLDER`, where FOLDER
    holds the settings and the data checked here once (and pretrained weights fetched once), then remove it;
    returns the job's exit code. (The whole settings: it resolves them with the data's recipe and writes them all
    for the workers.)"""
    from ..models import HUB_WEIGHTS, build_model, read_state_dict
    from ..parallel import Nodes, launch
    from ..parallel.launch import launched_at

    r, m = settings.run, settings.model
    if m.pretrained == HUB_WEIGHTS:  # fetched once here, so the workers find them in the cache
        build_model(m.model, 3, 2, hub_weights=True)
    elif m.pretrained:
        read_state_dict(m.pretrained)
    # The data checked once for this machine's workers, written with the settings, now resolved from the data's
    # recipe too, and whether the folder is held for them.
    t0 = time.perf_counter()
    train, val, skipped = check_data(settings.data, r.seed)
    folder = job_folder(r.output_dir, r.node_rank)
    resolved = settings.with_recipe(train.recipe or "digits")
    write_job(folder, train, val, settings.data.cache_dir, resolved.to_dict(), resolved.plan, held=hold.handed_on)
    print(f"checked {len(train)} training and {len(val)} validation samples in {time.perf_counter() - t0:.1f} s; "
          f"the workers read them from {folder}", flush=True)
    hold.list_skipped(skipped)
    hold.checks_passed()  # every check has passed: say who holds the folder
    os.environ["SCALETRAIN_LAUNCH_TIME"] = repr(launched_at())  # the workers count their first step from here
    try:
        code = launch(nproc, [*command, "--job", str(folder)], r.max_restarts,
                      Nodes(r.nnodes, r.node_rank, r.master_addr, r.master_port))
    finally:
        remove_job(folder)
    if code == 75 and _finished(Path(r.output_dir), settings.optim.epochs):  # the stop came as the workers finished
        print("scaletrain: the run had finished when the stop came; nothing to resume", file=sys.stderr)
        return 0
    return code


def _finished(run_dir: Path, epochs: int) -> bool:
    try:
        return json.loads((run_dir / "summary.json").read_text()).get("epochs") == epochs
    except (OSError, ValueError):
        return False
