"""A model cut into pipeline stages: its ordered parts, where the cuts fall, the check that its forward is the
sequence of those parts, and each stage's model with the other stages' parts taken out (names unchanged).

A part is a child of the model, an nn.Sequential or nn.ModuleList child opened into its elements (again and
again): `layer1.0`, `blocks.3`, `head`. The model's forward must run its parts one after another, each taking
the one before's output, as nn.Sequential does; `check_chain` runs one batch through the whole model on the meta
device (shapes only) and refuses, naming the place, anything else (a skip connection across a cut, `x.flatten(1)`
between two parts, a part called twice or with two inputs).

A model whose forward does more between its children has its parts written out (`_timm_vit_parts`): timm's vision
transformers, whose first part embeds the patches and adds the class token and the position embedding (the
model's own tensors, held by the stage that uses them) and whose last pools the tokens and classifies them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..errors import UserError


@dataclass(frozen=True)
class Part:
    """One part of a model cut into stages: its name (its module's, or its first module's), the modules it holds
    (by name), the model's own tensors it holds (a ViT's cls_token), and how it runs, `run(model, x)` (None: its
    module called on the part before's output)."""

    name: str
    modules: tuple[str, ...]
    tensors: tuple[str, ...] = ()
    run: Callable[[nn.Module, Any], Any] | None = None


def model_parts(model: nn.Module) -> list[Part]:
    """The model's parts in order (see the module's doc)."""
    written = _timm_vit_parts(model)
    if written is not None:
        return written

    def opened(prefix: str, module: nn.Module) -> list[str]:
        if isinstance(module, (nn.Sequential, nn.ModuleList)) and len(module):
            return [p for name, child in module.named_children() for p in opened(f"{prefix}{name}.", child)]
        return [prefix[:-1]]

    return [Part(n, (n,)) for name, child in model.named_children() for n in opened(f"{name}.", child)]


def _timm_vit_parts(model: nn.Module) -> list[Part] | None:
    """timm's VisionTransformer as parts, where its forward is timm's own: the patch embedding with the class token,
    the position embedding and the norm before the blocks; each block; the norm, the pooling and the head."""
    try:
        from timm.models.vision_transformer import VisionTransformer
    except ImportError:
        return None
    kind = type(model)
    if not isinstance(model, VisionTransformer) or any(getattr(kind, f) is not getattr(VisionTransformer, f) for f in
                                                       ("forward", "forward_features", "forward_head", "_pos_embed")):
        return None
    own = tuple(n for n in ("cls_token", "reg_token", "pos_embed") if getattr(model, n, None) is not None)
    first = Part("patch_embed", ("patch_embed", "pos_drop", "patch_drop", "norm_pre"), own,
                 lambda m, x: m.norm_pre(m.patch_drop(m._pos_embed(m.patch_embed(x)))))
    tail = tuple(n for n in ("norm", "attn_pool", "fc_norm", "head_drop", "head") if getattr(model, n) is not None)
    last = Part("norm", tail, (), lambda m, x: m.forward_head(m.norm(x)))
    return [first, *(Part(f"blocks.{i}", (f"blocks.{i}",)) for i in range(len(model.blocks))), last]


def _count(model: nn.Module, part: Part) -> int:
    modules = dict(model.named_modules())
    return sum(p.numel() for m in part.modules for p in modules[m].parameters()) + \
        sum(getattr(model, t).numel() for t in part.tensors)


@dataclass(frozen=True)
class Split:
    """The parts in order and the index of the first part of each stage (`starts[0]` is 0)."""

    pieces: tuple[Part, ...]
    starts: tuple[int, ...]

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.pieces)

    def stage_parts(self, stage: int) -> tuple[str, ...]:
        end = self.starts[stage + 1] if stage + 1 < len(self.starts) else len(self.parts)
        return self.parts[self.starts[stage]:end]

    def stage_pieces(self, stage: int) -> tuple[Part, ...]:
        return tuple(p for p in self.pieces if p.name in self.stage_parts(stage))

    @property
    def written(self) -> bool:
        """Whether the parts are written out for the model (not its children in order)."""
        return any(p.run is not None for p in self.pieces)

    def describe(self) -> str:
        return "; ".join(f"stage {s}: {self.stage_parts(s)[0]} .. {self.stage_parts(s)[-1]}"
                         for s in range(len(self.starts)))


def plan_split(model: nn.Module, stages: int, split_at: tuple[str, ...] = ()) -> Split:
    """Where each stage begins: at the parts `split_at` names, else balanced by parameter count (the stage holding
    the most parameters as small as can be, every stage holding some). Refused on one line: a name the model has
    not as a part, names out of order, more stages than parts holding parameters."""
    parts = model_parts(model)
    names = [p.name for p in parts]
    held = {t for p in parts for t in p.tensors}
    own = [n for n, _ in [*model.named_parameters(recurse=False), *model.named_buffers(recurse=False)] if n not in held]
    if own:
        raise UserError(f"--strategy pipeline: the model holds parameters of its own outside its blocks "
                        f"({', '.join(own[:3])}), used between them by its forward; put them inside a module")
    if split_at:  # a container's name (layer3) names where its first part (layer3.0) begins
        split_at = tuple(n if n in names else next((p for p in names if p.startswith(n + ".")), n) for n in split_at)
        missing = [n for n in split_at if n not in names]
        if missing:
            shown = ", ".join(names[:12]) + (f" ... ({len(names)} parts)" if len(names) > 12 else "")
            raise UserError(f"--split-at {missing[0]}: the model has no such part; its parts in order: {shown}")
        starts = [names.index(n) for n in split_at]
        if starts != sorted(set(starts)) or starts[0] == 0:
            raise UserError(f"--split-at {','.join(split_at)}: give the parts in the model's order, none of them "
                            f"its first ({names[0]})")
        return Split(tuple(parts), (0, *starts))
    sizes = [_count(model, p) for p in parts]
    holding = sum(1 for s in sizes if s)
    if holding < stages:
        raise UserError(f"--stages {stages}: the model has {holding} part(s) holding parameters "
                        f"({', '.join(p.name for p, s in zip(parts, sizes) if s)}), fewer than the stages")
    return Split(tuple(parts), tuple(_balanced(sizes, stages)))


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

    if split.written:
        return _check_written(model, split, x)
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


def _check_written(model: nn.Module, split: Split, x: Any) -> None:
    """A model whose parts are written out: its parts run in order give what its forward gives (shapes, on the meta
    device)."""
    from torch.nn.utils.stateless import _reparametrize_module

    tensors = {k: torch.empty_like(v, device="meta") for k, v in [*model.named_parameters(), *model.named_buffers()]}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), _reparametrize_module(model, tensors, strict=False):
            whole = out = x.to("meta")
            whole = model(whole)
            for run in runs(model, split.pieces):
                out = run(out)
    finally:
        model.train(was_training)
    if tuple(out.shape) != tuple(whole.shape):
        raise UserError(f"--strategy pipeline: the model's parts run in order give {tuple(out.shape)}, its forward "
                        f"{tuple(whole.shape)}; give the model a forward that runs its parts in order")


def stage_model(model: nn.Module, split: Split, stages: list[int]) -> nn.Module:
    """`model` left holding only the parts of `stages` (one stage, or a process's several under an interleaved
    schedule): every other part's modules replaced in place by an empty nn.Identity, so each parameter keeps its
    name (`layer3.0.conv1.weight` stays that), the model's own tensors of other parts taken out, and a child
    holding none of them removed."""
    pieces = [p for s in stages for p in split.stage_pieces(s)]
    kept = {m for p in pieces for m in p.modules}
    modules = dict(model.named_modules())
    for part in split.pieces:
        for name in part.modules:
            if name not in kept:
                parent, _, leaf = name.rpartition(".")
                modules[parent]._modules[leaf] = nn.Identity()
        for name in part.tensors if part not in pieces else ():
            (model._parameters if name in model._parameters else model._buffers).pop(name)
    for name, _ in list(model.named_children()):
        if not any(p == name or p.startswith(name + ".") for p in kept):
            del model._modules[name]
    model.__dict__[CUT] = f"{split.stage_parts(stages[0])[0]} .. {split.stage_parts(stages[-1])[-1]}"
    return model


CUT = "_scaletrain_pipeline_stage"  # set on a model cut down to its stage: the parts it still holds


def runs(model: nn.Module, pieces: tuple[Part, ...]) -> list[Callable[[Any], Any]]:
    """Each part of `pieces` as a function of its input, on `model` (cut to its stage or not)."""
    modules = dict(model.named_modules())
    return [modules[p.name] if p.run is None else functools.partial(p.run, model) for p in pieces]


class StageForward(nn.Module):
    """A stage's forward: its parts one after another. Its state dict's names are the whole model's (the model is
    held under no name of its own: `named_parameters` gives `layer3.0.conv1.weight`; the model's own tensors that
    the stage holds are its own)."""

    def __init__(self, model: nn.Module, pieces: tuple[Part, ...]):
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        object.__setattr__(self, "model", model)  # the cut model, its own tensors' owner (not registered again)
        self.refresh()
        self.parts = tuple(p.name for p in pieces)
        object.__setattr__(self, "_run", runs(model, pieces))

    def refresh(self) -> None:
        """The model's own tensors held again as they are now (materialised, their buffers replaced)."""
        for name, t in [*self.model.named_parameters(recurse=False), *self.model.named_buffers(recurse=False)]:
            (self.register_parameter if isinstance(t, nn.Parameter) else self.register_buffer)(name, t)

    def forward(self, x):
        for part in self._run:
            x = part(x)
        return x
