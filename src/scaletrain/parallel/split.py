"""A model cut into pipeline stages: its ordered parts, where the cuts fall, the check that its forward is the
sequence of those parts, and each stage's model with the other stages' parts taken out (names unchanged).

A part is a child of the model, an nn.Sequential or nn.ModuleList child opened into its elements (again and
again): `layer1.0`, `blocks.3`, `head`. The model's forward must run its parts one after another, each taking
the one before's output, as nn.Sequential does; `check_chain` runs one batch through the whole model on the meta
device (shapes only) and refuses, naming the place, anything else (a skip connection across a cut, `x.flatten(1)`
between two parts, a part called twice or with two inputs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import UserError


def model_parts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of the model's parts in order (see the module's doc)."""
    def opened(prefix: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
        if isinstance(module, (nn.Sequential, nn.ModuleList)) and len(module):
            return [p for name, child in module.named_children() for p in opened(f"{prefix}{name}.", child)]
        return [(prefix[:-1], module)]

    return [p for name, child in model.named_children() for p in opened(f"{name}.", child)]


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@dataclass(frozen=True)
class Split:
    """The parts in order and the index of the first part of each stage (`starts[0]` is 0)."""

    parts: tuple[str, ...]
    starts: tuple[int, ...]

    def stage_parts(self, stage: int) -> tuple[str, ...]:
        end = self.starts[stage + 1] if stage + 1 < len(self.starts) else len(self.parts)
        return self.parts[self.starts[stage]:end]

    def describe(self) -> str:
        return "; ".join(f"stage {s}: {self.stage_parts(s)[0]} .. {self.stage_parts(s)[-1]}"
                         for s in range(len(self.starts)))


def plan_split(model: nn.Module, stages: int, split_at: tuple[str, ...] = ()) -> Split:
    """Where each stage begins: at the parts `split_at` names, else balanced by parameter count (the stage holding
    the most parameters as small as can be, every stage holding some). Refused on one line: a name the model has
    not as a part, names out of order, more stages than parts holding parameters."""
    parts = model_parts(model)
    names = [n for n, _ in parts]
    own = [n for n, _ in model.named_parameters(recurse=False)] + [n for n, _ in model.named_buffers(recurse=False)]
    if own:
        raise UserError(f"--strategy pipeline: the model holds parameters of its own outside its blocks "
                        f"({', '.join(own[:3])}), used between them by its forward; put them inside a module")
    if split_at:
        missing = [n for n in split_at if n not in names]
        if missing:
            shown = ", ".join(names[:12]) + (f" ... ({len(names)} parts)" if len(names) > 12 else "")
            raise UserError(f"--split-at {missing[0]}: the model has no such part; its parts in order: {shown}")
        starts = [names.index(n) for n in split_at]
        if starts != sorted(set(starts)) or starts[0] == 0:
            raise UserError(f"--split-at {','.join(split_at)}: give the parts in the model's order, none of them "
                            f"its first ({names[0]})")
        return Split(tuple(names), (0, *starts))
    sizes = [_count(m) for _, m in parts]
    holding = sum(1 for s in sizes if s)
    if holding < stages:
        raise UserError(f"--stages {stages}: the model has {holding} part(s) holding parameters "
                        f"({', '.join(n for (n, _), s in zip(parts, sizes) if s)}), fewer than the stages")
    return Split(tuple(names), tuple(_balanced(sizes, stages)))


def _balanced(sizes: list[int], stages: int) -> list[int]:
    """The starts of `stages` runs of `sizes` whose largest sum is smallest, each run holding a non-zero size
    (a linear partition solved exactly; a part without parameters joins the run before it)."""
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    # best[k][i]: the smallest largest sum of the first i parts in k runs; cut[k][i]: where the last run begins
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(1, n + 1):
            for j in range(k - 1, i):
                run = prefix[i] - prefix[j]
                if run == 0 or sizes[j] == 0 and j > 0:  # a run must hold parameters and begin with a part that does
                    continue
                value = max(best[k - 1][j], run)
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    starts, i = [], n
    for k in range(stages, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return sorted(starts)


def check_chain(model: nn.Module, split: Split, x: Any) -> None:
    """Run `x` (a batch of the training data) through the whole model on the meta device (shapes only: no
    computation, no memory, whatever the model's size; a model with real weights is run with meta stand-ins for
    them, and on the batch itself when its forward reads values), in evaluation mode, and refuse on one line any
    place where its forward is not its parts one after another: each part called once, in order, with one input
    that is the part before's output, the model's output being the last part's. Nothing of the model changes (its
    mode is restored)."""
    from torch.func import functional_call

    modules = dict(model.named_modules())
    called: list[str] = []
    previous: list[Any] = []  # the last part's output and its name: nothing more is kept
    broken: list[str] = []

    def seen(name: str, args: tuple, out: Any) -> None:
        if not broken and (len(args) != 1 or args[0] is not previous[0]):
            broken.append(f"--strategy pipeline: {name} is not given {previous[1]}'s output alone (a skip "
                          f"connection, a second input, or a function applied between them in the forward); "
                          f"the model cannot be cut there: put that step inside a module")
        called.append(name)
        previous[:] = [out, name]

    hooks = [modules[name].register_forward_hook(lambda m, args, out, name=name: seen(name, args, out))
             for name in split.parts]
    meta: dict[int, torch.Tensor] = {}  # one stand-in per tensor: tied weights stay one
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    stand_ins = {k: meta.setdefault(id(v), torch.empty_like(v, device="meta")) for k, v in tensors}
    real = not any(v.is_meta for _, v in tensors)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            try:
                previous[:] = [x.to("meta"), "the model's input"]
                out = functional_call(model, stand_ins, (previous[0],), tie_weights=True, strict=False)
            except (NotImplementedError, RuntimeError) as e:
                if not real:  # a model built on the meta device has nothing else to run on
                    raise UserError(f"--strategy pipeline: the model's forward cannot run on the meta device, where "
                                    f"its cut is checked without computing ({str(e).splitlines()[0][:160]})") from None
                called.clear()  # a forward that reads values (.item(), a branch on them): run on the real batch
                broken.clear()
                previous[:] = [x, "the model's input"]
                out = model(x)
    finally:
        model.train(was_training)
        for h in hooks:
            h.remove()
    if called != list(split.parts):
        first = next((i for i, (a, b) in enumerate(zip(called, split.parts)) if a != b), min(len(called),
                                                                                              len(split.parts)))
        expected = split.parts[first] if first < len(split.parts) else "nothing more"
        got = called[first] if first < len(called) else "nothing more"
        raise UserError(f"--strategy pipeline: the model's forward does not run its parts in order: after "
                        f"{split.parts[first - 1] if first else 'its input'} it called {got}, not {expected}; a "
                        f"model trained as stages runs its children one after another (as nn.Sequential does)")
    if broken:
        raise UserError(broken[0])
    if out is not previous[0]:
        raise UserError(f"--strategy pipeline: the model's output is not {previous[1]}'s (its forward does more "
                        f"after its last part); put that step inside a module")


def stage_model(model: nn.Module, split: Split, stages: list[int]) -> nn.Module:
    """`model` left holding only the parts of `stages` (one stage, or a process's several under an interleaved
    schedule): every other part replaced in place by an empty nn.Identity, so each parameter keeps its name
    (`layer3.0.conv1.weight` stays that), and a child holding none of them removed."""
    kept = {p for s in stages for p in split.stage_parts(s)}
    modules = dict(model.named_modules())
    for name in split.parts:
        if name not in kept:
            parent, _, leaf = name.rpartition(".")
            modules[parent]._modules[leaf] = nn.Identity()
    for name, _ in list(model.named_children()):
        if not any(p == name or p.startswith(name + ".") for p in kept):
            del model._modules[name]
    model.__dict__[CUT] = f"{split.stage_parts(stages[0])[0]} .. {split.stage_parts(stages[-1])[-1]}"
    return model


CUT = "_scaletrain_pipeline_stage"  # set on a model cut down to its stage: the parts it still holds


class StageForward(nn.Module):
    """A stage's forward: its parts one after another. Its state dict's names are the whole model's (the model is
    held under no name of its own: `named_parameters` gives `layer3.0.conv1.weight`)."""

    def __init__(self, model: nn.Module, parts: tuple[str, ...]):
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        self.parts = parts
        modules = dict(self.named_modules())
        object.__setattr__(self, "_run", [modules[name] for name in parts])  # not registered a second time

    def forward(self, x):
        for part in self._run:
            x = part(x)
        return x
