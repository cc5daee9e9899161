"""What the experiment trackers of --log-with (TensorBoard, MLflow, W&B) receive, and which trackers a run logs
to (trackers.json keeps the MLflow and W&B run ids a resumed run continues). The trackers themselves are started
through the Runtime (parallel/trackers.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import tracker_installed
from ..errors import UserError
from ..runfolder import atomic_write_text, metric_columns

if TYPE_CHECKING:
    from ..config import RunConfig
    from ..parallel import Runtime


TRACKERS_FILE = "trackers.json"  # the MLflow / W&B run ids a resumed run logs into again


def resolve_trackers(log_with: tuple[str, ...] | str, run_dir: Path) -> tuple[str, ...]:
    """The trackers --log-with (resolved: 'auto', 'none' or the names) asks for in this run folder: auto is
    tensorboard when it is installed, plus the trackers a resumed run was started with (trackers.json)."""
    if log_with == "none":
        return ()
    names = log_with if isinstance(log_with, tuple) else ()
    if not names:
        recorded = read_trackers_file(run_dir).get("log_with", [])
        names = tuple(dict.fromkeys([*(["tensorboard"] if tracker_installed("tensorboard") else []), *recorded]))
    for name in names:
        if not tracker_installed(name):
            raise UserError(f"{run_dir}: the run logs to {name} ({TRACKERS_FILE}), which is not installed: "
                            f"pip install 'scaletrain[{name}]', or resume with --log-with none")
    return names


def read_trackers_file(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / TRACKERS_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'optim': {'lr': 0.05}} as {'optim.lr': 0.05}."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class ExperimentLog:
    """What the experiment trackers of --log-with (TensorBoard, MLflow, W&B) receive; made on the main process.

    At the start: the resolved config and the batch plan as hyperparameters (`optim.lr`, `plan.global_batch`).
    Per optimizer step (at each --log-every): step/loss, step/lr, step/images_per_second. Per epoch, at the step
    that ended it: metrics.csv's columns under their own names. At the end: summary.json's numbers as summary/*.
    A resumed run logs into the same MLflow and W&B runs (ids in trackers.json) and the same TensorBoard folder,
    whose events after the checkpoint's step are dropped.
    """

    def __init__(self, runtime: Runtime, r: RunConfig, run_dir: Path, recorded: dict[str, dict[str, Any]],
                 plan: dict[str, Any], resume_step: int = 0):
        """`r`: the trackers (--log-with) and the experiment; `recorded` and `plan`: the run's settings as config.yaml
        records them (Settings.to_dict()) and its batch plan, logged as the hyperparameters."""
        self.runtime, self.run_dir = runtime, Path(run_dir)
        self.names = resolve_trackers(r.log_with, self.run_dir)
        run_ids = read_trackers_file(self.run_dir).get("run_ids", {})
        # every setting is a hyperparameter of the tracked run, as config.yaml records it
        hparams = {k: "none" if v is None else v for k, v in flat({**recorded, "plan": plan}).items()}
        ids = runtime.start_trackers(self.names, self.run_dir, r.experiment, hparams, resume_step, run_ids)
        if ids:  # only MLflow and W&B have runs to continue; TensorBoard needs nothing kept
            names = [n for n in self.names if n != "tensorboard"]
            atomic_write_text(self.run_dir / TRACKERS_FILE, json.dumps(
                {"log_with": names, "run_ids": {**run_ids, **ids}}, indent=2) + "\n")

    def step(self, step: int, values: dict[str, float]) -> None:
        self.runtime.log({f"step/{name}": value for name, value in values.items()}, step)

    def epoch(self, row: dict[str, Any], step: int) -> None:
        """An epoch's metrics.csv row at the optimizer step that ended it (one x axis for every metric, which is
        also what TensorBoard's purge on resume goes by)."""
        self.runtime.log({name: row[name] for name in metric_columns(row)}, step)

    def summary(self, summary: dict[str, Any], step: int) -> None:
        numbers = {f"summary/{k}": v for k, v in flat(summary).items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.runtime.log(numbers, step)

    def close(self) -> None:
        self.runtime.end_trackers()
