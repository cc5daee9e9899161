"""`scaletrain.train` as the training function of Ray Train's `TorchTrainer`: each epoch reported to Ray with a
checkpoint of the run's training state, and a restarted or continued Ray run resumed from Ray's latest checkpoint.

Ray forms the process group and sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT before it calls the
function; the runtime joins that group and leaves it to Ray. Ray is imported here only, and only inside Ray.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from ..runfolder import atomic_write_bytes, metric_columns
from .checkpoint import STATE_DIR, step_folders


def in_ray_worker() -> bool:
    """Whether this process runs a Ray Train training function (Ray is imported there already; never here)."""
    if "ray.train" not in sys.modules:
        return False
    import ray.train

    try:
        ray.train.get_context().get_world_rank()
    except Exception:  # Ray Train's functions raise RuntimeError outside a training function
        return False
    return True


def prepare(output_dir: str) -> Callable[[dict[str, Any], int], None]:
    """Ready this Ray worker to train into the run folder `output_dir`: the folder first takes Ray's latest
    checkpoint when that is newer than its own training state (rank 0 copies it, every worker waits); returns the
    `on_epoch` that reports every epoch to Ray."""
    import ray.train
    from ray.train.collective import barrier

    run_dir, rank = Path(output_dir), ray.train.get_context().get_world_rank()
    if rank == 0 and (checkpoint := ray.train.get_checkpoint()) is not None:
        with checkpoint.as_directory() as folder:
            if restore(Path(folder), run_dir):
                print(f"{step_folders(run_dir)[0]}: restored from Ray checkpoint {checkpoint.path}", flush=True)
    barrier()  # the run folder is complete before any worker reads it
    return Reporter(run_dir, rank).epoch


def restore(checkpoint: Path, run_dir: Path) -> bool:
    """Copy a reported checkpoint's training state and metrics.csv into the run folder, unless the run folder holds
    that step or a later one already; whether it copied."""
    saved, here = step_folders(checkpoint), step_folders(run_dir)
    if not saved or (here and here[0].name >= saved[0].name):
        return False
    target = run_dir / STATE_DIR / saved[0].name
    tmp = target.with_name(f".tmp-{target.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(saved[0], tmp)
    tmp.replace(target)
    atomic_write_bytes(run_dir / "metrics.csv", (checkpoint / "metrics.csv").read_bytes())
    return True


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a filesystem without hard links
        shutil.copy2(src, dst)


class Reporter:
    """Reports each epoch to Ray. Every worker reports (Ray waits for all of them); rank 0, which writes the run
    folder, adds a checkpoint holding what a resume reads: state/step-NNNNNNNN and metrics.csv."""

    def __init__(self, run_dir: Path, rank: int):
        self.run_dir, self.rank = run_dir, rank

    def epoch(self, row: dict[str, Any], step: int) -> None:
        import ray.train

        metrics = {name: row[name] for name in metric_columns(row)}
        saved = self.run_dir / STATE_DIR / f"step-{step:08d}"
        if self.rank != 0 or not saved.is_dir():  # not saved: the checkpointer warned and training goes on
            ray.train.report(metrics)
            return
        # Ray copies the folder into its storage before report returns; linked files make the folder cheap.
        with tempfile.TemporaryDirectory(prefix=".ray-checkpoint-", dir=self.run_dir) as tmp:
            shutil.copytree(saved, Path(tmp) / STATE_DIR / saved.name, copy_function=_link_or_copy)
            shutil.copy2(self.run_dir / "metrics.csv", Path(tmp) / "metrics.csv")
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
