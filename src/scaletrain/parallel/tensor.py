"""--tp N: tensor parallelism, each layer of a plan split over N processes on torch's DTensor (parallelize_module's
ColwiseParallel, RowwiseParallel, SequenceParallel), along the "tp" dimension of the job's mesh (layout.py), with
ddp or fsdp over the other processes and inside pipeline stages: parallelize.py applies the plan in its fixed
order (within a stage, the part of the whole model's plan that the stage holds).

A plan says how each layer is split:

- colwise: a Linear's output features (an Embedding's dimensions) split; the next layer reads its part;
- rowwise: a Linear's input features (an Embedding's rows) split; its outputs summed over the processes;
- sequence: a module between replicated layers (a norm, a dropout) computed on each process's share of the
  sequence (dimension 1), its output gathered again (SequenceParallel);
- heads (built in): timm's fused q, k, v projection split by heads (heads.py).

Plans come from, in this order: the model's `tp_plan` attribute (a user's, {module name: style}, `*` matching any
one name), timm's vision transformers (each `timm.layers.Attention` split by heads, each `Mlp` colwise then
rowwise), or a Transformers model's own `_tp_plan`. A model with none, a style this does not know, a name the model
lacks, a layer or a head count the processes cannot share: refused on one line before anything trains.

Every tensor-parallel process of a data-parallel replica reads the same batches and holds the same outputs (the
first counts them); its random draws (dropout) are those of the replica's seed, so that the activations they
share stay the same on each. The model is built on the meta device and each process materialises only its part,
filled from the whole model's values at the seed (the replayed constructor, each tensor from the process that owns
it) or from --init-from's file.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import UserError
from .heads import HeadsLinear
from .parts import split_by_heads

STYLES = ("colwise", "rowwise", "sequence")
TRANSFORMERS_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "colwise_rep": "colwise_rep",
                       "colwise_gather_output": "colwise_rep", "embedding_rowwise": "embedding_rowwise",
                       "sequence_parallel": "sequence"}  # Transformers' names of the styles run here


@dataclass(frozen=True)
class Plan:
    """How a model is split: module name -> style (STYLES, "colwise_rep": colwise with its output gathered, "heads":
    a fused q, k, v), and the attention modules whose head counts each process divides by N (name -> attributes)."""

    styles: dict[str, str]
    divided: dict[str, tuple[str, ...]]
    source: str
    note: str = ""  # said at start-up beside the plan

    def within(self, part: nn.Module) -> "Plan":
        """The plan for the modules `part` (a pipeline stage: the model cut down to it) still holds."""
        names = {n for n, _ in part.named_modules()}
        return Plan({n: style for n, style in self.styles.items() if n in names},
                    {n: attrs for n, attrs in self.divided.items() if n == "" or n in names}, self.source, self.note)

    def describe(self) -> str:
        counts: dict[str, int] = {}
        for style in self.styles.values():
            counts[style] = counts.get(style, 0) + 1
        said = {"heads": "q, k, v split by heads", "colwise_rep": "colwise, gathered",
                "embedding_rowwise": "embedding rowwise"}
        return f"{self.source}, {len(self.styles)} layers: " + ", ".join(
            f"{n} {said.get(style, style)}" for style, n in counts.items())


def plan_for(model: nn.Module, tp: int) -> Plan:
    """The plan that splits `model` over `tp` processes, checked against it (see the module's doc)."""
    given = model.__dict__.get("tp_plan", getattr(type(model), "tp_plan", None))
    if given is not None and not isinstance(given, property):  # (Transformers' tp_plan is a property: its own)
        plan = _users_plan(model, given, "the model's tp_plan")
    else:
        plan = _timm_plan(model) or _transformers_plan(model)
    if plan is None:
        raise UserError(f"--tp {tp}: no tensor-parallel plan for {type(model).__name__}: scaletrain splits timm's "
                        f"vision transformers (ViT, DeiT) and Transformers models by their own _tp_plan; give your "
                        f"model a tp_plan attribute, {{module name: \"colwise\" | \"rowwise\" | \"sequence\"}} "
                        f"(docs/parallel.md)")
    _check(model, plan, tp)
    return plan


def _users_plan(model: nn.Module, given: Any, where: str) -> Plan:
    if not isinstance(given, dict) or not given:
        raise UserError(f"{where}: expected a non-empty dict {{module name: \"colwise\" | \"rowwise\" | "
                        f"\"sequence\"}}, got {type(given).__name__}")
    styles = {}
    names = [n for n, _ in model.named_modules() if n]
    for pattern, style in given.items():
        if style not in STYLES:
            raise UserError(f"{where}: {pattern}: style {style!r}; expected one of {', '.join(STYLES)}")
        matched = _matching(names, pattern)
        if not matched:
            raise UserError(f"{where} names {pattern}, which the model lacks (its modules include "
                            f"{', '.join(names[:6])}{', ...' if len(names) > 6 else ''})")
        styles.update(dict.fromkeys(matched, style))
    return Plan(styles, {}, where)


def _matching(names: list[str], pattern: str) -> list[str]:
    """The module names `pattern` names, `*` standing for any one name (as Transformers' plans write layers.*)."""
    if "*" not in pattern:
        return [pattern] if pattern in names else []
    parts = pattern.split(".")
    return [n for n in names if len(n.split(".")) == len(parts) and
            all(fnmatch.fnmatchcase(a, b) for a, b in zip(n.split("."), parts))]


def _timm_plan(model: nn.Module) -> Plan | None:
    """timm's vision transformers: each Attention's fused q, k, v split by heads and its projection rowwise, each
    Mlp's fc1 colwise and fc2 rowwise; None when the model has no timm Attention."""
    styles, divided, dropped = {}, {}, []
    for name, m in model.named_modules():
        kind = f"{type(m).__module__}.{type(m).__name__}"
        inner = {"timm.layers.attention.Attention": "attn_drop", "timm.layers.mlp.Mlp": "drop1"}.get(kind)
        if inner and getattr(m, inner).p > 0:
            dropped.append(f"{name}.{inner}")
        if kind == "timm.layers.attention.Attention":
            if not isinstance(m.norm, nn.Identity) or getattr(m, "gate", None) is not None:
                raise UserError(f"--tp: {name} is a timm Attention with a norm or a gate over all its heads, which "
                                f"the built-in plan does not split; give the model a tp_plan")
            styles[f"{name}.qkv"], styles[f"{name}.proj"] = "heads", "rowwise"
            divided[name] = ("num_heads", "attn_dim")
        elif kind == "timm.layers.mlp.Mlp" and isinstance(m.norm, nn.Identity):
            styles[f"{name}.fc1"], styles[f"{name}.fc2"] = "colwise", "rowwise"
    note = f"; {dropped[0]} and {len(dropped) - 1} more draw one dropout mask for every process's part of " \
        f"their split layer (the unsplit model draws one for the whole)" if dropped else ""
    return Plan(styles, divided, "timm's vision transformer plan", note) if divided else None


def _transformers_plan(model: nn.Module) -> Plan | None:
    """A Transformers model's own plan (`_tp_plan`: its layers by pattern, `layers.*.self_attn.q_proj`), its
    attention head counts divided through the config; None without one."""
    found = getattr(model, "_tp_plan", None)
    config = getattr(model, "config", None)
    if not found:
        return None
    styles = {}
    names = [n for n, _ in model.named_modules() if n]
    for pattern, style in found.items():
        if style not in TRANSFORMERS_STYLES:
            raise UserError(f"--tp: the model's _tp_plan splits {pattern} as {style!r}, a style scaletrain does not "
                            f"run (it runs {', '.join(TRANSFORMERS_STYLES)}); give the model a tp_plan of its own")
        styles.update(dict.fromkeys(_matching(names, pattern), TRANSFORMERS_STYLES[style]))
    heads = {a: getattr(config, a) for a in ("num_attention_heads", "num_key_value_heads")
             if isinstance(getattr(config, a, None), int)}
    return Plan(styles, {"": tuple(heads)}, "the Transformers model's _tp_plan") if styles else None


def _check(model: nn.Module, plan: Plan, tp: int) -> None:
    """Refuse a layer or a head count that `tp` processes cannot share, a style on a layer it cannot split, and a
    split of a tensor tied to another module's (splitting one would untie them)."""
    modules = dict(model.named_modules())
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for name, style in plan.styles.items():
        for leaf, p in modules[name].named_parameters(recurse=False):
            if style != "sequence" and len(names[id(p)]) > 1:
                other = next(n for n in names[id(p)] if n != f"{name}.{leaf}")
                raise UserError(f"--tp {tp}: {name}.{leaf} and {other} are one tensor (tied weights), which "
                                f"splitting {name} would untie; untie them (Transformers: tie_word_embeddings=False) "
                                f"or leave {name} out of the plan")
    for name, attrs in plan.divided.items():
        owner = getattr(model, "config", None) if name == "" else modules[name]
        for attr in attrs:
            heads = getattr(owner, attr)
            if attr.endswith("heads") and heads % tp:
                said = {"num_heads": "heads", "num_attention_heads": "attention heads",
                        "num_key_value_heads": "key and value heads"}[attr]
                raise UserError(f"--tp {tp}: {name or type(model).__name__} has {heads} {said}, which {tp} "
                                f"processes cannot share; give a --tp that divides {heads}")
    for name, style in plan.styles.items():
        m = modules[name]
        if style in ("sequence", "heads"):  # a module between split layers; timm's q, k, v (heads checked above)
            continue
        if isinstance(m, nn.Linear):
            size, what = (m.out_features, "output features") if "rowwise" not in style else (m.in_features,
                                                                                             "input features")
        elif isinstance(m, nn.Embedding):
            size, what = (m.embedding_dim, "dimensions") if "rowwise" not in style else (m.num_embeddings, "rows")
        else:
            raise UserError(f"--tp: {name} is a {type(m).__name__}; {style} splits a Linear or an Embedding")
        if size % tp:
            raise UserError(f"--tp {tp}: {name} has {size} {what}, which {tp} processes cannot share ({style})")


def apply(model: nn.Module, plan: Plan, mesh) -> None:
    """Split `model`'s layers over `mesh` (the tensor-parallel processes) as `plan` says: on the meta device (each
    process then materialises its part) or on real tensors (each process's part of process 0's)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)

    _divide_heads(model, plan, mesh.size())
    modules = dict(model.named_modules())
    styles = {}
    for name, style in plan.styles.items():
        if style == "heads":
            parent, _, leaf = name.rpartition(".")
            setattr(modules[parent], leaf, HeadsLinear(modules[name], mesh))
        elif style == "sequence":  # from the replicated input to a share of the sequence, and back
            parallelize_module(modules[name], mesh, PrepareModuleInput(input_layouts=Replicate(),
                                                                       desired_input_layouts=Shard(1)))
            parallelize_module(modules[name], mesh, SequenceParallel())
            parallelize_module(modules[name], mesh, PrepareModuleOutput(output_layouts=Shard(1),
                                                                        desired_output_layouts=Replicate()))
        else:
            styles[name] = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel(),
                            "colwise_rep": ColwiseParallel(output_layouts=Replicate()),
                            "embedding_rowwise": RowwiseParallel(input_layouts=Replicate())}[style]
    if styles:
        parallelize_module(model, mesh, styles)


def _divide_heads(model: nn.Module, plan: Plan, n: int) -> None:
    """Each attention module's head counts divided by `n`, its processes' share (a Transformers model's, counted
    in its config, are left: it reshapes by head size)."""
    modules = dict(model.named_modules())
    for name, attrs in plan.divided.items():
        for attr in attrs if name else ():
            setattr(modules[name], attr, getattr(modules[name], attr) // n)


def one_process(model: nn.Module, tp: int) -> nn.Module:
    """`model` (whole, not yet split) changed in place into a plain model that holds and computes what one of `tp`
    processes does: each split Linear cut to its part (a colwise one's outputs, a rowwise one's inputs, q, k and v
    to its heads) and the head counts divided; for estimating a process's memory without starting any."""
    plan = plan_for(model, tp)
    _divide_heads(model, plan, tp)
    modules = dict(model.named_modules())
    for name, style in plan.styles.items():
        m = modules[name]
        if not isinstance(m, nn.Linear) or style == "sequence":
            continue
        rowwise, heads = "rowwise" in style, style == "heads"
        part = nn.Linear(m.in_features // tp if rowwise else m.in_features,
                         m.out_features if rowwise else m.out_features // tp, bias=m.bias is not None and not heads)
        if heads and m.bias is not None:  # HeadsLinear keeps its bias whole (unused here: counted, not computed)
            part.whole_bias = nn.Parameter(torch.empty(m.out_features))
        parent, _, leaf = name.rpartition(".")
        setattr(modules[parent] if parent else model, leaf, part)
    return model


def heads_by_columns(parameter: nn.Parameter):
    """fsdp over a weight split by heads shards its columns (its rows are split by heads already)."""
    from torch.distributed.tensor import Shard

    return Shard(1) if parameter.ndim == 2 and split_by_heads(parameter) else None
