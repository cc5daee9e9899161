"""--clip-grad-norm bounds the first optimizer step of plain SGD to lr x the norm; --early-stopping ends a run that
stopped improving."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import scaletrain
from scaletrain.cli import main


def _first_step_size(mnist, clip: float) -> float:
    data = mnist.subset(torch.arange(64))
    torch.manual_seed(0)
    model = scaletrain.build_model("tinycnn", 1, 10)
    before = copy.deepcopy(model.state_dict())
    cfg = scaletrain.TrainConfig()
    cfg.optim.epochs, cfg.optim.batch_size, cfg.optim.lr, cfg.optim.momentum = 1, 64, 0.5, 0.0
    cfg.optim.weight_decay, cfg.optim.scheduler, cfg.optim.warmup_epochs = 0.0, "constant", 0.0
    cfg.optim.clip_grad_norm = clip
    cfg.run.output_dir, cfg.run.cpu = "", True
    scaletrain.fit(model, data, data, cfg)
    names = [n for n, _ in model.named_parameters()]
    after = model.state_dict()
    return torch.sqrt(sum(((after[n] - before[n]) ** 2).sum() for n in names)).item()


def test_clipping_bounds_the_step_and_off_leaves_it_alone(mnist):
    unclipped = _first_step_size(mnist, 0.0)
    clipped = _first_step_size(mnist, 0.01)
    assert clipped == pytest.approx(0.5 * 0.01, rel=1e-3)  # the gradient's norm was larger: cut to 0.01
    assert unclipped > 10 * clipped


def test_a_negative_norm_is_refused_by_flag(capsys, tmp_path):
    assert main(["train", "--clip-grad-norm", "-1", "--output-dir", str(tmp_path / "never")]) == 2
    assert "--clip-grad-norm must be" in capsys.readouterr().err and not (tmp_path / "never").exists()


def test_early_stopping_ends_the_run_when_validation_stops_improving(small_npz, tmp_path, capsys):
    out = tmp_path / "run"
    # A learning rate too small to change any prediction: the accuracy of epoch 1 is never beaten.
    assert main(["train", "--data", str(small_npz), "--model", "tinycnn", "--epochs", "10", "--lr", "1e-12",
                 "--early-stopping", "2", "--output-dir", str(out)]) == 0
    assert "early stopping: val_accuracy has not improved for 2 epoch(s)" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epochs_run"] == 3 and (out / "best.safetensors").exists()
    assert len((out / "metrics.csv").read_text().splitlines()) == 1 + 3
