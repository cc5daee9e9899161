"""A user's own Dataset, model, loss, optimizer and scheduler through `fit`, `predict` and `evaluate`, in one
process: what their items and outputs may look like, what is refused and how, and what each hook keeps."""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import Dataset

import scaletrain
from scaletrain.errors import UserError

from helpers import run_python


class DictDigits(Dataset):
    """Items as many users write them: {"image": float32 1 x 28 x 28, "label": int} (no label: a test set)."""

    def __init__(self, mnist, start, stop, labelled=True, keys=("image", "label")):
        self.x = mnist.images[start:stop].float() / 255
        self.y = mnist.labels[start:stop]
        self.labelled, self.keys = labelled, keys

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        item = {self.keys[0]: self.x[i], "id": f"row-{i}"}
        if self.labelled:
            item[self.keys[1]] = int(self.y[i])
        return item


class HwcArrays(Dataset):
    """(uint8 H x W x 1 NumPy image, NumPy label), as cv2 or PIL give them."""

    def __init__(self, mnist, start, stop):
        self.x = mnist.images[start:stop, 0, :, :, None].numpy()
        self.y = mnist.labels[start:stop].numpy()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Net(nn.Module):
    """A small CNN whose output is wrapped as `kind` says: logits, a tuple, a dict, or an object with .logits."""

    def __init__(self, kind="logits"):
        super().__init__()
        self.kind = kind
        self.body = nn.Sequential(nn.Conv2d(1, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                                  nn.Linear(32, 10))

    def forward(self, image):
        logits = self.body(image)
        if self.kind == "tuple":
            return logits, image.mean()
        if self.kind == "dict":
            return {"logits": logits, "hidden": image}
        if self.kind == "object":
            return SimpleNamespace(logits=logits, loss=None)
        return logits


def _config(out="", epochs=1, batch_size=32):
    cfg = scaletrain.TrainConfig()
    cfg.optim.epochs, cfg.optim.batch_size = epochs, batch_size
    cfg.data.num_workers = 0
    cfg.run.output_dir = str(out) if out else ""
    return cfg


def _fit(model, train, val, out="", **kwargs):
    torch.manual_seed(0)
    return scaletrain.fit(model, train, val, _config(out, kwargs.pop("epochs", 1)), **kwargs)


@pytest.mark.parametrize("kind", ["logits", "tuple", "dict", "object"])
def test_dict_items_and_every_kind_of_model_output_train(mnist, kind):
    result = _fit(Net(kind), DictDigits(mnist, 0, 256), DictDigits(mnist, 256, 320))
    assert result.history[0]["val_samples"] == 64 and result.history[0]["train_loss"] > 0


def test_keys_of_ones_own_are_named_with_batch_keys(mnist):
    train, val = DictDigits(mnist, 0, 128, keys=("pixels", "digit")), DictDigits(mnist, 128, 160, keys=("pixels", "digit"))
    result = _fit(Net(), train, val, batch_keys=("pixels", "digit"))
    assert result.history[0]["val_samples"] == 32


def test_uint8_hwc_arrays_become_scaled_chw_inputs_said_once(mnist, capsys):
    seen = []
    model = Net()
    model.register_forward_pre_hook(lambda _, args: seen.append((args[0].dtype, tuple(args[0].shape[1:]),
                                                                  float(args[0].max()))))
    _fit(model, HwcArrays(mnist, 0, 64), HwcArrays(mnist, 64, 96))
    assert {s[:2] for s in seen} == {(torch.float32, (1, 28, 28))} and max(s[2] for s in seen) <= 1.0
    assert capsys.readouterr().out.count("uint8 images become float inputs in [0, 1]") == 1


@pytest.mark.parametrize("item, expected", [
    ({"pixels": torch.zeros(1, 28, 28), "label": 1},
     "train_data: item 0 is a dict {'pixels': a float32 tensor 1 x 28 x 28, 'label': an int}; expected (input, "
     "label, ...) or a dict with an input key (image, img, pixel_values, x)"),
    ({"image": torch.zeros(1, 28, 28)}, "train_data: item 0 is a dict {'image': a float32 tensor 1 x 28 x 28}, with "
                                        "no label key"),
    (torch.zeros(1, 28, 28), "train_data: item 0 is a float32 tensor 1 x 28 x 28; expected (input, label, ...)"),
])
def test_an_item_it_cannot_read_is_refused_on_one_line_naming_what_it_found(item, expected):
    class Odd(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return item

    with pytest.raises(UserError) as e:
        _fit(Net(), Odd(), None)
    assert str(e.value).startswith(expected) and "\n" not in str(e.value)


def test_an_output_it_cannot_read_is_refused_before_the_first_step(mnist, tmp_path):
    class Words(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(1, 1)

        def forward(self, image):
            return "ten"

    with pytest.raises(UserError, match="the model returned a str; expected a tensor with the batch first"):
        _fit(Words(), DictDigits(mnist, 0, 64), None, out=tmp_path / "run")
    assert not (tmp_path / "run" / "state").exists()


def test_a_label_beyond_the_models_classes_is_refused_before_the_first_step(mnist):
    class FiveClasses(Net):
        def __init__(self):
            super().__init__()
            self.body[-1] = nn.Linear(32, 5)

    with pytest.raises(UserError, match=r"train_data: item 0 has label 7, but the model gives 5 classes"):
        _fit(FiveClasses(), DictDigits(mnist, 0, 64), None)


def test_without_a_validation_set_best_is_last_and_no_val_columns(mnist, tmp_path):
    result = _fit(Net(), DictDigits(mnist, 0, 128), None, out=tmp_path, epochs=2)
    assert result.best_val_accuracy is None and "val_accuracy" not in result.history[-1]
    header = (tmp_path / "metrics.csv").read_text().splitlines()[0]
    assert header == "epoch,train_loss,lr,epoch_seconds,images_per_second"
    best, last = load_file(tmp_path / "best.safetensors"), load_file(tmp_path / "last.safetensors")
    assert all(torch.equal(best[k], last[k]) for k in last)
    assert json.loads((tmp_path / "summary.json").read_text())["best_val_accuracy"] is None


def test_a_loss_module_gives_the_exact_validation_loss(mnist):
    """nn.CrossEntropyLoss() is validated per sample, so its validation loss is the default's to the last bit of
    float64 summation; the training runs are the same too."""
    ours = _fit(Net(), DictDigits(mnist, 0, 256), DictDigits(mnist, 256, 333))
    theirs = _fit(Net(), DictDigits(mnist, 0, 256), DictDigits(mnist, 256, 333), loss_fn=nn.CrossEntropyLoss())
    assert theirs.history[0]["val_loss"] == pytest.approx(ours.history[0]["val_loss"], rel=1e-6)
    assert theirs.history[0]["train_loss"] == pytest.approx(ours.history[0]["train_loss"], rel=1e-6)


def test_a_focal_loss_function_trains_and_its_validation_loss_is_the_mean_over_every_sample(mnist):
    def focal(logits, targets, gamma=2.0):
        p = torch.softmax(logits, 1).gather(1, targets[:, None]).squeeze(1)
        return (-(1 - p) ** gamma * torch.log(p.clamp_min(1e-12))).mean()

    model = Net()
    result = _fit(model, DictDigits(mnist, 0, 256), DictDigits(mnist, 256, 333), loss_fn=focal)
    whole = scaletrain.evaluate(model, DictDigits(mnist, 256, 333), _config(), loss_fn=focal)
    assert result.history[0]["val_loss"] == pytest.approx(whole["loss"], rel=1e-5)
    assert result.history[0]["val_accuracy"] == pytest.approx(whole["accuracy"])


def test_adamw_with_onecycle_runs_its_own_schedule(mnist, tmp_path):
    steps = []
    result = _fit(Net(), DictDigits(mnist, 0, 256), DictDigits(mnist, 256, 288), out=tmp_path, epochs=2,
                  optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                  scheduler=lambda opt, total: steps.append(total) or torch.optim.lr_scheduler.OneCycleLR(
                      opt, max_lr=0.025, total_steps=total))
    assert steps == [16]  # 8 steps an epoch, 2 epochs
    reference = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=1e-3)
    schedule = torch.optim.lr_scheduler.OneCycleLR(reference, max_lr=0.025, total_steps=16)
    lrs = []
    for _ in range(16):
        reference.step()
        schedule.step()
        lrs.append(schedule.get_last_lr()[0])
    assert [row["lr"] for row in result.history] == pytest.approx([lrs[7], lrs[15]])
    train = json.loads(sorted((tmp_path / "state").iterdir())[-1].joinpath("train.json").read_text())
    assert train["hooks"] == {"optimizer": "test_adamw_with_onecycle_runs_its_own_schedule.<locals>.<lambda>",
                              "scheduler": "test_adamw_with_onecycle_runs_its_own_schedule.<locals>.<lambda>"}


class _Stop(Exception):
    pass


def _hooks():
    return dict(optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                scheduler=lambda opt, total: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=total))


def test_a_run_with_its_own_optimizer_and_schedule_resumes_bitwise(mnist, tmp_path):
    train, val = DictDigits(mnist, 0, 192), DictDigits(mnist, 192, 224)
    _fit(Net(), train, val, out=tmp_path / "whole", epochs=3, **_hooks())

    def stop_after_first(row, step):
        if row["epoch"] == 1:
            raise _Stop

    with pytest.raises(_Stop):
        _fit(Net(), train, val, out=tmp_path / "cut", epochs=3, on_epoch=stop_after_first, **_hooks())
    _fit(Net(), train, val, out=tmp_path / "cut", epochs=3, **_hooks())
    whole, cut = load_file(tmp_path / "whole/last.safetensors"), load_file(tmp_path / "cut/last.safetensors")
    assert all(torch.equal(whole[k], cut[k]) for k in whole)
    rows = [list(csv.reader((tmp_path / d / "metrics.csv").open()))[1:] for d in ("whole", "cut")]
    assert [r[1] for r in rows[0]] == [r[1] for r in rows[1]]  # the training losses


def test_resuming_with_another_optimizer_is_refused_naming_both(mnist, tmp_path):
    train = DictDigits(mnist, 0, 64)
    _fit(Net(), train, None, out=tmp_path, epochs=1, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    with pytest.raises(UserError, match="saved with optimizer .*<lambda>, resumed with scaletrain's own loss, "
                                        "optimizer and scheduler"):
        _fit(Net(), train, None, out=tmp_path, epochs=2)


def test_an_optimizer_hook_that_returns_no_optimizer_is_refused(mnist):
    with pytest.raises(UserError, match=r"optimizer\(parameters\) returned a list of 2 .*expected a "
                                        r"torch.optim.Optimizer"):
        _fit(Net(), DictDigits(mnist, 0, 64), None, optimizer=lambda p: list(p)[:2])


def test_fit_and_predict_end_their_dataloader_workers_before_they_return(mnist):
    """Workers left to the garbage collector keep a script's process waiting 5 s per worker when it ends."""
    import multiprocessing

    cfg = _config()
    cfg.data.num_workers = 2
    scaletrain.fit(Net(), DictDigits(mnist, 0, 64), DictDigits(mnist, 64, 96), cfg)
    assert multiprocessing.active_children() == []
    scaletrain.predict(Net(), DictDigits(mnist, 0, 32, labelled=False), cfg)
    assert multiprocessing.active_children() == []


def test_predict_returns_every_items_logits_in_order_without_labels(mnist):
    torch.manual_seed(0)
    model = Net("dict").eval()
    unlabelled = DictDigits(mnist, 0, 77, labelled=False)
    logits = scaletrain.predict(model, unlabelled, _config(batch_size=16))
    with torch.no_grad():
        direct = model(unlabelled.x)["logits"]
    assert logits.shape == (77, 10) and logits.dtype == torch.float32 and logits.device.type == "cpu"
    torch.testing.assert_close(logits, direct, rtol=1e-5, atol=1e-6)


def test_evaluate_gives_loss_accuracy_samples_and_per_class_accuracy(mnist):
    torch.manual_seed(0)
    model = Net().eval()
    data = DictDigits(mnist, 0, 100)
    scores = scaletrain.evaluate(model, data, _config(batch_size=16))
    with torch.no_grad():
        logits = model(data.x)
    assert scores["samples"] == 100
    assert scores["accuracy"] == pytest.approx((logits.argmax(1) == data.y).float().mean().item())
    assert scores["loss"] == pytest.approx(nn.functional.cross_entropy(logits, data.y).item(), rel=1e-5)
    assert set(scores["per_class_accuracy"]) == set(range(10))


def test_predict_refuses_scaletrains_own_image_data_pointing_to_the_cli(mnist):
    with pytest.raises(UserError, match="scaletrain predict"):
        scaletrain.predict(Net(), mnist.subset(torch.arange(10)))


def test_seed_fn_is_called_for_every_batch_with_a_seed_of_its_own(mnist):
    seeds = []
    _fit(Net(), DictDigits(mnist, 0, 96), None, seed_fn=lambda dataset, seed: seeds.append(seed))
    assert len(seeds) >= 3 and len(set(seeds)) == len(seeds)


def test_a_datasets_own_random_draws_are_the_same_for_the_same_batch_whatever_came_before(mnist):
    """The global generators are seeded per batch: a Dataset drawing from numpy.random sees the same numbers for
    batch k in any run, so a resumed run draws what the uninterrupted one drew."""
    class Noisy(DictDigits):
        def __getitem__(self, i):
            item = super().__getitem__(i)
            item["image"] = item["image"] + float(np.random.rand())
            return item

    from scaletrain.data.items import SeededBatch, SeededItems

    items = SeededItems(Noisy(mnist, 0, 8))
    first = items.__getitems__(SeededBatch(123, [0, 1]))
    np.random.rand(5)
    again = items.__getitems__(SeededBatch(123, [0, 1]))
    other = items.__getitems__(SeededBatch(124, [0, 1]))
    assert torch.equal(first[0]["image"], again[0]["image"]) and not torch.equal(first[0]["image"], other[0]["image"])


# -- seed 000's own classes, unchanged, on one and two processes ---------------------------------------------------
PEERS = Path(__file__).resolve().parents[2] / "shared" / "peers"
SEED000_JOB = """
import os, sys
sys.path.insert(0, sys.argv[1])
import torch
from safetensors.torch import load_file, save_file
import scaletrain
from seed000_accelerate import MiniDataSet, TimmModel, get_transform

out, weights = sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None
digits = scaletrain.data.embedded_mnist()
x, y = digits.images[:, 0].numpy(), digits.labels.numpy()
config = scaletrain.TrainConfig()
config.optim.epochs, config.optim.batch_size = 2, 32
config.data.num_workers, config.run.checkpoint_every, config.run.output_dir = 2, 4, out
torch.manual_seed(0)
model = TimmModel("resnet10t", 10)
scaletrain.fit(model, MiniDataSet(x[:320], y[:320], get_transform(28, True)),
               MiniDataSet(x[320:390], y[320:390], get_transform(28, False)), config,
               optimizer=lambda params: torch.optim.Adam(params, lr=1e-3))
if weights:  # then seed 000's unlabelled test rows, predicted with the weights given
    model.load_state_dict(load_file(weights))
    logits = scaletrain.predict(model, MiniDataSet(x[9000:9051], transform=get_transform(28, False)), config)
    if os.environ.get("RANK", "0") == "0":
        save_file({"logits": logits}, out + "/logits.safetensors")
"""


def _seed000(tmp, out, *extra, processes=1, env=None, expect=0):
    script = tmp / "seed000_job.py"
    script.write_text(SEED000_JOB)
    launcher = [sys.executable] if processes == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
    proc = run_python([*launcher, script, PEERS, out, *extra], env=env)
    assert proc.returncode == expect, (proc.stdout + proc.stderr)[-4000:]
    return proc


@pytest.fixture(scope="module")
def seed000_runs(tmp_path_factory):
    """Trained on 1 process, then on 2; each run then predicts the test rows with the 1-process run's weights."""
    tmp = tmp_path_factory.mktemp("seed000")
    for processes in (1, 2):
        _seed000(tmp, tmp / f"run-{processes}", tmp / "run-1" / "best.safetensors", processes=processes)
    return tmp


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_seed000s_own_dataset_and_model_train_unchanged_counting_each_validation_sample_once(seed000_runs,
                                                                                            processes):
    summary = json.loads((seed000_runs / f"run-{processes}" / "summary.json").read_text())
    assert (summary["world_size"], summary["val_samples"], summary["epochs_run"]) == (processes, 70, 2)


@pytest.mark.slow
def test_seed000s_test_rows_are_predicted_identically_on_one_and_two_processes(seed000_runs):
    one, two = (load_file(seed000_runs / f"run-{n}" / "logits.safetensors")["logits"] for n in (1, 2))
    assert one.shape == (51, 10) and torch.equal(one, two)


@pytest.mark.slow
def test_seed000_on_two_processes_killed_mid_epoch_resumes_bitwise(seed000_runs):
    """Its albumentations pipeline draws in two DataLoader workers per process; rank 1 is killed in epoch 2."""
    out = seed000_runs / "killed"
    _seed000(seed000_runs, out, processes=2, env={"SCALETRAIN_FAULT": "kill:9:1"}, expect=1)
    assert not (out / "summary.json").exists()
    resumed = _seed000(seed000_runs, out, processes=2)
    assert "resuming from" in resumed.stdout and "epoch 2, batch 3" in resumed.stdout  # 5 batches an epoch
    whole, again = load_file(seed000_runs / "run-2" / "last.safetensors"), load_file(out / "last.safetensors")
    assert all(torch.equal(whole[k], again[k]) for k in whole)


def test_gradient_accumulation_with_ones_own_loss_and_optimizer_equals_one_large_batch(mnist, tmp_path):
    train = DictDigits(mnist, 0, 128)
    hooks = dict(loss_fn=nn.CrossEntropyLoss(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    runs = {}
    for name, batch, accum in (("big", 32, 1), ("accumulated", 16, 2)):
        cfg = _config(tmp_path / name, epochs=1, batch_size=batch)
        cfg.optim.grad_accum = accum
        torch.manual_seed(0)
        scaletrain.fit(Net(), train, None, cfg, **hooks)
        runs[name] = load_file(tmp_path / name / "last.safetensors")
    for k in runs["big"]:
        torch.testing.assert_close(runs["accumulated"][k], runs["big"][k], rtol=1e-5, atol=1e-6)


def test_bf16_and_the_weight_average_work_with_ones_own_code(mnist, tmp_path):
    cfg = _config(tmp_path, epochs=1)
    cfg.run.mixed_precision, cfg.optim.ema_decay = "bf16", 0.9
    torch.manual_seed(0)
    result = scaletrain.fit(Net("object"), DictDigits(mnist, 0, 128), DictDigits(mnist, 128, 160), cfg,
                            loss_fn=nn.CrossEntropyLoss(label_smoothing=0.1),
                            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    assert result.summary["mixed_precision"] == "bf16" and "ema_val_accuracy" in result.history[0]
    assert (tmp_path / "last_ema.safetensors").is_file()


def test_ones_own_collate_fn_makes_the_batches(mnist):
    calls = []

    def collate(items):
        calls.append(len(items))
        return {"image": torch.stack([i["image"] for i in items]), "label": torch.tensor([i["label"] for i in items])}

    _fit(Net(), DictDigits(mnist, 0, 64), None, collate_fn=collate)
    assert calls and set(calls) <= {1, 32}  # the first item alone, then the batches


class Readers(Dataset):
    """Digits held in memory whose items record the process that read them; `cost` seconds of reading each (a
    file decoded), else none."""

    def __init__(self, mnist, n, cost=0.0):
        self.x, self.y, self.cost = mnist.images[:n].float() / 255, mnist.labels[:n], cost

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if self.cost:
            import time
            time.sleep(self.cost)
        return self.x[i], self.y[i], torch.tensor(os.getpid())


def _readers_run(mnist, capsys, data, workers=None):
    cfg = scaletrain.TrainConfig()
    cfg.optim.epochs, cfg.optim.batch_size = 1, 32
    if workers is not None:
        cfg.data.num_workers = workers
    loss = lambda out, y: nn.functional.cross_entropy(out, y)  # noqa: E731
    net = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
    scaletrain.fit(net, data, None, cfg, batch_keys=(0, 1), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                   loss_fn=loss)
    return capsys.readouterr().out


def test_items_already_in_memory_are_read_in_the_training_process_by_default(mnist, capsys):
    """DataLoader workers for a TensorDataset only hand its batches over between processes (0.88 of a bare loop's
    speed for PyTorch's MNIST network, against 0.97 without them): by default, a batch that reads in under 2 ms is
    read where the step runs, said on one line."""
    seen = []

    class Seen(Readers):
        def __getitem__(self, i):
            item = super().__getitem__(i)
            seen.append(int(item[2]))
            return item

    out = _readers_run(mnist, capsys, Seen(mnist, 96))
    assert "train_data: a batch of 32 items reads in" in out and "read in the training process, without " \
                                                               "DataLoader workers (--num-workers auto" in out
    assert set(seen) == {os.getpid()}


def test_items_that_cost_their_reading_are_read_by_workers_by_default(mnist, capsys):
    out = _readers_run(mnist, capsys, Readers(mnist, 64, cost=0.001))
    assert "read by 2 DataLoader workers beside the step (--num-workers auto" in out


def test_a_number_of_workers_set_is_kept_and_auto_refuses_other_words(mnist, capsys):
    out = _readers_run(mnist, capsys, Readers(mnist, 64), workers=0)
    assert "--num-workers auto" not in out
    cfg = scaletrain.TrainConfig()
    cfg.data.num_workers = "two"
    with pytest.raises(UserError, match=r"--num-workers: expected auto or a number of workers \(0 or more\), got "
                                        r"'two'"):
        scaletrain.fit(nn.Linear(2, 2), Readers(mnist, 8), None, cfg)


class GlobalDraws(torch.utils.data.Dataset):
    """Items with noise from Python's, NumPy's and torch's global generators, as many a user's augmentation draws."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        import random

        import numpy as np

        return self.x[i] + 0.1 * torch.rand(8) + float(np.random.rand()) + random.random(), self.y[i]


def test_a_dataset_drawing_from_the_global_generators_trains_to_the_same_weights_with_0_or_2_workers(tmp_path):
    """Each batch's items are read with the global generators seeded for that batch, in a worker or in the training
    process alike, and the process's own draws (dropout) are left as they were: --num-workers auto may decide either
    way (by a timing), the weights are the same."""
    weights = []
    for workers in (0, 2, "auto"):
        cfg = scaletrain.TrainConfig()
        cfg.optim.epochs, cfg.optim.batch_size, cfg.data.num_workers = 2, 16, workers
        cfg.run.output_dir, cfg.run.log_with = str(tmp_path / str(workers)), "none"
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 3))
        scaletrain.fit(net, GlobalDraws(96), GlobalDraws(32), cfg)
        weights.append(net.state_dict())
    assert all(torch.equal(w[k], weights[0][k]) for w in weights[1:] for k in w)


def test_the_workers_auto_decided_are_recorded_and_kept_when_the_run_resumes(mnist, tmp_path, capsys):
    cfg = scaletrain.TrainConfig()
    cfg.optim.epochs, cfg.optim.batch_size, cfg.run.output_dir, cfg.run.log_with = 1, 32, str(tmp_path), "none"
    loss = lambda out, y: nn.functional.cross_entropy(out, y)  # noqa: E731
    net = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
    first = scaletrain.fit(net, Readers(mnist, 64), Readers(mnist, 32), cfg, batch_keys=(0, 1), loss_fn=loss)
    assert first.summary["num_workers"] == {"train_data": 0, "val_data": 0}
    cfg.optim.epochs = 2  # trained on: the items now cost their reading, the run keeps what it decided
    capsys.readouterr()
    again = scaletrain.fit(net, Readers(mnist, 64, cost=0.001), Readers(mnist, 32), cfg, batch_keys=(0, 1),
                           loss_fn=loss)
    assert "train_data: read by no DataLoader worker(s), as the run decided before it was resumed" in \
        capsys.readouterr().out
    assert again.summary["num_workers"] == {"train_data": 0, "val_data": 0}
