"""--clip-grad-norm: the first optimizer step of plain SGD moves the weights by at most lr x the clipping norm."""

from __future__ import annotations

import copy

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
