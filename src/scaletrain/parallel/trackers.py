"""The experiment trackers a run can log to (TensorBoard, MLflow, W&B), as accelerate's tracker objects that the
Runtime's Accelerator starts, feeds and ends. What is logged under which name is training/experiment_log.py's concern."""

from __future__ import annotations

import os
from pathlib import Path

from accelerate.tracking import TensorBoardTracker

from ..errors import UserError


class TensorBoardAtFirstLog(TensorBoardTracker):
    """accelerate's TensorBoard tracker with its writer started by the first values logged (a step's or an
    epoch's), the run's settings written then, not as the run starts: importing TensorBoard and starting its writer
    and its thread are off the way to the first step (0.2-0.5 s sooner on 2 cores: medians and pairs of 8 runs,
    2026-11-29), as Lightning's loggers start theirs at first use."""

    def start(self) -> None:
        self.writer, self.settings = None, None

    def store_init_configuration(self, values: dict) -> None:
        self.settings = values
        if self.writer is not None:  # already started: written now, as accelerate's tracker does
            super().store_init_configuration(values)

    def _started(self):
        if self.writer is None:
            super().start()
            if self.settings is not None:
                super().store_init_configuration(self.settings)
        return self.writer

    @property
    def tracker(self):
        return self._started()

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        self._started()
        super().log(values, step, **kwargs)

    def log_images(self, values: dict, step: int | None = None, **kwargs) -> None:
        self._started()
        super().log_images(values, step, **kwargs)

    def finish(self) -> None:
        if self.writer is not None:  # nothing logged: no events file
            super().finish()


def build_trackers(names: tuple[str, ...], run_dir: Path, experiment: str, resume_step: int,
                   run_ids: dict[str, str]) -> list:
    """accelerate trackers for `names`: TensorBoard events in <run_dir>/tensorboard; an MLflow run and a W&B run
    named after the run folder, under `experiment` (the same runs again when `run_ids` holds their ids)."""
    from accelerate.tracking import MLflowTracker, WandBTracker

    trackers = []
    for name in names:
        if name == "tensorboard":
            # On resume, events of the steps after the checkpoint's are dropped: they are about to be redone. The
            # checkpoint's own step keeps its events (its epoch's values are logged after the checkpoint).
            purge_step = resume_step + 1 if resume_step else None
            trackers.append(TensorBoardAtFirstLog("tensorboard", str(run_dir), purge_step=purge_step))
        elif name == "mlflow":
            run_id = run_ids.get("mlflow")
            trackers.append(MLflowTracker(experiment, run_id=run_id, run_name=None if run_id else run_dir.name))
        elif name == "wandb":
            kwargs = {"name": run_dir.name, "id": run_ids.get("wandb"), "resume": "allow"}
            if "WANDB_DIR" not in os.environ:  # offline runs and wandb's files stay in the run folder
                kwargs["dir"] = str(run_dir)
            trackers.append(WandBTracker(experiment, **kwargs))
    return trackers


def started_run_ids(trackers: list) -> dict[str, str]:
    """The ids a resumed run needs to log into the same MLflow and W&B runs again."""
    ids = {}
    for tracker in trackers:
        if tracker.name == "mlflow":
            ids["mlflow"] = tracker.tracker.info.run_id
        elif tracker.name == "wandb":
            ids["wandb"] = tracker.tracker.id
    return ids


def explain_start_failure(error: Exception, run_ids: dict[str, str]) -> UserError | None:
    """A one-line error for a resumed MLflow run that the current tracking store does not hold."""
    if "mlflow" in run_ids and getattr(error, "error_code", "") == "RESOURCE_DOES_NOT_EXIST":
        import mlflow

        reason = str(error).splitlines()[0]
        return UserError(f"--log-with mlflow: cannot continue MLflow run {run_ids['mlflow']} (recorded in "
                         f"trackers.json) in the tracking store {mlflow.get_tracking_uri()} ({reason}); set "
                         f"MLFLOW_TRACKING_URI to the store the run was started with")
    return None
