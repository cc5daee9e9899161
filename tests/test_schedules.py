"""A user's learning-rate scheduler stepped when their script steps it: per optimizer step, per epoch, or after
validation with the monitored value (ReduceLROnPlateau, the same decision on every rank), never guessed; what is
ambiguous or cannot be stepped is refused on one line before the first step."""

from __future__ import annotations

import csv
import json
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR, ExponentialLR, ReduceLROnPlateau, StepLR

import scaletrain
from scaletrain.errors import UserError
import functools

from scaletrain.training.schedules import Schedule, form_of, users_stepping

from helpers import Digits, run_cli



def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 16), nn.ReLU(), nn.Linear(16, 10))


def _fit(mnist, out="", epochs=3, val=True, **kwargs):
    cfg = scaletrain.TrainConfig()
    cfg.optim.epochs, cfg.optim.batch_size, cfg.data.num_workers = epochs, 32, 0
    cfg.run.output_dir = str(out)
    return scaletrain.fit(_net(), Digits(mnist, 0, 128), Digits(mnist, 128, 160) if val else None, cfg,
                          optimizer=kwargs.pop("optimizer", lambda p: torch.optim.SGD(p, lr=0.1)), **kwargs)


def test_a_scheduler_stated_per_epoch_is_stepped_once_per_epoch(mnist):
    """PyTorch's MNIST example's StepLR(step_size=1, gamma=0.7): each epoch trains at 0.7 x the one before."""
    result = _fit(mnist, scheduler=scaletrain.Schedule(lambda opt: StepLR(opt, step_size=1, gamma=0.7),
                                                       interval="epoch"))
    assert [row["lr"] for row in result.history] == pytest.approx([0.1, 0.07, 0.049])


def test_a_per_epoch_factory_is_given_the_runs_epochs(mnist):
    totals = []
    result = _fit(mnist, epochs=4, scheduler=scaletrain.Schedule(
        lambda opt, epochs: totals.append(epochs) or CosineAnnealingLR(opt, T_max=epochs), interval="epoch"))
    assert totals == [4]
    assert [row["lr"] for row in result.history] == pytest.approx(
        [0.1 * (1 + torch.cos(torch.tensor(torch.pi * e / 4)).item()) / 2 for e in range(4)])


@pytest.mark.parametrize("make", [lambda opt, total_steps: StepLR(opt, step_size=1, gamma=0.7),
                                  lambda opt: ExponentialLR(opt, gamma=0.9)])
def test_a_scheduler_that_does_not_say_its_interval_is_refused_asking_for_it(mnist, tmp_path, make):
    """The MNIST example converted as the docs once showed (stepped per batch, the rate was 1.9e-39 after an epoch
    and accuracy 59 %) now stops before the first step, asking which interval; nothing is written."""
    with pytest.raises(UserError, match=r"makes (StepLR|ExponentialLR) and it (does not read total_steps|takes the "
                                        r"optimizer alone), so whether it is stepped after every optimizer step or "
                                        r"once per epoch is not said; pass scaletrain.Schedule\(.*interval='epoch'\)"):
        _fit(mnist, out=tmp_path / "run", scheduler=make)
    assert not (tmp_path / "run" / "state").exists() and not (tmp_path / "run" / "metrics.csv").exists()


class _Recipe:
    """A recipe object whose method makes the scheduler, as training scripts organise their settings."""

    gamma = 0.7

    def make(self, optimizer, total_steps):
        return StepLR(optimizer, 1, self.gamma)

    def plan(self, optimizer, total_steps):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / total_steps)

    def per_epoch(self, optimizer, epochs):
        return CosineAnnealingLR(optimizer, T_max=epochs)

    @classmethod
    def linear(cls, optimizer, total_steps):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / total_steps)


def test_a_recipe_objects_method_that_does_not_read_total_steps_is_refused_not_stepped_per_batch(mnist, tmp_path):
    """`scheduler=recipe.make` with `make(self, optimizer, total_steps)` returning StepLR(optimizer, 1, 0.7) was
    stepped per batch (the method's self taken for the optimizer's slot): the rate fell to 1e-10 in one epoch."""
    with pytest.raises(UserError, match=r"_Recipe.make makes StepLR and it does not read total_steps, so whether"):
        _fit(mnist, out=tmp_path / "run", scheduler=_Recipe().make)
    result = _fit(mnist, scheduler=Schedule(_Recipe().make, interval="epoch"))
    assert [row["lr"] for row in result.history] == pytest.approx([0.1, 0.07, 0.049])


def _stepping(make, interval="auto", total_steps=12, epochs=3):
    optimizer = torch.optim.SGD(_net().parameters(), lr=0.1)
    return users_stepping(Schedule(make, interval=interval), optimizer, total_steps, epochs)


def _linear(optimizer, total_steps, warmup=0):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / total_steps)


class _LinearDecay:
    """A callable object that plans over the run's optimizer steps."""

    def __call__(self, optimizer, total_steps):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / total_steps)


class _Halving:
    """A callable object that makes a StepLR without reading total_steps."""

    def __call__(self, optimizer, total_steps):
        return StepLR(optimizer, 1, 0.5)


@pytest.mark.parametrize("form, make, interval, total", [
    ("a bound method reading total_steps", _Recipe().plan, "step", 12),
    ("a classmethod reading total_steps", _Recipe.linear, "step", 12),
    ("a partial of a function reading total_steps", functools.partial(_linear, warmup=1), "step", 12),
    ("a callable object reading total_steps", _LinearDecay(), "step", 12),
    ("a lambda over **kwargs reading total_steps",
     lambda opt, **kw: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / kw["total_steps"]), "step", 12),
    ("keyword-only total_steps", lambda opt, *, total_steps: torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 1 - s / total_steps), "step", 12),
])
def test_each_form_of_scheduler_is_stepped_at_the_interval_it_states(form, make, interval, total):
    stepping = _stepping(make)
    assert stepping.interval == interval, form
    if isinstance(stepping.scheduler, CosineAnnealingLR):
        assert stepping.scheduler.T_max == total, form  # made with the run's length it asked for
    else:
        stepping.scheduler.optimizer.step()
        stepping.scheduler.step()
        assert stepping.lr == pytest.approx(0.1 * (1 - 1 / total)), form


@pytest.mark.parametrize("form, make, why", [
    ("a partial of a scheduler class", functools.partial(StepLR, step_size=1, gamma=0.7),
     "it takes the optimizer alone"),
    ("a callable object that does not read total_steps", _Halving(),
     "it does not read total_steps"),
    ("a lambda over **kwargs reading neither", lambda opt, **kw: StepLR(opt, 1), "it reads neither total_steps nor "
                                                                                  "epochs"),
    ("a lambda over *args", lambda *args: StepLR(args[0], 1), "it takes \\*args"),
    ("a scheduler class itself", StepLR, "its code cannot be read \\(the class StepLR\\)"),
    ("a bound method reading epochs", _Recipe().per_epoch, "its epochs may plan per epoch or per step"),
    ("OneCycleLR planned over epochs", lambda opt, epochs: torch.optim.lr_scheduler.OneCycleLR(
        opt, 0.1, epochs=epochs, steps_per_epoch=4), "its epochs may plan per epoch or per step"),
    ("a lambda over **kwargs reading epochs", lambda opt, **kw: CosineAnnealingLR(opt, T_max=kw.get("epochs")),
     "it reads epochs, which may plan per epoch or per step"),
])
def test_a_form_that_does_not_state_its_interval_is_asked_for_it_on_one_line(form, make, why):
    with pytest.raises(UserError, match=f"and {why}, so whether it is stepped after every optimizer step or once per "
                                        f"epoch is not said; pass scaletrain.Schedule"):
        _stepping(make)


def test_a_stated_interval_makes_any_form_work():
    """The answer the refusal asks for: each form stepped as stated, given the run's length for that interval."""
    assert _stepping(functools.partial(StepLR, step_size=1, gamma=0.7), "epoch").interval == "epoch"
    assert _stepping(lambda opt, **kw: CosineAnnealingLR(opt, T_max=kw["epochs"]), "epoch").scheduler.T_max == 3
    assert _stepping(_Halving(), "step").interval == "step"
    assert _stepping(_Recipe().per_epoch, "epoch").scheduler.T_max == 3


def test_a_factory_that_plans_over_total_steps_is_stepped_per_optimizer_step(mnist):
    """What scaletrain always did with scheduler(optimizer, total_steps): 4 steps an epoch, 3 epochs."""
    result = _fit(mnist, scheduler=lambda opt, total: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / total))
    assert [row["lr"] for row in result.history] == pytest.approx([0.1 * (1 - 4 / 12), 0.1 * (1 - 8 / 12), 0.0])


def test_the_form_sees_a_read_in_the_body_or_in_an_inner_function():
    assert form_of(lambda o, n: n * 2).stated == "step" and form_of(lambda o, n: (lambda s: s / n)).stated == "step"
    assert form_of(lambda o, n: StepLR(o, 1)).stated is None
    assert form_of(lambda o, num_epochs: CosineAnnealingLR(o, num_epochs)).stated is None


def test_a_plateau_scheduler_lowers_the_rate_after_validation_stops_improving(mnist, tmp_path):
    """At a rate too small to change anything, val_loss stops improving after epoch 1; with patience 0 the rate
    halves after epoch 2's validation and again after epoch 3's."""
    result = _fit(mnist, out=tmp_path, epochs=4, optimizer=lambda p: torch.optim.SGD(p, lr=1e-6),
                  scheduler=lambda opt, total: ReduceLROnPlateau(opt, factor=0.5, patience=0))
    assert [row["lr"] for row in result.history] == pytest.approx([1e-6, 1e-6, 5e-7, 2.5e-7])
    train = json.loads(sorted((tmp_path / "state").iterdir())[-1].joinpath("train.json").read_text())
    assert train["scheduler"]["num_bad_epochs"] == 0 and train["scheduler"]["best"] < 3


def test_a_plateau_scheduler_can_watch_a_value_where_higher_is_better(mnist):
    result = _fit(mnist, epochs=3, optimizer=lambda p: torch.optim.SGD(p, lr=1e-6), scheduler=scaletrain.Schedule(
        lambda opt: ReduceLROnPlateau(opt, mode="max", factor=0.1, patience=0), monitor="val_accuracy"))
    assert [row["lr"] for row in result.history] == pytest.approx([1e-6, 1e-6, 1e-7])


@pytest.mark.parametrize("scheduler, val, expected", [
    (lambda opt, n: ReduceLROnPlateau(opt), False, "ReduceLROnPlateau is stepped with a validation value; give a "
                                                    "validation set"),
    (scaletrain.Schedule(lambda opt: ReduceLROnPlateau(opt), monitor="val_f1"), True,
     r"Schedule\(monitor='val_f1'\): this run's validation measures val_loss, val_accuracy"),
    (scaletrain.Schedule(lambda opt: ReduceLROnPlateau(opt), monitor="val_accuracy"), True,
     r"ReduceLROnPlateau\(mode='min'\) watching val_accuracy, for which higher is better, would lower the rate "
     r"while it improves; use mode='max'"),
    (lambda opt, n: ReduceLROnPlateau(opt, mode="max"), True, r"ReduceLROnPlateau\(mode='max'\) needs the value it "
                                                              r"watches"),
    (scaletrain.Schedule(lambda opt: ReduceLROnPlateau(opt), interval="step"), True,
     "stepped with a validation value once per epoch"),
    (scaletrain.Schedule(lambda opt: StepLR(opt, 1), monitor="val_loss"), True, "makes StepLR, which takes no value "
                                                                                "to step with"),
])
def test_a_scheduler_that_cannot_be_stepped_as_asked_is_refused_before_the_first_step(mnist, scheduler, val,
                                                                                       expected):
    with pytest.raises(UserError, match=expected):
        _fit(mnist, val=val, scheduler=scheduler)


def test_an_interval_that_does_not_exist_is_refused():
    with pytest.raises(UserError, match=r"Schedule\(interval='batch'\): expected one of auto, step, epoch"):
        scaletrain.Schedule(lambda opt: StepLR(opt, 1), interval="batch")


class _Stop(Exception):
    pass


def test_a_run_with_an_epoch_scheduler_and_a_plateau_resumes_to_the_same_weights_and_rates(mnist, tmp_path):
    def schedule():
        return scaletrain.Schedule(lambda opt: StepLR(opt, step_size=1, gamma=0.5), interval="epoch")

    _fit(mnist, out=tmp_path / "whole", scheduler=schedule())

    def stop_after_first(row, step):
        if row["epoch"] == 1:
            raise _Stop

    with pytest.raises(_Stop):
        _fit(mnist, out=tmp_path / "cut", scheduler=schedule(), on_epoch=stop_after_first)
    _fit(mnist, out=tmp_path / "cut", scheduler=schedule())
    whole, cut = load_file(tmp_path / "whole/last.safetensors"), load_file(tmp_path / "cut/last.safetensors")
    assert all(torch.equal(whole[k], cut[k]) for k in whole)
    rows = [list(csv.DictReader((tmp_path / d / "metrics.csv").open())) for d in ("whole", "cut")]
    assert [r["lr"] for r in rows[0]] == [r["lr"] for r in rows[1]] == ["0.1", "0.05", "0.025"]


PLATEAU = textwrap.dedent('''
    import json, os, sys
    import torch
    from torch import nn
    from torch.utils.data import Dataset
    import scaletrain

    class Digits(Dataset):
        def __init__(self, data):
            self.x, self.y = data.images.float().div(255), data.labels
        def __len__(self):
            return len(self.y)
        def __getitem__(self, i):
            return self.x[i], self.y[i]

    data = scaletrain.load_image_sets("default")[0]
    train, val = Digits(data.subset(torch.arange(128))), Digits(data.subset(torch.arange(128, 161)))
    config = scaletrain.TrainConfig()
    config.optim.epochs, config.optim.batch_size, config.data.num_workers = 4, 16, 0
    torch.manual_seed(0)
    rates = []
    scaletrain.fit(nn.Sequential(nn.Flatten(), nn.Linear(784, 10)), train, val, config,
                   optimizer=lambda p: torch.optim.SGD(p, lr=1e-6),
                   scheduler=lambda opt, n: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0),
                   on_epoch=lambda row, step: rates.append(row["lr"]))
    with open(os.path.join(sys.argv[1], f"rank-{os.environ['RANK']}.json"), "w") as f:
        json.dump(rates, f)
''')


@pytest.mark.slow
def test_a_plateau_scheduler_takes_the_same_decision_on_every_rank(tmp_path):
    script = tmp_path / "plateau.py"
    script.write_text(PLATEAU)
    proc = run_cli(str(tmp_path), module=str(script),
                   launcher=[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rates = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert rates[0] == rates[1] == pytest.approx([1e-6, 1e-6, 5e-7, 2.5e-7])


def test_a_plateau_scheduler_killed_mid_epoch_resumes_with_its_best_value_and_patience(mnist, tmp_path, monkeypatch):
    """Its state (best value, epochs without improvement, the rates it lowered) is in every checkpoint."""
    def run(out):
        cfg = scaletrain.TrainConfig()
        cfg.optim.epochs, cfg.optim.batch_size, cfg.data.num_workers = 4, 32, 0
        cfg.run.output_dir, cfg.run.checkpoint_every = str(out), 2
        scaletrain.fit(_net(), Digits(mnist, 0, 128), Digits(mnist, 128, 160), cfg,
                       optimizer=lambda p: torch.optim.SGD(p, lr=1e-6),
                       scheduler=lambda opt, n: ReduceLROnPlateau(opt, factor=0.5, patience=0))

    run(tmp_path / "whole")
    monkeypatch.setenv("SCALETRAIN_FAULT", "raise:15")  # epoch 4, after its rate was lowered and step 14 saved
    with pytest.raises(RuntimeError, match="fault injected"):
        run(tmp_path / "cut")
    monkeypatch.delenv("SCALETRAIN_FAULT")
    run(tmp_path / "cut")
    assert json.loads((tmp_path / "cut" / "resumes.jsonl").read_text())["batch"] == 2
    whole, cut = load_file(tmp_path / "whole/last.safetensors"), load_file(tmp_path / "cut/last.safetensors")
    assert all(torch.equal(whole[k], cut[k]) for k in whole)
    rows = [list(csv.DictReader((tmp_path / d / "metrics.csv").open())) for d in ("whole", "cut")]
    assert [r["lr"] for r in rows[0]] == [r["lr"] for r in rows[1]] == ["1e-06", "1e-06", "5e-07", "2.5e-07"]
