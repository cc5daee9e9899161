"""torch.compile as training uses it (--compile): the model's repeated blocks compiled in place, each kind once
(regional compilation: a transformer's or a ResNet stage's blocks share one compiled graph, so the first step waits
for one block's compile, not the whole model's), or the whole model where it has no repeated blocks
(--compile-scope whole to ask for it). A batch of another size than the one compiled (an epoch's last) runs
eagerly rather than compiling the model again: the same samples, the same arithmetic up to the compiler's rounding.
Validation runs eagerly too (the trained weights are evaluated as they are)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The outermost runs of blocks: children of a container (Sequential, ModuleList) of which at least two are of
    one class that is not torch's own (a timm Block, a ResNet Bottleneck, a user's layer), holding parameters."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        children = list(module.children())
        if isinstance(module, (nn.Sequential, nn.ModuleList)):
            kinds: dict[type, int] = {}
            for child in children:
                kinds[type(child)] = kinds.get(type(child), 0) + 1
            blocks = [c for c in children if kinds[type(c)] >= 2 and not type(c).__module__.startswith("torch.")
                      and any(True for _ in c.parameters())]
            if blocks:
                found.extend(blocks)
                children = [c for c in children if c not in blocks]
        for child in children:
            visit(child)
    visit(model)
    return found


def compile_for_training(model: nn.Module, plain: nn.Module, scope: str) -> tuple[nn.Module, str]:
    """(the module training runs, what was compiled, in words): `plain`'s repeated blocks compiled in place with
    scope "blocks" where it has some (the training module, which holds them, is returned as it is), else the whole
    training module wrapped by torch.compile."""
    blocks = repeated_blocks(plain) if scope == "blocks" else []
    if not blocks:
        return torch.compile(model), "the whole model"
    for block in blocks:
        block.compile()
    kinds = sorted({type(b).__name__ for b in blocks})
    return model, f"its {len(blocks)} repeated blocks ({', '.join(kinds)}) one by one"


def eager_unless(compiled_batch: int | None, x: Any = None):
    """A context running compiled code eagerly, unless the batch `x` is of the compiled size `compiled_batch`
    (None: nothing compiled, nothing changed; x None: always eagerly, for validation)."""
    if compiled_batch is None or (x is not None and len(x) == compiled_batch):
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")
