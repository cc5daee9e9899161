"""torchmetrics' MetricCollection and wrappers (ClasswiseWrapper, MinMaxMetric, MeanAveragePrecision's dict) as
`metrics=`: each value a column of its own (val_<name>_<key>), and on 2 processes holding 12 and 11 of 23 items
exactly the values torchmetrics gives in one process over the whole set.

The items are the logits themselves (the model passes them through), so the values compared are torchmetrics' own
over the same numbers, whatever the batches. Run as a script under torchrun, this file is the 2-process job."""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset
from torchmetrics import MetricCollection
from torchmetrics.classification import (MulticlassAccuracy, MulticlassAUROC, MulticlassF1Score,
                                         MulticlassPrecision)
from torchmetrics.detection import MeanAveragePrecision
from torchmetrics.wrappers import ClasswiseWrapper, MinMaxMetric

import scaletrain
from scaletrain.errors import UserError
from scaletrain.metrics import merge_states

sys.path.insert(0, str(Path(__file__).parent))
from helpers import run_cli  # noqa: E402

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
ITEMS, CLASSES = 23, 3  # 23 over 2 processes: 12 and 11


class PassThrough(nn.Module):
    """Gives its input as the logits; its one parameter (for the optimizer) changes nothing."""

    def __init__(self):
        super().__init__()
        self.unused = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return x + 0 * self.unused


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(ITEMS, CLASSES, generator=g), torch.randint(0, CLASSES, (ITEMS,), generator=g))


def config(out: str = "") -> scaletrain.TrainConfig:
    cfg = scaletrain.TrainConfig()
    cfg.optim.epochs, cfg.optim.batch_size, cfg.data.num_workers, cfg.run.output_dir = 1, 4, 0, out
    return cfg


def metrics() -> dict:
    """A collection whose F1 and precision share one compute group, beside an AUROC of list states kept on the CPU;
    a per-class wrapper; a wrapper of a wrapped metric."""
    return {"scores": MetricCollection({"f1": MulticlassF1Score(CLASSES), "precision": MulticlassPrecision(CLASSES),
                                        "auroc": MulticlassAUROC(CLASSES, compute_on_cpu=True)}),
            "per_class": ClasswiseWrapper(MulticlassF1Score(CLASSES, average=None), labels=["cat", "dog", "owl"],
                                          prefix="f1_"),
            "acc": MinMaxMetric(MulticlassAccuracy(CLASSES))}


COLUMNS = ["scores_auroc", "scores_f1", "scores_precision", "per_class_f1_cat", "per_class_f1_dog",
           "per_class_f1_owl", "acc_raw", "acc_max", "acc_min"]


def whole_set() -> dict[str, float]:
    """torchmetrics' values over all 23 items at once, in this process, under the names scaletrain gives them."""
    x, y = data().tensors
    values = {}
    for name, metric in metrics().items():
        metric.update(x, y)
        values.update({f"{name}_{k}": v.item() for k, v in metric.compute().items()})
    return values


def boxes(i: int) -> tuple[dict, dict]:
    """Image i's detections and ground truth: a different number of boxes per image."""
    g = torch.Generator().manual_seed(i)
    n, m = 1 + i % 4, 1 + i % 3
    corner = torch.rand(n + m, 2, generator=g) * 50
    box = torch.cat([corner, corner + 5 + torch.rand(n + m, 2, generator=g) * 30], 1)
    labels = torch.randint(0, 3, (n + m,), generator=g)
    jitter = torch.rand(n, 4, generator=g) * 4
    return ({"boxes": box[:n] + jitter, "scores": torch.rand(n, generator=g), "labels": labels[:n]},
            {"boxes": box[n - min(n, m):n - min(n, m) + m], "labels": labels[n - min(n, m):n - min(n, m) + m]})


def map_over(images, gather=None) -> dict[str, float]:
    """MeanAveragePrecision over `images` (4 a batch), its states merged over the processes by `gather`."""
    metric = MeanAveragePrecision()
    for start in range(0, len(images), 4):
        preds, targets = zip(*[boxes(i) for i in images[start:start + 4]])
        metric.update(list(preds), list(targets))
    if gather is not None:
        merge_states(metric, gather)
    return {k: v.item() for k, v in metric.compute().items() if v.numel() == 1}


def test_a_collection_and_wrappers_on_one_process_log_each_value_as_a_column(tmp_path):
    result = scaletrain.fit(PassThrough(), data(), data(), config(str(tmp_path)), metrics=metrics())
    header = (tmp_path / "metrics.csv").read_text().splitlines()[0].split(",")
    assert header[header.index("val_accuracy") + 1:header.index("lr")] == [f"val_{c}" for c in COLUMNS]
    expected = whole_set()
    assert {c: result.history[-1][f"val_{c}"] for c in COLUMNS} == expected
    evaluated = scaletrain.evaluate(PassThrough(), data(), config(), metrics=metrics())
    assert {c: evaluated[c] for c in COLUMNS} == expected


def test_a_bare_collection_names_the_columns_by_its_keys_and_a_key_can_be_monitored(tmp_path):
    collection = MetricCollection([MulticlassF1Score(CLASSES), MulticlassAccuracy(CLASSES)], prefix="macro_")
    cfg = config(str(tmp_path))
    cfg.optim.epochs, cfg.optim.monitor = 2, "val_macro_MulticlassF1Score"
    result = scaletrain.fit(PassThrough(), data(), data(), cfg, metrics=collection)
    row = result.history[-1]
    assert [k for k in row if k.startswith("val_macro")] == ["val_macro_MulticlassF1Score",
                                                            "val_macro_MulticlassAccuracy"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["monitor"] == "val_macro_MulticlassF1Score" and summary["best_epoch"] == 1  # equal: the first


def test_a_metric_giving_a_dict_picked_as_the_monitor_watches_its_first_value(tmp_path):
    """A Step whose eval_step gives no loss, scored by a collection: the monitor scaletrain picks is the first
    metric, a collection: it watches its first member's value (it was refused, naming a column the user had never
    asked for); any other metric that turns out to give a dict, its first value."""
    class Scored(scaletrain.Step):
        def train_step(self, model, batch):
            x, y = batch
            return torch.nn.functional.cross_entropy(model(x), y)

        def eval_step(self, model, batch):
            x, y = batch
            return model(x), y

    cfg = config(str(tmp_path))
    scaletrain.fit(PassThrough(), data(), data(), cfg, step=Scored(), metrics={"scores": metrics()["scores"]})
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["monitor"] in [f"val_{c}" for c in COLUMNS if c.startswith("scores_")]
    assert summary["best_" + summary["monitor"]] == pytest.approx(whole_set()[summary["monitor"][len("val_"):]])


def test_a_dict_value_can_be_monitored_and_one_it_lacks_is_refused_at_the_first_validation(tmp_path):
    cfg = config(str(tmp_path))
    cfg.optim.monitor = "val_per_class_f1_dog"
    result = scaletrain.fit(PassThrough(), data(), data(), cfg, metrics=metrics())
    assert result.best["val_per_class_f1_dog"] == pytest.approx(whole_set()["per_class_f1_dog"])
    cfg.optim.monitor, cfg.run.output_dir = "val_per_class_f1_emu", str(tmp_path / "emu")
    with pytest.raises(UserError, match=r"--monitor val_per_class_f1_emu: this run's validation measured val_loss, "
                                        r"val_accuracy, val_scores_auroc, .*val_per_class_f1_cat"):
        scaletrain.fit(PassThrough(), data(), data(), cfg, metrics=metrics())


@pytest.mark.parametrize("given, message", [
    ({"f1": MulticlassF1Score(CLASSES, average=None)},
     r"metrics\['f1'\].compute\(\) gave a float32 tensor 3; .*or a dict of them \(a MetricCollection, "
     r"ClasswiseWrapper for one value per class\)"),
    ({"f1": MulticlassF1Score(CLASSES), "m": MetricCollection({"f1": MulticlassAccuracy(CLASSES)}, prefix="x"),
      "m_xf1": MulticlassPrecision(CLASSES)}, r"metrics: the value 'm_xf1' is given twice"),
    ([MulticlassF1Score(CLASSES)], r"metrics= is a list.*; expected a dict \{name: metric\} .* or a torchmetrics "
                                   r"MetricCollection"),
])
def test_what_cannot_become_columns_is_refused_on_one_line(given, message):
    with pytest.raises(UserError, match=message):
        scaletrain.evaluate(PassThrough(), data(), config(), metrics=given)


def test_mean_average_precision_gives_its_dict_as_columns_leaving_out_its_list_of_classes():
    values = map_over(range(ITEMS))
    assert {"map", "map_50", "mar_100"} <= set(values) and "classes" not in values
    assert 0 < values["map"] < 1


@pytest.mark.slow
def test_collections_and_wrappers_on_two_processes_with_uneven_shards_give_the_values_of_one(tmp_path):
    proc = run_cli(str(tmp_path), module=__file__, launcher=TORCHRUN, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    job = json.loads((tmp_path / "job.json").read_text())
    expected = whole_set()
    assert job["evaluated"] == {**expected, "samples": ITEMS}
    assert job["validated"] == expected
    with (tmp_path / "run" / "metrics.csv").open() as f:
        header = next(csv.reader(f))
    assert [c for c in header if c.startswith("val_") and c not in ("val_loss", "val_accuracy")] == \
        [f"val_{c}" for c in COLUMNS]
    assert job["map"] == map_over(range(ITEMS))
    assert job["map_states"] == {"shards": [12, 11], "merged": ITEMS}


def job(out: Path) -> None:
    """Each of 2 processes: evaluate and fit with the metrics above, then a detector's mAP merged from the strided
    shards (images r, r + 2, ...); the main process writes what they measured to OUT/job.json."""
    evaluated = scaletrain.evaluate(PassThrough(), data(), config(), metrics=metrics())
    result = scaletrain.fit(PassThrough(), data(), data(), config(str(out / "run")), metrics=metrics())
    import torch.distributed as dist

    if not dist.is_initialized():  # scaletrain may have closed its process group with the run
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def gather(value):
        gathered = [None] * world
        dist.all_gather_object(gathered, value)
        return gathered

    mine = list(range(rank, ITEMS, world))
    shards = gather(len(mine))
    metric = MeanAveragePrecision()
    for start in range(0, len(mine), 4):
        preds, targets = zip(*[boxes(i) for i in mine[start:start + 4]])
        metric.update(list(preds), list(targets))
    merge_states(metric, gather)
    merged = len(metric.detection_box)
    mean_ap = {k: v.item() for k, v in metric.compute().items() if v.numel() == 1}
    if rank == 0:
        (out / "job.json").write_text(json.dumps({
            "evaluated": {k: evaluated[k] for k in [*COLUMNS, "samples"]},
            "validated": {c: result.history[-1][f"val_{c}"] for c in COLUMNS},
            "map": mean_ap, "map_states": {"shards": shards, "merged": merged}}))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    job(Path(sys.argv[1]))
