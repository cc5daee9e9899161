"""Tasks other than single-label classification through `fit`, `predict` and `evaluate` (regression, multi-label,
segmentation; tests/tasks.py): their own metrics exact over the whole validation set on one and two processes, no
accuracy that was not measured, outputs of any shape in dataset order, the monitored value, and what is refused."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torchmetrics import MeanAbsoluteError
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

import scaletrain
from scaletrain.errors import UserError

sys.path.insert(0, str(Path(__file__).parent))
import tasks  # noqa: E402

from helpers import run_cli  # noqa: E402

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _train(task: str, out: Path | str = "", **kwargs):
    data, make_model, make_loss, make_metrics = tasks.TASKS[task]
    torch.manual_seed(0)
    model, val = make_model(), data(*tasks.VAL)
    kwargs = {"loss_fn": make_loss(), "metrics": make_metrics(), **kwargs}
    config = kwargs.pop("config", None) or tasks.config(str(out))
    return model, val, scaletrain.fit(model, data(*tasks.TRAIN), val, config, **kwargs)


@pytest.mark.parametrize("task", sorted(tasks.TASKS))
def test_each_task_is_validated_by_its_own_metrics_over_the_whole_set_and_reports_no_accuracy(task, tmp_path,
                                                                                               capsys):
    model, val, result = _train(task, tmp_path)
    names = list(tasks.TASKS[task][3]())
    last = result.history[-1]
    expected = tasks.whole_set(tasks.TASKS[task][3](), scaletrain.predict(model, val, tasks.config()), val)
    for name in names:
        assert last[f"val_{name}"] == pytest.approx(expected[name], rel=1e-5, abs=1e-6), name
    header = (tmp_path / "metrics.csv").read_text().splitlines()[0].split(",")
    assert header[:3] == ["epoch", "train_loss", "val_loss"] and header[3:3 + len(names)] == [f"val_{n}" for n in names]
    summary = json.loads((tmp_path / "summary.json").read_text())
    shown = capsys.readouterr().out
    assert not [k for k in [*header, *summary, *last] if "accuracy" in k] and "accuracy" not in shown
    assert result.best_val_accuracy is None and summary["monitor"] == "val_loss"
    losses = [r["val_loss"] for r in result.history]
    assert summary["best_epoch"] == 1 + losses.index(min(losses)) and result.best["val_loss"] == min(losses)
    evaluated = scaletrain.evaluate(model, val, tasks.config(), tasks.TASKS[task][2](), metrics=tasks.TASKS[task][3]())
    assert "accuracy" not in evaluated and evaluated["samples"] == len(val)
    for name in ["loss", *names]:
        assert evaluated[name] == pytest.approx(last[f"val_{name}"], rel=1e-5, abs=1e-6), name


def test_the_validation_loss_per_sample_is_a_loss_modules_mean_over_the_other_dimensions():
    """BCEWithLogitsLoss over N x 10 and cross-entropy over N x 28 x 28 pixels: summed per sample (each sample's mean
    over its elements), the exact validation loss equals the loss module's own mean over the whole set."""
    for task in ("multilabel", "segmentation"):
        data, _, make_loss, _ = tasks.TASKS[task]
        model, val, result = _train(task)
        outputs = scaletrain.predict(model, val, tasks.config())
        targets = torch.stack([v["target"] if isinstance(v, dict) else v[1] for v in val])
        assert result.history[-1]["val_loss"] == pytest.approx(make_loss()(outputs, targets).item(), rel=1e-5)


def test_predict_gives_each_tasks_outputs_item_by_item_in_dataset_order():
    for task, shape in (("regression", (101, 1)), ("multilabel", (101, 10)), ("segmentation", (101, 11, 28, 28))):
        data, make_model, _, _ = tasks.TASKS[task]
        torch.manual_seed(0)
        model, val = make_model().eval(), data(*tasks.VAL)
        outputs = scaletrain.predict(model, val, tasks.config())
        inputs = torch.stack([v["image"] if isinstance(v, dict) else v[0] for v in val])
        with torch.no_grad():
            assert outputs.shape == shape and torch.allclose(outputs, model(inputs), atol=1e-5), task


def test_predict_streams_the_outputs_into_a_npy_file_whole_or_not_at_all(tmp_path):
    model, val = tasks.segmentation_model(), tasks.DigitMasks(*tasks.VAL)
    target = tmp_path / "preds.npy"
    returned = scaletrain.predict(model, val, tasks.config(), output=target)
    assert returned == target and np.array_equal(np.load(target), scaletrain.predict(model, val, tasks.config()))

    class FailsOnTheThirdBatch(nn.Module):
        def __init__(self):
            super().__init__()
            self.net, self.calls = model, 0

        def forward(self, x):
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("a corrupt record")
            return self.net(x)

    before = target.read_bytes()
    with pytest.raises(RuntimeError, match="a corrupt record"):
        scaletrain.predict(FailsOnTheThirdBatch(), val, tasks.config(), output=target)
    assert target.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["preds.npy"]
    for bad, message in ((tmp_path / "preds.csv", "expected a .npy file name"),
                         (tmp_path / "no" / "preds.npy", "does not exist")):
        with pytest.raises(UserError, match=message):
            scaletrain.predict(model, val, tasks.config(), output=bad)


def test_a_models_dict_output_is_scored_by_output_key_and_dict_targets_reach_the_loss():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = tasks.multilabel_model()

        def forward(self, x):
            logits = self.body(x)
            return {"features": logits.detach() * 0, "labels": logits}

    def loss(outputs, targets):
        return nn.functional.binary_cross_entropy_with_logits(outputs, targets["multi_hot"])

    class DictTargets(tasks.Pairs):
        def __getitem__(self, i):
            return self.x[i], {"multi_hot": self.y[i]}

    torch.manual_seed(0)
    result = scaletrain.fit(TwoHeads(), DictTargets(*tasks.TRAIN), DictTargets(*tasks.VAL), tasks.config(epochs=4),
                            loss_fn=loss, output_key="labels")
    assert result.history[-1]["val_loss"] < result.history[0]["val_loss"] and "val_accuracy" not in result.history[0]
    outputs = scaletrain.predict(TwoHeads(), DictTargets(*tasks.VAL), tasks.config(), output_key="labels")
    assert outputs.shape == (101, 10)
    with pytest.raises(UserError, match=r"output_key='logits': the model returned a dict \{'features': .*, with no tensor at 'logits'"):
        scaletrain.predict(TwoHeads(), DictTargets(*tasks.VAL), tasks.config(), output_key="logits")


def test_a_classifier_keeps_its_accuracy_and_adds_the_users_metrics(tmp_path):
    digits = tasks.Values(*tasks.VAL)
    classes = [(x, int(y.item())) for x, y in zip(digits.x, digits.y)]
    train = [(x, int(y.item())) for x, y in zip(tasks.Values(*tasks.TRAIN).x, tasks.Values(*tasks.TRAIN).y)]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
    result = scaletrain.fit(net, train, classes, tasks.config(str(tmp_path / "c")),
                            metrics={"f1": MulticlassF1Score(10), "wrong": lambda o, t: (o.argmax(1) != t).float()})
    last = result.history[-1]
    assert list(k for k in last if k.startswith("val_")) == ["val_loss", "val_accuracy", "val_f1", "val_wrong",
                                                              "val_samples"]
    assert last["val_wrong"] == pytest.approx(1 - last["val_accuracy"], abs=1e-12)
    assert json.loads((tmp_path / "c" / "summary.json").read_text())["monitor"] == "val_accuracy"
    evaluated = scaletrain.evaluate(net, classes, tasks.config(), metrics={"f1": MulticlassF1Score(10)})
    assert evaluated["accuracy"] == last["val_accuracy"] and evaluated["f1"] == pytest.approx(last["val_f1"])
    assert sum(v or 0 for v in evaluated["per_class_accuracy"].values()) > 0


def test_the_monitored_value_picks_the_best_epoch_and_early_stopping(tmp_path):
    config = tasks.config(str(tmp_path), epochs=6)
    config.optim.monitor, config.optim.early_stopping = "val_mae", 2
    _, _, result = _train("regression", config=config)
    maes = [r["val_mae"] for r in result.history]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["monitor"] == "val_mae" and summary["best_val_mae"] == min(maes)  # MeanAbsoluteError: lower
    assert summary["best_epoch"] == 1 + maes.index(min(maes))
    config = tasks.config(epochs=2)
    config.optim.monitor, config.optim.monitor_mode = "val_abs_error", "min"
    assert _train("regression", config=config)[2].summary["monitor"] == "val_abs_error"


@pytest.mark.parametrize("change, kwargs, message", [
    ({"monitor": "val_accuracy"}, {}, r"--monitor val_accuracy: this run's validation measures val_loss, val_mae, "
                                      r"val_mse, val_abs_error \(accuracy only for single-label classification"),
    ({"monitor": "val_abs_error"}, {}, r"say whether higher is better with --monitor-mode max or min "
                                       r"\(metrics\['abs_error'\] is a function"),
    ({"monitor": "mae"}, {}, r"--monitor must be auto or a validation column"),
    ({}, {"metrics": {"loss": MeanAbsoluteError()}}, r"metrics: 'loss' cannot name a metric"),
    ({}, {"metrics": {"mae": 3}}, r"metrics\['mae'\] is an int; expected a torchmetrics Metric or a function"),
    ({}, {"metrics": {"mean": lambda o, t: (o - t).abs().mean()}},
     r"metrics\[.mean.\] returned a float32 tensor of one value \(no dimensions\) for a batch of 32; expected values with the batch first"),
    ({}, {"loss_fn": lambda o, t: (o - t).abs().sum(0)},
     r"loss_fn returned a float32 tensor 1 for a batch of 32; expected a scalar or values with the batch first"),
])
def test_what_cannot_be_measured_is_refused_on_one_line_before_or_at_the_first_validation(change, kwargs, message,
                                                                                          tmp_path):
    config = tasks.config(str(tmp_path / "run"))
    for key, value in change.items():
        setattr(config.optim, key, value)
    with pytest.raises(UserError, match=message) as e:
        _train("regression", config=config, **kwargs)
    assert "\n" not in str(e.value) and not (tmp_path / "run" / "state").exists()


def test_an_output_without_a_batch_dimension_is_refused_before_the_first_step():
    class Total(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(784, 1)

        def forward(self, x):
            return self.lin(x.flatten(1)).sum()

    with pytest.raises(UserError, match=r"the model returned a float32 tensor of one value \(no dimensions\) for one item of train_data; "
                                        r"expected outputs with the batch first"):
        scaletrain.fit(Total(), tasks.Values(*tasks.TRAIN), None, tasks.config(), loss_fn=nn.MSELoss())


def test_masks_with_a_class_beyond_the_models_are_refused_before_the_first_step():
    class TooFew(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 5, 1)

        def forward(self, x):
            return self.conv(x)

    with pytest.raises(UserError, match=r"train_data: item 0 has label 8, but the model gives 5 classes"):
        scaletrain.fit(TooFew(), tasks.DigitMasks(*tasks.TRAIN), None, tasks.config())


@pytest.fixture(scope="module")
def on_one_and_two(tmp_path_factory):
    """Every task trained in one process, then on 2 (one torchrun job running the tasks in turn), predicting and
    evaluating with the 1-process run's weights."""
    one, two = tmp_path_factory.mktemp("tasks-one"), tmp_path_factory.mktemp("tasks-two")
    names = ",".join(sorted(tasks.TASKS))
    proc = run_cli(names, str(one), module=str(Path(tasks.__file__)), launcher=[sys.executable])
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli(names, str(two), str(one), module=str(Path(tasks.__file__)), launcher=TORCHRUN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return one, two


@pytest.mark.slow
@pytest.mark.parametrize("task", sorted(tasks.TASKS))
def test_each_task_on_two_processes_measures_what_one_process_does(task, on_one_and_two):
    """Trained on 2 processes, the last validation equals the metrics over the whole set in one process; the 1-process
    run's weights give the same evaluate values and the same predictions on 2 processes as on 1."""
    one, two = (root / task for root in on_one_and_two)
    results = {n: json.loads((out / "result.json").read_text()) for n, out in (("one", one), ("two", two))}
    for result in results.values():
        last = result["history"][-1]
        assert last["val_samples"] == 101 and "val_accuracy" not in last
        for name, value in result["whole_set"].items():
            assert last[f"val_{name}"] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    for name, value in results["one"]["evaluate"].items():
        assert results["two"]["evaluate"][name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    assert torch.equal(torch.load(one / "outputs.pt"), torch.load(two / "outputs.pt"))
    with (two / "metrics.csv").open() as f:
        assert "val_accuracy" not in next(csv.reader(f))
    assert json.loads((two / "summary.json").read_text())["world_size"] == 2


class _Embeddings(scaletrain.Step):
    """A step whose evaluation gives embeddings and labels, no loss: a metric function scores them."""

    def train_step(self, model, batch):
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    def eval_step(self, model, batch):
        x, y = batch
        return model(x), y


def test_the_automatic_monitor_keeps_to_values_whose_sense_it_knows(tmp_path, capsys):
    """With a metric function alone measured (no loss, no accuracy from a Step's evaluation) and nothing set, the
    run once refused to start, asking the direction of a value the user never named; now best.safetensors is the
    last epoch's, said so at the start; a torchmetrics Metric, which says its sense, is picked."""
    from torch.utils.data import TensorDataset

    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
    top1 = {"top1": lambda z, y: (z.argmax(1) == y).float()}
    config = tasks.config(str(tmp_path / "fn"), epochs=2)
    result = scaletrain.fit(nn.Linear(8, 3), data, data, config, step=_Embeddings(), metrics=top1)
    out = capsys.readouterr().out
    assert "best.safetensors: the last epoch's, since no validation value says whether higher is better (val_top1)" \
        in out
    assert result.summary["final_val_top1"] == result.history[-1]["val_top1"] and "monitor" not in result.summary
    config.optim.early_stopping = 1  # early stopping has nothing to watch: refused
    with pytest.raises(UserError, match="--early-stopping watches a validation value whose sense is known"):
        scaletrain.fit(nn.Linear(8, 3), data, data, config, step=_Embeddings(), metrics=top1)
    config = tasks.config(str(tmp_path / "metric"), epochs=2)
    result = scaletrain.fit(nn.Linear(8, 3), data, data, config, step=_Embeddings(),
                            metrics={**top1, "acc": MulticlassAccuracy(3)})
    assert result.summary["monitor"] == "val_acc"
    assert "best.safetensors by val_acc, higher is better (picked by --monitor auto)" in capsys.readouterr().out
