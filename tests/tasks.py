"""Three scripts of the kinds users bring that are not single-label classification, cut from the embedded digits:
regression (the digit's value as a float, MSE), multi-label (two digits side by side, a multi-hot target, BCE) and
segmentation (each pixel the digit's class + 1 or background, N x 11 x 28 x 28 logits, cross-entropy), each with its
torchmetrics metrics. Imported by the tests, and run as a script on one or two processes:

    python tests/tasks.py TASKS OUT           torchrun --nproc-per-node 2 tests/tasks.py TASKS OUT [WEIGHTS]

which trains each of TASKS (comma-separated), one after another in the same processes, through scaletrain.fit and
writes into OUT/TASK: result.json (the history, the metrics over the whole validation set computed in one process
from predict's outputs of the trained model, and evaluate's values), outputs.pt (predict's outputs) and model.pt
(the weights predict and evaluate used: WEIGHTS/TASK/model.pt, another run's, if given).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset
from torchmetrics import MeanAbsoluteError, MeanSquaredError
from torchmetrics.classification import MulticlassJaccardIndex, MultilabelF1Score, MultilabelHammingDistance

import scaletrain

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from segment_digits import DigitMasks, make_net  # noqa: E402  the example's masks: (image, 28 x 28 int64 mask)

TRAIN, VAL = (0, 256), (256, 357)  # 101 validation items: shards of 51 and 50 on two processes


class Values(Dataset):
    """(1 x 28 x 28 image, the digit's value as a float 1-vector)."""

    def __init__(self, start: int, stop: int):
        digits = scaletrain.data.embedded_mnist()
        self.x, self.y = digits.images[start:stop].float() / 255, digits.labels[start:stop].float()[:, None]

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Pairs(Dataset):
    """(1 x 28 x 56 image of two digits side by side, multi-hot float target of 10)."""

    def __init__(self, start: int, stop: int):
        digits = scaletrain.data.embedded_mnist()
        images, labels = digits.images[start:stop].float() / 255, digits.labels[start:stop]
        other = torch.roll(torch.arange(len(labels)), 1)
        self.x = torch.cat([images, images[other]], dim=3)
        self.y = torch.zeros(len(labels), 10)
        self.y[torch.arange(len(labels)), labels] = 1
        self.y[torch.arange(len(labels)), labels[other]] = 1

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"image": self.x[i], "target": self.y[i]}


def regression_model():
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 1))


def multilabel_model():
    return nn.Sequential(nn.Flatten(), nn.Linear(1568, 64), nn.ReLU(), nn.Linear(64, 10))


def segmentation_model():
    return make_net(8)  # examples/segment_digits.py's dilated net, 8 channels


def absolute_error(outputs, targets):
    """A metric of the user's as a plain function: one value per sample."""
    return (outputs - targets).abs()


TASKS = {  # name: (dataset, model, loss, metrics)
    "regression": (Values, regression_model, nn.MSELoss,
                   lambda: {"mae": MeanAbsoluteError(), "mse": MeanSquaredError(), "abs_error": absolute_error}),
    "multilabel": (Pairs, multilabel_model, nn.BCEWithLogitsLoss,
                   lambda: {"f1": MultilabelF1Score(10), "hamming": MultilabelHammingDistance(10)}),
    "segmentation": (DigitMasks, segmentation_model, nn.CrossEntropyLoss, lambda: {"iou": MulticlassJaccardIndex(11)}),
}


def config(out: str = "", epochs: int = 2) -> scaletrain.TrainConfig:
    cfg = scaletrain.TrainConfig()
    cfg.optim.epochs, cfg.optim.batch_size, cfg.optim.optimizer, cfg.optim.lr = epochs, 32, "adamw", 3e-3
    cfg.data.num_workers, cfg.run.output_dir = 0, out
    return cfg


def whole_set(metrics: dict, outputs: torch.Tensor, dataset: Dataset) -> dict[str, float]:
    """Each metric over every item at once, in this process: what the distributed values must equal."""
    targets = torch.stack([dataset[i]["target"] if isinstance(dataset[i], dict) else dataset[i][1]
                           for i in range(len(dataset))])
    values = {}
    for name, metric in metrics.items():
        if isinstance(metric, nn.Module):
            values[name] = metric(outputs, targets).item()
        else:
            values[name] = metric(outputs, targets).reshape(len(outputs), -1).mean(1).double().mean().item()
    return values


def main(names: str, root: str, weights: str | None = None) -> None:
    """Each of NAMES (comma-separated) in turn, into ROOT/NAME (see `run`); WEIGHTS: another such ROOT."""
    for task in names.split(","):
        out = Path(root) / task
        out.mkdir(parents=True, exist_ok=True)
        run(task, str(out), str(Path(weights) / task / "model.pt") if weights else None)


def run(task: str, out: str, weights: str | None = None) -> None:
    """Train TASK, check its last validation against the whole set in one process, then predict and evaluate with
    the trained weights, or with WEIGHTS (another run's model.pt) when given."""
    data, make_model, make_loss, make_metrics = TASKS[task]
    torch.manual_seed(0)
    model, val = make_model(), data(*VAL)
    result = scaletrain.fit(model, data(*TRAIN), val, config(out), loss_fn=make_loss(), metrics=make_metrics())
    trained = scaletrain.predict(model, val, config())
    if weights:
        model.load_state_dict(torch.load(weights))
    outputs = scaletrain.predict(model, val, config())
    evaluated = scaletrain.evaluate(model, val, config(), make_loss(), metrics=make_metrics())
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(model.state_dict(), Path(out) / "model.pt")
        torch.save(outputs, Path(out) / "outputs.pt")
        (Path(out) / "result.json").write_text(json.dumps({
            "history": result.history, "best": result.best, "whole_set": whole_set(make_metrics(), trained, val),
            "evaluate": evaluated}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
