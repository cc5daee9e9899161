"""When a learning-rate scheduler is stepped: after every optimizer step, after every epoch, or after validation
with the monitored value (ReduceLROnPlateau).

A scheduler of the user's comes as `scheduler=make` or as `scheduler=Schedule(make, interval=..., monitor=...)`.
The interval is never guessed from the scheduler's class, which cannot tell it (PyTorch's MNIST example steps
StepLR once per epoch; stepped per batch it would lower the rate by 0.7 at every batch): it is either stated, or
read from the form of `make` itself, which is unambiguous in two cases only:
- `make(optimizer, total_steps)` that reads `total_steps` plans over the run's optimizer steps: stepped per step
  (what scaletrain has always done with it);
- a `ReduceLROnPlateau` is stepped once per epoch after validation, with the value it monitors.
Any other is refused on one line asking for the interval.
"""

from __future__ import annotations

import dis
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


def _positional(fn: Callable) -> int | None:
    """How many positional arguments `fn` takes (None: it does not say)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def reads_argument(fn: Callable, index: int) -> bool | None:
    """Whether a Python function reads its positional argument `index` anywhere in its body (also from a function
    defined inside it); None when `fn` has no Python code to read (a class, a builtin, a partial)."""
    code = getattr(inspect.unwrap(fn), "__code__", None)
    if code is None or code.co_argcount <= index:
        return None
    name = code.co_varnames[index]
    if name in code.co_cellvars:  # captured by an inner function or lambda
        return True
    return any(ins.opname.startswith("LOAD_FAST") and (ins.argval == name or isinstance(ins.argval, tuple)
                                                       and name in ins.argval) for ins in dis.get_instructions(code))


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
    args = _positional(make)
    total = epochs if interval == "epoch" else total_steps
    scheduler = make(optimizer) if args == 1 else make(optimizer, total)
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
        if args != 2 or not reads_argument(make, 1):
            raise UserError(
                f"scheduler: {name} makes {kind} without reading total_steps, so whether it is stepped after every "
                f"optimizer step or once per epoch is not said; pass scaletrain.Schedule({name}, interval='epoch') "
                f"(as PyTorch's examples step StepLR, MultiStepLR, ExponentialLR) or interval='step'")
        interval = "step"
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
