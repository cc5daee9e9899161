"""torch.compile as training uses it (--compile): the model's repeated blocks compiled in place, each kind once
(regional compilation: a transformer's identical blocks share one compiled graph, so the first step waits for one
block's compile, not the whole model's), or the whole model where its repeated blocks hold less than half of it
(--compile-scope whole to ask for it). A batch of another size than the one compiled (an epoch's last) runs
eagerly rather than compiling the model again: the same samples, the same arithmetic up to the compiler's rounding.
Validation runs eagerly too (the trained weights are evaluated as they are)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn


def _shape(module: nn.Module) -> tuple:
    return type(module), tuple(tuple(p.shape) for p in module.parameters())


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The outermost runs of identical blocks: children of a container (Sequential, ModuleList) of which at least
    two are of one class that is not torch's own (a timm Block, a ResNet stage's later blocks, a user's layer) with
    the same parameter shapes, so that they share one compiled graph."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        children = list(module.children())
        if isinstance(module, (nn.Sequential, nn.ModuleList)):
            kinds: dict[tuple, int] = {}
            for child in children:
                kinds[_shape(child)] = kinds.get(_shape(child), 0) + 1
            blocks = [c for c in children if kinds[_shape(c)] >= 2 and not type(c).__module__.startswith("torch.")
                      and any(True for _ in c.parameters())]
            found.extend(blocks)
            children = [c for c in children if not any(c is b for b in blocks)]
        for child in children:
            visit(child)
    visit(model)
    return found


def compile_for_training(model: nn.Module, plain: nn.Module, scope: str) -> tuple[nn.Module, str]:
    """(the module training runs, what was compiled, in words): with scope "blocks", `plain`'s repeated blocks
    compiled in place where they hold most of its parameters (a transformer's; the training module, which holds
    them, is returned as it is: the rest of the model runs eagerly); else the whole training module wrapped by
    torch.compile (a ResNet, whose stages' blocks differ in shape, compiles faster whole: 38 s to its first step
    against 47 s block by block for resnet18 on 2 CPU cores)."""
    blocks = repeated_blocks(plain) if scope == "blocks" else []
    held = sum(p.numel() for b in blocks for p in b.parameters())
    if not blocks or held * 2 < sum(p.numel() for p in plain.parameters()):
        return torch.compile(model), "the whole model" + (" (its repeated blocks hold less than half of it)"
                                                          if blocks else "")
    for block in blocks:
        block.compile()
    kinds = sorted({type(b).__name__ for b in blocks})
    return model, f"its {len(blocks)} repeated blocks ({', '.join(kinds)}; {held:,} of its parameters) one by one"


def eager_unless(compiled_batch: int | None, x: Any = None):
    """A context running compiled code eagerly, unless the batch `x` is of the compiled size `compiled_batch`
    (None: nothing compiled, nothing changed; x None: always eagerly, for validation)."""
    if compiled_batch is None or (x is not None and len(x) == compiled_batch) or \
            not hasattr(torch.compiler, "set_stance"):  # torch before 2.6 compiles such a batch again
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


def compile_seconds() -> float | None:
    """Seconds torch.compile has spent compiling in this process so far, by its own tally (None where this torch
    keeps none)."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        return float(calculate_time_spent()["total_wall_time"])
    except (ImportError, KeyError, TypeError, AttributeError):
        return None
