"""A user's own step prepared for fit: how batches reach the model (scaletrain's call, a keyword call for a model
whose forward takes the items' keys, or the user's `Step`), the checks its first batch goes through before anything
trains, and its optimizers: one (trained by the loop as fit's optimizer= is) or several by name, stepped by the step
itself through `Step.optimize` (see steps.StepJob) and saved and restored as one (NamedOptimizers)."""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from ..data.items import keyword_label, kept_global_rng, takes_keywords
from ..data.streams import item_zero
from ..errors import UserError, describe
from ..metrics import Loss
from ..parallel import BEAT, StepModule
from ..steps import BatchCalls, Step, StepJob, frozen_modules, parts_of


def optimizers_of(step: Step, model: nn.Module) -> dict[str, torch.optim.Optimizer] | None:
    """What `step.optimizers(model)` returns, as {name: optimizer}; None when it brings none (fit's optimizer= or
    scaletrain's own then trains). Refused on one line: anything but optimizers, parameters shared by two of them,
    parameters that are not the model's (they would be neither saved nor kept equal on every process)."""
    made = step.optimizers(model)
    if made is None:
        return None
    named = {"": made} if isinstance(made, torch.optim.Optimizer) else made
    if not isinstance(named, dict) or not named or \
            not all(isinstance(o, torch.optim.Optimizer) for o in named.values()):
        raise UserError(f"Step.optimizers(model) returned {describe(made)}; expected an optimizer or a dict "
                        f"{{name: optimizer}}")
    owner: dict[int, str] = {}
    mine = {id(p) for p in model.parameters()}
    for name, optimizer in named.items():
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in owner and owner[id(p)] != name:
                    raise UserError(f"Step.optimizers(model): optimizers {owner[id(p)]!r} and {name!r} share "
                                    f"parameters; give each network's parameters to one optimizer")
                if id(p) not in mine:
                    raise UserError(f"Step.optimizers(model): optimizer {name!r} holds a parameter that is not the "
                                    f"model's (it would be neither saved nor kept equal on every process); put the "
                                    f"module that holds it in the model")
                owner[id(p)] = name
    return named


class NamedOptimizers:
    """Several optimizers by name, saved and restored as one optimizer would be: their parameter indices follow
    each other in the order of the names."""

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]):
        self.optimizers = optimizers

    def __getitem__(self, name: str) -> torch.optim.Optimizer:
        return self.optimizers[name]

    @property
    def state(self) -> dict:
        return {k: v for o in self.optimizers.values() for k, v in o.state.items()}

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every optimizer's groups, in the order of the names (as state_dict numbers their parameters)."""
        return [g for o in self.optimizers.values() for g in o.param_groups]

    def describe(self) -> str:
        return ", ".join(f"{name} {type(o).__name__}" for name, o in self.optimizers.items())

    def state_dict(self) -> dict[str, Any]:
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for optimizer in self.optimizers.values():
            own = optimizer.state_dict()
            state.update({offset + i: slots for i, slots in own["state"].items()})
            groups += [{**g, "params": [offset + i for i in g["params"]]} for g in own["param_groups"]]
            offset += sum(len(g["params"]) for g in own["param_groups"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        groups, offset = list(saved["param_groups"]), 0
        for optimizer in self.optimizers.values():
            count = len(optimizer.param_groups)
            mine, groups = groups[:count], groups[count:]
            size = sum(len(g["params"]) for g in mine)
            optimizer.load_state_dict({
                "state": {int(i) - offset: slots for i, slots in saved["state"].items()
                          if offset <= int(i) < offset + size},
                "param_groups": [{**g, "params": [i - offset for i in g["params"]]} for g in mine]})
            offset += size


def calls_for(model: nn.Module, train_data: Any, code: Any, loss: Loss, images: bool) -> BatchCalls:
    """How this run's batches reach the model: through the user's Step (code.step), as keywords when the items are
    dicts whose keys the model's forward takes (a Hugging Face model: `model(**batch)`, its own loss), else
    `loss_fn(model(x), y)`."""
    step = code.step
    if step is not None and not isinstance(step, Step):
        raise UserError(f"step is {describe(step)}; expected an instance of a subclass of scaletrain.Step")
    if step is not None and images:
        raise UserError("step: a Step takes the batches of your own Dataset; scaletrain's image data (ImageSet, image "
                        "files, prepared shards) trains with its own step")
    item = None if step is not None or images else item_zero(train_data, "train_data")
    keywords = item is not None and takes_keywords(model, item, code.batch_keys)
    calls = BatchCalls(loss, step, keywords)
    if keywords:
        calls.label_key = keyword_label(item)
    return calls


def check_several(named: dict[str, torch.optim.Optimizer], grad_accum: int, compiled: bool, code: Any) -> None:
    """Refuse on one line what a step with several optimizers cannot do: accumulate `grad_accum` micro-batches a
    step (the batch plan's), be `compiled` (--compile)."""
    listed = ", ".join(named)
    if grad_accum > 1:
        raise UserError(f"--grad-accum {grad_accum}: a Step with several optimizers ({listed}) steps "
                        f"each once per batch, and accumulating would compute one network's gradients before the "
                        f"other's update; use a larger --batch-size (or --global-batch-size on more devices)")
    if code.optimizer is not None or code.scheduler is not None:
        raise UserError(f"optimizer= and scheduler= are for one optimizer; your Step's optimizers ({listed}) keep "
                        f"their own rates (set them in Step.optimizers)")
    if compiled:
        raise UserError(f"--compile: a Step with several optimizers ({listed}) calls its networks itself; compile "
                        f"them in your Step")


def trial_parts(calls: BatchCalls, model: nn.Module, batches: Any, runtime: Any, job: StepJob) -> list[str]:
    """The user's train_step run once on this rank's first training batch (in training mode, with autograd as
    training has it, so that gradients inside the step work: a gradient penalty, double backward, an inner loop;
    no optimizer stepped, and the gradients, every random generator, the BatchNorm statistics and the Step's own
    state as they were after), so that what it returns is checked before anything trains; the names of its losses
    (train_<name>)."""
    with trial(model, runtime, calls.step):
        x, y = batches.first_batch()
        job.trial = True
        try:
            with runtime.autocast():
                out = calls.train_losses(StepModule(model, calls.step.train_step), x, y)
        finally:
            job.trial = False
        parts = list(parts_of(out)[1])
    check_step_state(calls.step.state_dict(), type(calls.step).__name__)
    return parts


PLAIN_VALUES = (int, float, str, bool, type(None))


def check_step_state(state: Any, name: str, where: str = "") -> None:
    """Refuse on one line a Step's state_dict that a checkpoint cannot hold and load back without running code."""
    if where == "" and not isinstance(state, dict):
        raise UserError(f"{name}.state_dict() returned {describe(state)}; expected a dict (of tensors, numbers, "
                        f"strings, and lists and dicts of them)")
    if isinstance(state, dict):
        for key, value in state.items():
            check_step_state(value, name, f"{where}[{key!r}]")
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            check_step_state(value, name, f"{where}[{i}]")
    elif type(state) not in PLAIN_VALUES and not isinstance(state, torch.Tensor):  # a NumPy float: not loadable
        raise UserError(f"{name}.state_dict(){where} is {describe(state)}, which a checkpoint cannot hold; keep "
                        f"tensors, numbers, strings, and lists and dicts of them (a module's: module.state_dict())")


@contextmanager
def trial(model: nn.Module, runtime: Any, step: Step | None = None) -> Iterator[None]:
    """A trial pass in training mode that leaves nothing behind: the process's random generators, the model's
    buffers (BatchNorm statistics) and gradients restored, its mode too, and a Step as it was (see kept_step)."""
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    grads = [(p, p.grad) for p in model.parameters()]
    was_training = model.training
    devices = [runtime.device] if runtime.device.type == "cuda" else []
    try:
        with kept_global_rng(), torch.random.fork_rng(devices=devices), BEAT.during("the first batch's checks"), \
                kept_step(step, model), torch.enable_grad():
            model.train()
            yield
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
        for p, grad in grads:
            p.grad = grad
        model.train(was_training)


@contextmanager
def kept_step(step: Step | None, model: nn.Module | None = None) -> Iterator[None]:
    """A user's Step as it was before the block: its `state_dict()` given back to `load_state_dict`, its own modules'
    weights and buffers (an EMA teacher the step updates; not the model's, which the block keeps), and its plain
    attributes (a counter) restored."""
    if step is None:
        yield
        return
    state = copy.deepcopy(step.state_dict())
    modules = {name: {k: v.clone() for k, v in m.state_dict().items()}
               for name, m in frozen_modules(step, model).items()}
    plain = {k: v for k, v in vars(step).items() if isinstance(v, PLAIN_VALUES)}
    try:
        yield
    finally:
        for name in [k for k, v in vars(step).items() if k not in plain and isinstance(v, PLAIN_VALUES)]:
            del vars(step)[name]  # set by the trial over a class attribute (a counter's `calls = 0`)
        vars(step).update(plain)
        for name, saved in modules.items():
            getattr(step, name).load_state_dict(saved)
        step.load_state_dict(state)
