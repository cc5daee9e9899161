"""The training loop through the Python API, in one process."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import Dataset

import scaletrain
from scaletrain.engine import TrainingDiverged, lr_factor
from scaletrain.errors import UserError


def _config(tmp_path, **optim):
    cfg = scaletrain.TrainConfig()
    cfg.run.output_dir = str(tmp_path)
    cfg.data.augment = "none"
    cfg.optim.warmup_epochs = 0
    for k, v in optim.items():
        setattr(cfg.optim, k, v)
    return cfg


def _linear():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 10))


def test_global_batch_and_lr_scaling_resolve_for_each_device_count():
    cfg = scaletrain.TrainConfig()
    cfg.optim.global_batch_size, cfg.optim.grad_accum, cfg.optim.batch_size = 256, 2, 7
    cfg.validate()
    plans = [cfg.plan(n) for n in (1, 2, 4)]
    assert [p.batch_per_device for p in plans] == [128, 64, 32]
    assert {p.global_batch for p in plans} == {256}
    assert cfg.optim.batch_size == 7, "the config as asked is left alone"
    with pytest.raises(UserError, match="cannot be shared evenly by 3 device"):
        cfg.plan(3)
    for kind, expected in (("none", 0.1), ("linear", 0.4), ("sqrt", 0.2)):
        scaled = scaletrain.TrainConfig()
        scaled.optim.lr, scaled.optim.lr_scaling = 0.1, kind
        assert scaled.validate().plan(4).lr == pytest.approx(expected)


def test_schedules():
    assert [round(lr_factor(s, 10, 4, "constant"), 2) for s in range(6)] == [0.2, 0.4, 0.6, 0.8, 1.0, 1.0]
    assert lr_factor(4, 10, 4, "cosine") == 1.0 and lr_factor(9, 10, 4, "cosine") < 0.1
    onecycle = [lr_factor(s, 10, 4, "onecycle") for s in range(4, 10)]
    assert onecycle == sorted(onecycle, reverse=True) and onecycle[-1] == pytest.approx(1 / 6)


class _Pairs(Dataset):
    def __init__(self, data):
        self.x = data.images.float().div(255)
        self.y = data.labels

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def test_fit_with_a_users_model_and_dataset(tmp_path, mnist):
    train, val = _Pairs(mnist.subset(torch.arange(300))), _Pairs(mnist.subset(torch.arange(300, 377)))
    cfg = _config(tmp_path, epochs=3, batch_size=32, lr=0.05)
    cfg.data.num_workers = 0
    result = scaletrain.fit(_linear(), train, val, cfg)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["val_samples"] == 77 and summary["world_size"] == 1
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"]
    assert result.best_val_accuracy > 0.6
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert rows[0] == "epoch,train_loss,val_loss,val_accuracy,lr,epoch_seconds,images_per_second"
    assert len(rows) == 4
    # The saved weights are the model's: evaluating them again gives the last epoch's accuracy.
    model = _linear()
    model.load_state_dict(load_file(tmp_path / "last.safetensors"))
    with torch.no_grad():
        acc = (model(val.x).argmax(1) == val.y).float().mean().item()
    assert acc == pytest.approx(result.history[-1]["val_accuracy"])


def test_gradient_accumulation_equals_one_large_batch(tmp_path, mnist):
    train, val = mnist.subset(torch.arange(100)), mnist.subset(torch.arange(100, 150))
    big = scaletrain.fit(_linear(), train, val, _config(tmp_path / "big", epochs=2, batch_size=32),
                         model_name="linear")
    acc = scaletrain.fit(_linear(), train, val, _config(tmp_path / "acc", epochs=2, batch_size=16, grad_accum=2),
                         model_name="linear")
    w_big, w_acc = load_file(tmp_path / "big/last.safetensors"), load_file(tmp_path / "acc/last.safetensors")
    for k in w_big:
        torch.testing.assert_close(w_acc[k], w_big[k], rtol=1e-5, atol=1e-6)
    assert acc.history[-1]["train_loss"] == pytest.approx(big.history[-1]["train_loss"], rel=1e-5)


def test_a_diverging_run_stops_with_a_clear_error(tmp_path, mnist):
    train, val = mnist.subset(torch.arange(256)), mnist.subset(torch.arange(256, 300))
    with pytest.raises(TrainingDiverged, match="training loss became (nan|inf)"):
        scaletrain.fit(_linear(), train, val, _config(tmp_path, epochs=3, batch_size=32, lr=1e12, momentum=0.0))
    assert not (tmp_path / "summary.json").exists()


def test_bf16_autocast_trains_on_cpu(tmp_path, mnist):
    train, val = mnist.subset(torch.arange(256)), mnist.subset(torch.arange(256, 300))
    cfg = _config(tmp_path, epochs=2, batch_size=64)
    cfg.run.mixed_precision = "bf16"
    model = scaletrain.build_model("tinycnn", 1, 10)
    result = scaletrain.fit(model, train, val, cfg, model_name="tinycnn")
    assert result.summary["mixed_precision"] == "bf16"
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"]


def test_compiled_training_matches_eager(tmp_path, mnist):
    train, val = mnist.subset(torch.arange(128)), mnist.subset(torch.arange(128, 160))
    results = {}
    for name in ("eager", "compiled"):
        cfg = _config(tmp_path / name, epochs=1, batch_size=32)
        cfg.model.compile = name == "compiled"
        torch.manual_seed(0)
        scaletrain.fit(scaletrain.build_model("tinycnn", 1, 10), train, val, cfg, model_name="tinycnn")
        results[name] = load_file(tmp_path / name / "last.safetensors")
    for k in results["eager"]:
        # Compiled kernels sum in another order: equal up to rounding, amplified by 4 steps at lr 0.05.
        torch.testing.assert_close(results["compiled"][k], results["eager"][k], rtol=1e-2, atol=2e-4)


def test_deterministic_kernels_are_on_while_training_and_off_after(tmp_path, mnist):
    train, val = mnist.subset(torch.arange(64)), mnist.subset(torch.arange(64, 80))
    cfg = _config(tmp_path, epochs=1, batch_size=32)
    cfg.run.deterministic = True
    model = scaletrain.build_model("tinycnn", 1, 10)
    seen = []
    model.register_forward_hook(lambda *_: seen.append(torch.are_deterministic_algorithms_enabled()))
    scaletrain.fit(model, train, val, cfg, model_name="tinycnn")
    assert seen and all(seen)
    assert torch.are_deterministic_algorithms_enabled() is False  # a notebook's next run is left as it was
    assert "deterministic: true" in (tmp_path / "config.yaml").read_text()
