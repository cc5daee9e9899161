"""When a learning-rate scheduler is stepped: after every optimizer step, after every epoch, or after validation
with the monitored value (ReduceLROnPlateau).

A scheduler of the user's comes as `scheduler=make` or as `scheduler=Schedule(make, interval=..., monitor=...)`.
The interval is never guessed from the scheduler's class, which cannot tell it (PyTorch's MNIST example steps
StepLR once per epoch; stepped per batch it would lower the rate by 0.7 at every batch): it is either stated, or
read from the form of `make` itself (a function, a bound method or classmethod, a partial, a callable object, a
lambda over **kwargs; see `form_of`), which is unambiguous in these cases only:
- `make(optimizer, total)` whose code reads `total` plans over the run's optimizer steps: stepped per step (what
  scaletrain has always done with it); the same for a keyword-only `total_steps`, and for a `**kwargs` whose code
  names `total_steps` alone. A parameter named for epochs is not enough: `OneCycleLR(epochs=epochs,
  steps_per_epoch=n)` plans over epochs and is stepped per step;
- a `ReduceLROnPlateau` is stepped once per epoch after validation, with the value it monitors.
Any other is refused on one line asking for the interval; nothing is stepped per batch by a guess.
"""

from __future__ import annotations

import dis
import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import UserError, describe

INTERVALS = ("auto", "step", "epoch")
Plateau = torch.optim.lr_scheduler.ReduceLROnPlateau


@dataclass(frozen=True)
class Schedule:
    """A learning-rate scheduler of yours and when it is stepped.

    `make(optimizer, total)` (or `make(optimizer)`) returns the scheduler: `total` is the run's optimizer steps for
    interval "step", its epochs for "epoch". `interval`: "step" (after every optimizer step), "epoch" (after each
    epoch's validation), or "auto" (per step when `make` reads its total_steps, per epoch for ReduceLROnPlateau,
    else refused). `monitor`: the validation value a ReduceLROnPlateau is stepped with (val_loss, val_accuracy,
    val_<metric>); by default val_loss for mode="min"."""

    make: Callable[..., Any]
    interval: str = "auto"
    monitor: str | None = None

    def __post_init__(self):
        if not callable(self.make):
            raise UserError(f"Schedule: make is {describe(self.make)}; expected a function (optimizer, total) -> "
                            f"scheduler")
        if self.interval not in INTERVALS:
            raise UserError(f"Schedule(interval={self.interval!r}): expected one of {', '.join(INTERVALS)}")

    @classmethod
    def of(cls, scheduler: Any) -> Schedule | None:
        """A `scheduler=` argument as a Schedule (None: none given)."""
        if scheduler is None or isinstance(scheduler, Schedule):
            return scheduler
        return cls(scheduler)

    @property
    def name(self) -> str:
        return getattr(self.make, "__qualname__", type(self.make).__qualname__)

    @property
    def needs_run_length(self) -> bool:
        """Whether the run's optimizer steps must be known ahead (a stream without --steps-per-epoch cannot say)."""
        return self.interval != "epoch"


@dataclass(frozen=True)
class Form:
    """How a scheduler's `make` takes the run's length, read from its signature (a bound method's `self`, a
    partial's bound arguments and a callable object's `self` are not the optimizer's slot): `total` is the parameter
    that receives it (None: `make(optimizer)`), by position or by keyword (`total_steps=` / `epochs=`, or both to a
    `**kwargs`); `stated` the interval its code says by reading it ("step", "epoch", or None: not said)."""

    total: str | None
    by_keyword: tuple[str, ...]
    stated: str | None
    why: str

    def make(self, make: Callable, optimizer: Any, total_steps: int, epochs: int, interval: str) -> Any:
        if self.by_keyword:
            given = {"total_steps": total_steps, "epochs": epochs}
            return make(optimizer, **{k: given[k] for k in self.by_keyword})
        if self.total is None:
            return make(optimizer)
        return make(optimizer, epochs if interval == "epoch" else total_steps)


KEYWORDS = ("total_steps", "epochs")


def form_of(make: Callable) -> Form:
    """`make`'s Form (see the class)."""
    try:
        params = list(inspect.signature(make).parameters.values())
    except (TypeError, ValueError):
        return Form("total", (), None, "its signature cannot be read")
    code = _code_of(make)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind is p.VAR_POSITIONAL for p in params) and len(positional) < 2:
        return Form("total", (), None, "it takes *args")
    if len(positional) >= 2:
        name = positional[1].name
        if code is None:
            return Form(name, (), None, f"its code cannot be read ({_kind(make)})")
        if not _reads(code, name):
            return Form(name, (), None, f"it does not read {name}")
        if "epoch" in name:  # epochs to plan over per epoch, or OneCycleLR(epochs=..., steps_per_epoch=...) per step
            return Form(name, (), None, f"its {name} may plan per epoch or per step")
        return Form(name, (), "step", "")
    keywords = tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name in KEYWORDS)
    if any(p.kind is p.VAR_KEYWORD for p in params):
        keywords = KEYWORDS
        read = tuple(k for k in KEYWORDS if code is not None and _mentions(code, k))
    else:
        read = tuple(k for k in keywords if code is not None and _reads(code, k))
    if not keywords:
        return Form(None, (), None, "it takes the optimizer alone")
    if read != ("total_steps",):
        return Form(None, keywords, None, "it reads epochs, which may plan per epoch or per step" if read else
                    "it reads neither total_steps nor epochs")
    return Form(None, keywords, "step", "")


def _code_of(fn: Any) -> Any:
    """The Python code behind a callable: a function's, a bound method's or classmethod's function, a partial's
    function, a callable object's __call__; None for a class or a builtin."""
    for _ in range(8):
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif inspect.ismethod(fn):
            fn = fn.__func__
        elif inspect.isfunction(fn):
            return inspect.unwrap(fn).__code__
        elif inspect.isclass(fn) or not inspect.isfunction(getattr(type(fn), "__call__", None)):
            return None
        else:
            fn = type(fn).__call__
    return None


def _kind(fn: Any) -> str:
    return f"the class {fn.__name__}" if inspect.isclass(fn) else f"a {type(fn).__name__}"


def _reads(code: Any, name: str) -> bool:
    """Whether the code reads its local `name` anywhere in its body (also from a function defined inside it)."""
    if name in code.co_cellvars:  # captured by an inner function or lambda
        return True
    return any(ins.opname.startswith("LOAD_FAST") and (ins.argval == name or isinstance(ins.argval, tuple)
                                                       and name in ins.argval) for ins in dis.get_instructions(code))


def _mentions(code: Any, key: str) -> bool:
    """Whether the code (or a function inside it) names `key` as a string: kwargs["total_steps"], kwargs.get(...)."""
    return any(c == key or (inspect.iscode(c) and _mentions(c, key)) for c in code.co_consts)


class Stepping:
    """A run's scheduler and when it is stepped; checkpointed through its state_dict."""

    def __init__(self, scheduler: Any, interval: str, monitor: str | None = None):
        self.scheduler, self.interval, self.monitor = scheduler, interval, monitor

    @property
    def lr(self) -> float:
        """The first parameter group's learning rate now."""
        return self.scheduler.optimizer.param_groups[0]["lr"]

    def after_optimizer_step(self) -> None:
        if self.interval == "step":
            self.scheduler.step()

    def after_epoch(self, row: dict[str, Any]) -> None:
        """The epoch is trained and validated (`row`: its metrics.csv values, the same on every rank)."""
        if self.interval != "epoch":
            return
        if self.monitor is not None:
            self.scheduler.step(row[self.monitor])
        else:
            self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)


def constant(optimizer: torch.optim.Optimizer) -> Stepping:
    """The user's optimizer at its own rates, as in their loop without a scheduler."""
    return Stepping(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), "step")


def users_stepping(schedule: Schedule, optimizer: torch.optim.Optimizer, total_steps: int, epochs: int) -> Stepping:
    """The user's scheduler made for `optimizer` and its interval settled (see the module's text), or refused on
    one line."""
    make, interval, name = schedule.make, schedule.interval, schedule.name
    form = form_of(make)
    stated = form.stated if interval == "auto" else interval
    scheduler = form.make(make, optimizer, total_steps, epochs, stated or "step")
    if not hasattr(scheduler, "step") or not hasattr(scheduler, "state_dict"):
        raise UserError(f"scheduler: {name} returned {describe(scheduler)}; expected a learning-rate scheduler "
                        f"(torch.optim.lr_scheduler)")
    kind = type(scheduler).__name__
    if isinstance(scheduler, Plateau):
        if interval == "step":
            raise UserError(f"scheduler: Schedule({name}, interval='step') makes ReduceLROnPlateau, which is "
                            f"stepped with a validation value once per epoch; leave interval to 'auto' or 'epoch'")
        return Stepping(scheduler, "epoch", schedule.monitor or ("val_loss" if scheduler.mode == "min" else ""))
    if schedule.monitor is not None:
        raise UserError(f"scheduler: Schedule({name}, monitor={schedule.monitor!r}) makes {kind}, which takes no "
                        f"value to step with; monitor is for ReduceLROnPlateau")
    if interval == "auto":
        if form.stated is None:
            raise UserError(
                f"scheduler: {name} makes {kind} and {form.why}, so whether it is stepped after every optimizer "
                f"step or once per epoch is not said; pass scaletrain.Schedule({name}, interval='epoch') (as "
                f"PyTorch's examples step StepLR, MultiStepLR, ExponentialLR) or interval='step'")
        interval = form.stated
    return Stepping(scheduler, interval)


def check_monitor(stepping: Stepping, measured: list[str], higher_is_better: Callable[[str], bool | None],
                  validated: bool) -> None:
    """Refuse on one line, before the first step, a plateau scheduler that cannot be stepped as asked: without a
    validation set, monitoring a value the run does not measure, or in the wrong sense for it."""
    scheduler, monitor = stepping.scheduler, stepping.monitor
    if monitor is None:
        return
    if not validated:
        raise UserError("scheduler: ReduceLROnPlateau is stepped with a validation value; give a validation set "
                        "(val_data)")
    if not monitor:
        raise UserError("scheduler: ReduceLROnPlateau(mode='max') needs the value it watches: "
                        f"scaletrain.Schedule(make, monitor=...), one of {', '.join(measured)}")
    if monitor not in measured:
        raise UserError(f"scheduler: Schedule(monitor={monitor!r}): this run's validation measures "
                        f"{', '.join(measured)}")
    higher = higher_is_better(monitor[len("val_"):])
    if higher is not None and higher != (scheduler.mode == "max"):
        raise UserError(f"scheduler: ReduceLROnPlateau(mode={scheduler.mode!r}) watching {monitor}, for which "
                        f"{'higher' if higher else 'lower'} is better, would lower the rate while it improves; use "
                        f"mode={'max' if higher else 'min'!r}")
