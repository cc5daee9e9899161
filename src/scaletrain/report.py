"""Pictures and summaries of a run folder: the training curves, TensorBoard events, `scaletrain report`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import UserError
from .runfolder import atomic_write_bytes, png_bytes, pyplot, read_metrics


def curves_png(rows: list[dict[str, Any]], title: str = "") -> bytes:
    """Loss (train and validation) and validation accuracy against epoch, as a PNG."""
    epochs = [r["epoch"] for r in rows]
    fig, (ax1, ax2) = pyplot().subplots(1, 2, figsize=(10, 4))
    ax1.plot(epochs, [r["train_loss"] for r in rows], marker="o", label="train")
    ax1.plot(epochs, [r["val_loss"] for r in rows], marker="o", label="validation")
    ax1.set(xlabel="epoch", ylabel="loss", title="loss")
    ax2.plot(epochs, [100 * r["val_accuracy"] for r in rows], marker="o", color="tab:green")
    ax2.set(xlabel="epoch", ylabel="validation accuracy (%)", title="accuracy")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    ax1.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return png_bytes(fig)


def write_curves(run_dir: Path, rows: list[dict[str, Any]], title: str = "") -> Path:
    path = Path(run_dir) / "curves.png"
    atomic_write_bytes(path, curves_png(rows, title))
    return path


class EventLog:
    """TensorBoard event files in the run folder, when tensorboard is installed; otherwise nothing happens.

    Per optimizer step (at each --log-every): train/loss, train/lr, train/images_per_second. Per epoch, at the
    step that ended it: epoch/train_loss, epoch/val_loss, epoch/val_accuracy, epoch/lr, epoch/images_per_second.
    """

    def __init__(self, run_dir: Path, resume_step: int = 0):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is an optional extra: pip install 'scaletrain[tensorboard]'
            self.writer = None
            return
        # On resume, events logged after the checkpoint's step are dropped: they are about to be redone.
        self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=resume_step or None)

    def step(self, step: int, values: dict[str, float]) -> None:
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(f"train/{name}", value, step)

    def epoch(self, row: dict[str, Any], step: int) -> None:
        """An epoch's figures at the optimizer step that ended it (one x axis for every tag, which is also what
        purging on resume goes by)."""
        if self.writer is not None:
            for name in ("train_loss", "val_loss", "val_accuracy", "lr", "images_per_second"):
                self.writer.add_scalar(f"epoch/{name}", row[name], step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def curves_title(model: str, devices: int) -> str:
    return f"{model}, {devices} device(s)"


def report(run_dir: Path) -> tuple[str, Path]:
    """What `scaletrain report` prints (the run's settings, each epoch, the outcome), and curves.png drawn
    again from the same metrics."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    if not rows:
        raise UserError(f"{run_dir}: no metrics.csv with any epoch; not a scaletrain run folder, or not "
                        f"one epoch done yet")
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    lines = [f"run {run_dir}"]
    if summary:
        lines.append(f"model {summary.get('model')}, {summary.get('train_samples')} training samples, "
                     f"{summary.get('world_size')} process(es) on {summary.get('device')}, precision "
                     f"{summary.get('mixed_precision')}, global batch {summary.get('global_batch_size', '?')}, "
                     f"{summary.get('total_seconds', 0):.1f} s")
    else:
        lines.append("unfinished: no summary.json yet (resume it with scaletrain train --resume RUN_DIR)")
    lines += ["", "| epoch | train loss | val loss | val accuracy | lr | seconds | images/s |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['epoch']} | {r['train_loss']:.4f} | {r['val_loss']:.4f} | {r['val_accuracy']:.4f} | "
                     f"{r['lr']:.3g} | {r['epoch_seconds']:.1f} | {r['images_per_second']:,.0f} |")
    best = max(rows, key=lambda r: r["val_accuracy"])
    lines += ["", f"best val accuracy {best['val_accuracy']:.4f} at epoch {best['epoch']}; "
                  f"final {rows[-1]['val_accuracy']:.4f}"]
    title = curves_title(summary["model"], summary.get("devices", summary["world_size"])) if summary else ""
    try:
        curves = write_curves(run_dir, rows, title)
    except OSError as e:
        raise UserError(f"{run_dir}: cannot write curves.png there ({e.strerror})") from None
    return "\n".join(lines), curves
