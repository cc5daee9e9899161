"""The training loop through the Python API, in one process."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import Dataset

import scaletrain
from scaletrain.config import TrainConfig, resolve
from scaletrain.training.optim import lr_factor, make_scheduler
from scaletrain.training.signals import TrainingDiverged
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


@pytest.fixture
def global_256():
    """--global-batch-size 256 with --grad-accum 2 (and a per-device --batch-size 7 it overrides)."""
    cfg = scaletrain.TrainConfig()
    cfg.optim.global_batch_size, cfg.optim.grad_accum, cfg.optim.batch_size = 256, 2, 7
    return cfg.validate()


def test_a_global_batch_is_divided_by_devices_and_accumulation_steps(global_256):
    plans = [global_256.plan(n) for n in (1, 2, 4)]
    assert [p.batch_per_device for p in plans] == [128, 64, 32]
    assert [p.global_batch for p in plans] == [256, 256, 256]


def test_resolving_for_a_device_count_leaves_the_config_as_asked(global_256):
    global_256.plan(4)
    assert global_256.optim.batch_size == 7


def test_a_global_batch_that_devices_cannot_share_is_refused(global_256):
    with pytest.raises(UserError, match="cannot be shared evenly by 3 device"):
        global_256.plan(3)


@pytest.mark.parametrize("kind, expected", [("none", 0.1), ("linear", 0.4), ("sqrt", 0.2)])
def test_lr_scaling_on_4_devices(kind, expected):
    scaled = scaletrain.TrainConfig()
    scaled.optim.lr, scaled.optim.lr_scaling = 0.1, kind
    assert scaled.validate().plan(4).lr == pytest.approx(expected)


def test_warmup_rises_linearly_then_a_constant_schedule_stays_at_the_peak():
    assert [round(lr_factor(s, 10, 4, "constant"), 2) for s in range(6)] == [0.2, 0.4, 0.6, 0.8, 1.0, 1.0]


def test_cosine_starts_at_the_peak_after_warmup_and_ends_near_zero():
    assert lr_factor(4, 10, 4, "cosine") == 1.0 and lr_factor(9, 10, 4, "cosine") < 0.1


def test_onecycle_falls_steadily_after_warmup_to_a_sixth():
    onecycle = [lr_factor(s, 10, 4, "onecycle") for s in range(4, 10)]
    assert onecycle == sorted(onecycle, reverse=True) and len(set(onecycle)) == 6
    assert onecycle[-1] == pytest.approx(1 / 6)


@pytest.mark.parametrize("epochs, warmup", [(1, 0.5), (2, 1.0), (8, 1.0)])
def test_the_default_warmup_is_one_epoch_but_at_most_half_the_run(epochs, warmup):
    cfg = scaletrain.TrainConfig()
    cfg.optim.epochs = epochs
    assert cfg.validate().optim.warmup() == warmup
    cfg.optim.warmup_epochs = 1.0  # a warm-up asked for is kept as asked
    assert cfg.optim.warmup() == 1.0


def _rates(epochs: int, steps_per_epoch: int, **optim) -> list[float]:
    """The learning rate of every optimizer step of a run with the default schedule."""
    cfg = scaletrain.TrainConfig()
    cfg.optim.epochs = epochs
    for k, v in optim.items():
        setattr(cfg.optim, k, v)
    optim = resolve(cfg, cfg.plan(1)).optim
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=optim.lr)
    sched = make_scheduler(opt, optim, steps_per_epoch)
    rates = []
    for _ in range(epochs * steps_per_epoch):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return rates


def test_a_one_epoch_run_ends_after_its_warmup_with_the_rate_fallen():
    """A user's first one-epoch smoke test is not all warm-up: the rate peaks halfway, then falls, so the model is
    validated after the fall; asked for, a whole epoch of warm-up still is one."""
    rates = _rates(1, 20)
    assert rates.index(max(rates)) == 10 and rates[-1] < 0.15 * max(rates)
    asked = _rates(1, 20, warmup_epochs=1.0)
    assert asked.index(max(asked)) == 19


def test_longer_runs_keep_their_one_epoch_warmup():
    for epochs in (2, 8):
        rates = _rates(epochs, 20)
        assert rates.index(max(rates)) == 20


class _Pairs(Dataset):
    def __init__(self, data):
        self.x = data.images.float().div(255)
        self.y = data.labels

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


@pytest.fixture(scope="module")
def users_fit(tmp_path_factory, mnist):
    """scaletrain.fit of a plain linear model on a user's own map-style Dataset: 300 samples, 3 epochs."""
    out = tmp_path_factory.mktemp("fit")
    train, val = _Pairs(mnist.subset(torch.arange(300))), _Pairs(mnist.subset(torch.arange(300, 377)))
    cfg = _config(out, epochs=3, batch_size=32, lr=0.05)
    cfg.data.num_workers = 0
    return out, val, scaletrain.fit(_linear(), train, val, cfg)


def test_fit_with_a_users_model_and_dataset_learns(users_fit):
    _, _, result = users_fit
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"]
    assert result.best_val_accuracy > 0.6


def test_fit_writes_a_summary_of_the_users_validation_set(users_fit):
    out, _, _ = users_fit
    summary = json.loads((out / "summary.json").read_text())
    assert summary["val_samples"] == 77 and summary["world_size"] == 1


def test_fit_writes_one_metrics_row_per_epoch(users_fit):
    out, _, _ = users_fit
    rows = (out / "metrics.csv").read_text().splitlines()
    assert rows[0] == "epoch,train_loss,val_loss,val_accuracy,lr,epoch_seconds,images_per_second"
    assert [r.split(",")[0] for r in rows[1:]] == ["1", "2", "3"]


def test_fit_saves_the_weights_that_scored_the_last_epoch(users_fit):
    """Evaluating the saved weights again gives the last epoch's validation accuracy."""
    out, val, result = users_fit
    model = _linear()
    model.load_state_dict(load_file(out / "last.safetensors"))
    with torch.no_grad():
        acc = (model(val.x).argmax(1) == val.y).float().mean().item()
    assert acc == pytest.approx(result.history[-1]["val_accuracy"])


def test_gradient_accumulation_equals_one_large_batch(tmp_path, mnist):
    train, val = mnist.subset(torch.arange(100)), mnist.subset(torch.arange(100, 150))
    big = scaletrain.fit(_linear(), train, val, _config(tmp_path / "big", epochs=2, batch_size=32))
    acc = scaletrain.fit(_linear(), train, val, _config(tmp_path / "acc", epochs=2, batch_size=16, grad_accum=2))
    w_big, w_acc = load_file(tmp_path / "big/last.safetensors"), load_file(tmp_path / "acc/last.safetensors")
    for k in w_big:
        torch.testing.assert_close(w_acc[k], w_big[k], rtol=1e-5, atol=1e-6)
    assert acc.history[-1]["train_loss"] == pytest.approx(big.history[-1]["train_loss"], rel=1e-5)


def test_a_diverging_run_stops_with_a_clear_error(tmp_path, mnist):
    train, val = mnist.subset(torch.arange(256)), mnist.subset(torch.arange(256, 300))
    with pytest.raises(TrainingDiverged, match="training loss became non-finite in batch [0-9]+ of the epoch: the "
                                               "weights grew to .* in magnitude .* updates are too large; lower --lr"):
        scaletrain.fit(_linear(), train, val, _config(tmp_path, epochs=3, batch_size=32, lr=1e12, momentum=0.0))
    assert not (tmp_path / "summary.json").exists()


class _Items(torch.utils.data.Dataset):
    """64 items of 8 features and 3 classes; item 5 made bad as `bad` says."""

    def __init__(self, bad: str):
        self.bad = bad

    def __len__(self):
        return 64

    def __getitem__(self, i):
        x = torch.randn(8, generator=torch.Generator().manual_seed(i))
        if i == 5 and self.bad in ("inputs", "outputs"):
            x[:] = float("nan") if self.bad == "inputs" else 1e30
        target = torch.zeros(3)
        target[i % 3] = float("inf") if i == 5 and self.bad == "labels" else 1.0
        return x, target


class _Squared(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, x):
        return self.lin(x) ** 2


@pytest.mark.parametrize("bad, named", [
    ("inputs", "the inputs held 8 NaN or infinite values before the model saw them: the data gives them"),
    ("outputs", "the model's outputs are non-finite with finite inputs and weights: an overflow in the forward pass "
                "(fp32)"),
    ("labels", "the model's outputs are finite and their loss is not: check the labels")])
def test_a_non_finite_loss_names_what_is_non_finite_before_it_suggests_a_learning_rate(bad, named):
    cfg = TrainConfig.from_dict({"optim": {"epochs": 1, "batch_size": 16, "lr": 0.01}, "run": {"output_dir": ""}})
    with pytest.raises(TrainingDiverged, match="training loss became non-finite in batch [1-4] of the epoch: ") as e:
        scaletrain.fit(_Squared(), _Items(bad), None, cfg, loss_fn=nn.functional.cross_entropy)
    assert named in str(e.value) and ("learning rate is not the cause" in str(e.value)) == (bad == "inputs")


def test_bf16_autocast_trains_on_cpu(tmp_path, mnist):
    train, val = mnist.subset(torch.arange(256)), mnist.subset(torch.arange(256, 300))
    cfg = _config(tmp_path, epochs=2, batch_size=64)
    cfg.run.mixed_precision = "bf16"
    model = scaletrain.build_model("tinycnn", 1, 10)
    result = scaletrain.fit(model, train, val, cfg)
    assert result.summary["mixed_precision"] == "bf16"
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"]


@pytest.mark.slow
class _Blocks(nn.Module):
    """A user's model of three repeated blocks (one class) between a stem and a head."""

    class Block(nn.Module):
        def __init__(self, width: int):
            super().__init__()
            self.norm, self.up = nn.LayerNorm(width), nn.Linear(width, 16 * width)
            self.down = nn.Linear(16 * width, width)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(self.norm(x))))

    def __init__(self, width: int = 16):
        super().__init__()
        self.stem, self.head = nn.Linear(784, width), nn.Linear(width, 10)
        self.blocks = nn.Sequential(*(self.Block(width) for _ in range(3)))

    def forward(self, x):
        return self.head(self.blocks(self.stem(x.flatten(1))))


@pytest.mark.slow
@pytest.mark.parametrize("model, scope", [("tinycnn", "blocks"), ("blocks", "blocks")])
def test_compiled_training_matches_eager_and_compiles_once(tmp_path, mnist, model, scope, capsys):
    """--compile: the whole model where it has no repeated blocks (tinycnn), else each kind of block once (three
    blocks, one graph); the epoch's last batch (24 of 32) and validation run eagerly: nothing compiles again."""
    from torch._dynamo.utils import counters

    train, val = mnist.subset(torch.arange(120)), mnist.subset(torch.arange(120, 160))
    results = {}
    for name in ("eager", "compiled"):
        cfg = _config(tmp_path / name, epochs=1, batch_size=32)
        cfg.model.compile, cfg.model.compile_scope = name == "compiled", scope
        torch.manual_seed(0)
        torch._dynamo.reset()
        counters.clear()
        scaletrain.fit(scaletrain.build_model("tinycnn", 1, 10) if model == "tinycnn" else _Blocks(), train, val, cfg)
        results[name] = load_file(tmp_path / name / "last.safetensors")
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # one graph, compiled once
    said = capsys.readouterr().out
    assert ("--compile: its 3 repeated blocks (Block; 25,488 of its parameters) one by one" if model == "blocks" else
            "--compile: the whole model compiled") in said, said
    for k in results["eager"]:
        # Compiled kernels sum in another order: equal up to rounding, amplified by 4 steps at lr 0.05.
        torch.testing.assert_close(results["compiled"][k], results["eager"][k], rtol=1e-2, atol=2e-4)


@pytest.fixture(scope="module")
def deterministic_fit(tmp_path_factory, mnist):
    """A fit with --deterministic; whether deterministic kernels were on in each forward pass, and after."""
    out = tmp_path_factory.mktemp("deterministic")
    train, val = mnist.subset(torch.arange(64)), mnist.subset(torch.arange(64, 80))
    cfg = _config(out, epochs=1, batch_size=32)
    cfg.run.deterministic = True
    model = scaletrain.build_model("tinycnn", 1, 10)
    seen = []
    model.register_forward_hook(lambda *_: seen.append(torch.are_deterministic_algorithms_enabled()))
    scaletrain.fit(model, train, val, cfg)
    return out, seen, torch.are_deterministic_algorithms_enabled()


def test_deterministic_kernels_are_on_in_every_forward_pass(deterministic_fit):
    _, seen, _ = deterministic_fit
    assert len(seen) >= 3 and all(seen)  # 2 training batches and a validation pass


def test_deterministic_kernels_are_off_again_after_training(deterministic_fit):
    """A notebook's next run is left as it was."""
    _, _, after = deterministic_fit
    assert after is False


def test_deterministic_is_recorded_in_config_yaml(deterministic_fit):
    out, _, _ = deterministic_fit
    assert "deterministic: true" in (out / "config.yaml").read_text()


def test_fit_shows_what_users_pass_each_parameter_documented():
    """fit's signature holds what a user passes, at most 16 parameters, each one in docs/api.md's table."""
    import inspect
    from pathlib import Path

    names = list(inspect.signature(scaletrain.fit).parameters)
    assert len(names) <= 16, names
    assert not {"runtime", "hold", "preprocess", "model_name", "classes"} & set(names)
    table = (Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
    undocumented = [n for n in names if f"| `{n}` |" not in table]
    assert not undocumented, f"docs/api.md has no row for fit's {undocumented}"


class _Named(Dataset):
    classes = [f"digit {i}" for i in range(10)]  # as torchvision's ImageFolder keeps them

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def test_the_saved_weights_name_build_models_model_and_the_datasets_classes_through_a_subset(tmp_path, mnist):
    import json as json_
    from safetensors import safe_open

    data = _Named(mnist.images[:96].float().div(255), mnist.labels[:96])
    train, val = torch.utils.data.Subset(data, range(64)), torch.utils.data.Subset(data, range(64, 96))
    scaletrain.fit(scaletrain.build_model("tinycnn", 1, 10), train, val, _config(tmp_path, epochs=1, batch_size=32))
    with safe_open(str(tmp_path / "last.safetensors"), framework="pt") as f:
        meta = json_.loads(f.metadata()["scaletrain"])
    assert meta["model"] == "tinycnn" and meta["classes"] == _Named.classes


def test_a_classes_attribute_that_is_not_a_list_of_names_is_not_saved_as_names():
    from scaletrain.training.build import classes_of

    class Counted(_Named):
        classes = 10  # the number of classes, as some datasets keep it

    assert classes_of(torch.utils.data.Subset(Counted(None, []), [])) is None
    assert classes_of(torch.utils.data.Subset(_Named(None, []), [])) == _Named.classes
