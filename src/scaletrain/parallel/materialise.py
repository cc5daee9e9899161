"""A model built on the meta device and materialised part by part, so that no process ever holds it whole.

`build_on_meta(factory)` builds the model on the meta device (shapes, no memory) and records the order in which
its constructor registers parameters and buffers (its `Blueprint`). A process then materialises only its part
(a pipeline stage's modules, an fsdp shard) and fills it from one of two sources, tensor by tensor:

- `Replayed`: the constructor run again, for real, on the CPU, from the random state the blueprint started from.
  Every tensor the process does not keep is created in one scratch buffer as large as the largest of them, so
  every random draw, and so every kept tensor's value, is what the whole model built at that seed holds, bit for
  bit, whatever the model's own init does; the process holds its tensors and the scratch buffer, not the model.
- `WeightsFile`: a whole-model weights file (`--init-from`, as `safetensors.torch.save_file(model.state_dict())`
  writes it), each tensor, or each shard's rows, read on its own (safetensors' `get_slice`).

`fill` copies from a source into the materialised part: whole tensors of a stage, the rows of an fsdp shard, a
tensor-parallel process's part of each tensor.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..errors import UserError, describe
from .parts import cut_from_whole, part_of, read_part

BLUEPRINT = "_scaletrain_blueprint"  # set on a model built on the meta device: its Blueprint


@dataclass(frozen=True)
class Registration:
    """One tensor the constructor registered: its names in the finished model's state (none: replaced or
    dropped before the constructor returned), shape and dtype."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype | None


@dataclass(frozen=True)
class Blueprint:
    """How to build the model again: the factory, the tensors its constructor registers in order, and the random
    state it started from."""

    factory: Callable[[], nn.Module]
    registrations: tuple[Registration, ...]
    rng: tuple

    @staticmethod
    def of(model: nn.Module) -> "Blueprint | None":
        return model.__dict__.get(BLUEPRINT)


def on_meta(model: nn.Module) -> bool:
    """Whether `model` was built on the meta device and is still there (not yet materialised)."""
    return Blueprint.of(model) is not None and any(t.is_meta for t in _tensors(model))


def _tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()


@contextlib.contextmanager
def _registrations(hook: Callable[[nn.Module, str, torch.Tensor | None], torch.Tensor | None]):
    """`hook(module, name, tensor)` on every parameter and buffer any module registers (what it returns replaces
    the tensor)."""
    from torch.nn.modules import module as torch_module

    handles = [torch_module.register_module_parameter_registration_hook(hook),
               torch_module.register_module_buffer_registration_hook(hook)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _rng_state() -> tuple:
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def _set_rng(state: tuple) -> None:
    torch.set_rng_state(state[0])
    np.random.set_state(state[1])
    random.setstate(state[2])


def checked_module(model, where: str = "model") -> nn.Module:
    """What a model function returned, refused on one line unless it is a torch.nn.Module."""
    if not isinstance(model, nn.Module):
        raise UserError(f"{where}: the function returned {describe(model)}; expected a torch.nn.Module")
    return model


def build_on_meta(factory: Callable[[], nn.Module], where: str = "model") -> nn.Module:
    """`factory()` built on the meta device, its Blueprint attached (see the module's doc)."""
    rng = _rng_state()
    events: list[tuple[nn.Module, str, torch.Tensor | None]] = []

    def record(module, name, value):
        events.append((module, name, value))  # holds the (meta, free) objects: their ids stay theirs

    with _registrations(record), torch.device("meta"):
        model = checked_module(factory(), where)
    names: dict[int, list[str]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is not None:
                names.setdefault(id(t), []).append(f"{prefix}.{name}" if prefix else name)
    registrations = []
    for module, name, value in events:
        final = value is not None and (module._parameters.get(name) is value or module._buffers.get(name) is value)
        registrations.append(Registration(tuple(names.get(id(value), ())) if final else (),
                                          tuple(value.shape) if value is not None else (),
                                          value.dtype if value is not None else None))
    model.__dict__[BLUEPRINT] = Blueprint(factory, tuple(registrations), rng)
    return model


class Replayed:
    """The whole model's initial tensors that `keep(name)` wants, made by running its constructor again from the
    blueprint's random state (see the module's doc); `get(name)` gives one."""

    def __init__(self, blueprint: Blueprint, keep: Callable[[str], bool]):
        regs = blueprint.registrations
        kept = [bool(r.names) and any(keep(n) for n in r.names) for r in regs]
        largest = max((_nbytes(r) for r, k in zip(regs, kept) if not k and r.dtype is not None), default=0)
        scratch = torch.UntypedStorage(largest)
        count = 0

        def replace(module, name, value):
            nonlocal count
            if count >= len(regs) or (value is not None and (tuple(value.shape), value.dtype) !=
                                      (regs[count].shape, regs[count].dtype)):
                raise UserError(f"model: its constructor registered {name} where the meta-device build registered "
                                f"another tensor; a model built part by part must be built the same way each time "
                                f"(or give --init-from)")
            keep_it, count = kept[count], count + 1
            if value is None or keep_it or (largest and value.untyped_storage().data_ptr() == scratch.data_ptr()):
                return None  # kept, or already in the scratch buffer (a tied tensor registered again)
            t = torch.empty(0, dtype=value.dtype).set_(scratch, 0, value.shape)
            return nn.Parameter(t, requires_grad=value.requires_grad) if isinstance(value, nn.Parameter) else t

        before = _rng_state()
        _set_rng(blueprint.rng)
        taint = _Taint(scratch.data_ptr() if largest else None)
        try:
            with _registrations(replace), taint:
                model = blueprint.factory()
        finally:
            _set_rng(before)
        self.state = {**dict(model.named_parameters(remove_duplicate=False)),
                      **dict(model.named_buffers(remove_duplicate=False))}
        self._scratch = scratch
        read_others = [n for n, t in self.state.items() if self.has(n) and taint.holds(t)]
        if read_others:
            raise UserError(f"model: its constructor computes {read_others[0]} from the values of tensors this "
                            f"process does not hold (another stage's or shard's), so its part cannot be built on "
                            f"its own; give --init-from a whole model's weights (--save-initial-weights on one "
                            f"process writes them)")

    def get(self, name: str) -> torch.Tensor:
        if not self.has(name):
            raise KeyError(f"{name} was not kept")
        return self.state[name].detach()

    def has(self, name: str) -> bool:
        t = self.state.get(name)
        return t is not None and not (self._scratch.nbytes() and
                                      t.untyped_storage().data_ptr() == self._scratch.data_ptr())

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.get(name)[start:stop]


class _Taint(TorchDispatchMode):
    """Which storages hold values computed from the scratch buffer's (a tensor this process does not keep), followed
    through every op the constructor runs: a kept tensor among them would hold wrong values."""

    def __init__(self, scratch: int | None):
        super().__init__()
        self.tainted = {scratch} if scratch else set()

    def holds(self, t: torch.Tensor) -> bool:
        return _storage(t) in self.tainted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        written = []
        for i, a in enumerate(func._schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(a.name)
            if a.alias_info is not None and a.alias_info.is_write and isinstance(value, torch.Tensor):
                written.append(value)
        read = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and
                not any(t is w for w in written)]
        dirty = any(_storage(t) in self.tainted for t in read)
        for t in written:
            if dirty:
                self.tainted.add(_storage(t))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not any(t is w for w in written):
                (self.tainted.add if dirty else self.tainted.discard)(_storage(t))
        return out


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.device.type != "meta" else 0


def _nbytes(r: Registration) -> int:
    return int(np.prod(r.shape, dtype=np.int64)) * torch.empty((), dtype=r.dtype).element_size()


class WeightsFile:
    """A whole model's weights in one safetensors file, read tensor by tensor (`get`) or rows of one (`rows`);
    tensors the file lacks that the model does not save (non-persistent buffers) come from `rest`."""

    def __init__(self, path: str | Path, flag: str = "--init-from", rest: Replayed | None = None):
        from safetensors import safe_open

        self.path, self.flag, self.rest = str(path), flag, rest
        if not Path(path).is_file():
            raise UserError(f"{flag} {path}: no such file")
        try:
            self._file = safe_open(self.path, framework="pt", device="cpu")
            self._names = set(self._file.keys())
        except Exception as e:  # safetensors' own errors for a bad header or a short file
            raise UserError(f"{flag} {path}: not a readable safetensors file ({e})") from None

    def check(self, model: nn.Module) -> None:
        """Refuse on one line a file whose names or shapes are not the model's (the whole model's state)."""
        saved = model.state_dict(keep_vars=True)
        missing = [k for k in saved if k not in self._names]
        extra = sorted(self._names - set(saved))
        if missing or extra:
            what = f"lacks {missing[0]}" if missing else f"holds {extra[0]}, which the model has not"
            raise UserError(f"{self.flag} {self.path}: {what} ({len(missing)} missing, {len(extra)} not in the "
                            f"model); it must hold the whole model's state under its names, as "
                            f"safetensors.torch.save_file(model.state_dict()) writes it")
        for k, t in saved.items():
            shape = tuple(self._file.get_slice(k).get_shape())
            if shape != tuple(t.shape):
                raise UserError(f"{self.flag} {self.path}: {k} has shape {shape} in the file, {tuple(t.shape)} in "
                                f"the model")

    def match(self, model: nn.Module) -> list[str]:
        """Keep only the file's tensors whose names and shapes are the model's (as models.load_matching loads a
        --pretrained file); one line per tensor left out, refused on one line when none matches."""
        own = {k: tuple(t.shape) for k, t in model.state_dict(keep_vars=True).items()}
        shapes = {k: tuple(self._file.get_slice(k).get_shape()) for k in self._names}
        matched = {k for k, shape in shapes.items() if own.get(k) == shape}
        if not matched:
            raise UserError(f"{self.flag} {self.path}: none of its {len(shapes)} tensors match the model's names and "
                            f"shapes; is it for another architecture?")
        self._names = matched
        skipped = [f"{k}: shape {shape} in file, {own[k]} in model" for k, shape in shapes.items()
                   if k in own and k not in matched]
        skipped += [f"{k}: not in the model" for k in shapes if k not in own]
        return skipped + [f"{k}: not in the file (kept as initialised)" for k in own if k not in shapes]

    def has(self, name: str) -> bool:
        return name in self._names or (self.rest is not None and self.rest.has(name))

    def get(self, name: str) -> torch.Tensor:
        if name not in self._names and self.rest is not None:
            return self.rest.get(name)
        return self._file.get_tensor(name)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        if name not in self._names and self.rest is not None:
            return self.rest.get(name)[start:stop]
        return self._file.get_slice(name)[start:stop]

    def part(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This process's part of tensor `name` as the DTensor `t` places it, read alone from the file."""
        if name not in self._names and self.rest is not None:
            return part_of(self.rest.get(name), t)
        return read_part(self._file.get_slice(name), t)


def shard_rows(t: torch.Tensor) -> tuple[int, int] | None:
    """The rows [start, stop) of the whole tensor that an fsdp shard (a DTensor sharded on dimension 0 of a
    1-D mesh) holds on this process, as torch.chunk splits them; None for a whole tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return None
    if cut_from_whole(t):
        raise ValueError(f"a DTensor placed {t.placements}: only fsdp's Shard(0) is filled part by part")
    rows, world, rank = t.shape[0], t.device_mesh.size(), t.device_mesh.get_local_rank()
    step = -(-rows // world)
    start = min(rows, rank * step)
    return start, min(rows, start + step)


def state_of(part: nn.Module) -> dict[str, torch.Tensor]:
    """A module's parameters and buffers by name, tied ones under each of their names."""
    return {**dict(part.named_parameters(remove_duplicate=False)),
            **dict(part.named_buffers(remove_duplicate=False))}


@torch.no_grad()
def fill(part: nn.Module, source, every: bool = False) -> None:
    """Copy `part`'s parameters and buffers (materialised, named as in the whole model) that `source` has
    (`has(name)`, `get(name)`, `rows(name, start, stop)`) from it, one tensor at a time; `every`: all of them."""
    for name, t in state_of(part).items():
        if not source.has(name):
            if every:
                raise KeyError(f"{name}: no initial value")
            continue
        if cut_from_whole(t):  # a tensor-parallel split: this process's part, read alone where the source can
            local = t.to_local()
            value = source.part(name, t) if hasattr(source, "part") else part_of(source.get(name), t)
        else:
            rows = shard_rows(t)
            local = t.to_local() if rows is not None else t
            value = source.get(name) if rows is None else source.rows(name, *rows)
        if tuple(value.shape) != tuple(local.shape):
            raise ValueError(f"{name}: {tuple(value.shape)} given for a part of shape {tuple(local.shape)}")
        local.copy_(value)


def completed(initial: WeightsFile | None, blueprint: Blueprint, part: nn.Module):
    """The source of every tensor of `part` (still on the meta device): --init-from's file, and the replayed
    constructor for what it lacks (non-persistent buffers), or the replayed constructor alone."""
    wanted = {n for n in state_of(part) if initial is None or not initial.has(n)}
    replayed = Replayed(blueprint, wanted.__contains__) if wanted else None
    if initial is None:
        return replayed
    initial.rest = replayed
    return initial


def start_from(part: nn.Module, device: torch.device, initial: WeightsFile | None) -> nn.Module:
    """`part` (a whole model, or a stage of one) on `device` with the weights training starts from: a part still
    on the meta device materialised alone and filled from `completed`'s source; a real one moved, and filled from
    the file when there is one."""
    blueprint = Blueprint.of(part)
    if blueprint is None or not on_meta(part):
        part = part.to(device)
        if initial is not None:
            fill(part, initial)
        return part
    source = completed(initial, blueprint, part)
    part = part.to_empty(device=device)
    fill(part, source, every=True)
    return part


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` on the meta device (shapes, no memory): its tensors are not copied."""
    import copy

    memo: dict = {}
    for t in [*model.parameters(), *model.buffers()]:
        stand_in = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(stand_in, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else \
            stand_in
    return copy.deepcopy(model, memo)


class FromObject:
    """A model object's tensors as the source of its copy's parts: each tensor sent whole, one at a time, by the
    process `src` (its object's values) to the others of `group` (None: every process), each keeping its part. A
    collective: every process reads the same tensors in the same order."""

    def __init__(self, model: nn.Module, device: torch.device, group=None, src: int = 0):
        self.state, self.device, self.group, self.src = state_of(model), device, group, src

    def has(self, name: str) -> bool:
        return name in self.state

    def get(self, name: str) -> torch.Tensor:
        import torch.distributed as dist

        t = self.state[name].detach().to(self.device)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            t = t.clone() if dist.get_rank() == self.src else torch.empty_like(t)
            dist.broadcast(t, src=self.src, group=self.group)
        return t

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.get(name)[start:stop]


class Broadcast:
    """fsdp's source without --init-from: each parameter replayed by the one process that owns it (ownership
    balanced by bytes, so each replays about 1/N of the model) and broadcast; every process keeps its rows. The
    buffers, which fsdp keeps whole on every process, are replayed by each. A collective: every process reads the
    same tensors in the same order."""

    def __init__(self, model: nn.Module, blueprint: Blueprint, rank: int, world: int, device: torch.device,
                 group=None, ranks: list[int] | None = None):
        """`rank` of `world` processes of `group` (None: every process; `ranks`: their global ranks)."""
        self.group, self.ranks = group, ranks or list(range(world))
        held = [0] * world
        self.owner: dict[str, int] = {}
        self.shapes = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters(remove_duplicate=False)}
        for name, p in model.named_parameters():
            r = min(range(world), key=held.__getitem__)
            held[r] += p.numel() * p.element_size()
            self.owner[name] = r
        for name, p in model.named_parameters(remove_duplicate=False):  # a tied tensor's other names: its owner
            self.owner.setdefault(name, next(self.owner[n] for n, q in model.named_parameters() if q is p))
        buffers = {n for n, _ in model.named_buffers(remove_duplicate=False)}
        self.rank, self.device = rank, device
        self.replayed = Replayed(blueprint, lambda n: n in buffers or self.owner.get(n) == rank)

    def has(self, name: str) -> bool:
        return name in self.owner or self.replayed.has(name)

    def get(self, name: str) -> torch.Tensor:
        return self.replayed.get(name) if name not in self.owner else self.rows(name, 0, self.shapes[name][0][0])

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        import torch.distributed as dist

        shape, dtype = self.shapes[name]
        src = self.owner[name]
        full = self.replayed.get(name).to(self.device) if src == self.rank else \
            torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(full, src=self.ranks[src], group=self.group)
        return full[start:stop]
