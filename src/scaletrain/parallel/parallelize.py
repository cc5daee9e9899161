"""One parallelize for every layout, in a fixed order, each step doing nothing at degree 1 (torchtitan's order):

1. stage cut        a pipeline's stage(s) of this process kept, the rest of the model taken out (split.py)
2. tensor parallel  each layer of the plan split over the tp processes (tensor.py; on the whole model's plan)
3. activation       each repeated block's activations recomputed in the backward (blocks.py)
   checkpointing
4. compile          each kind of repeated block compiled in place (regional; blocks.py)
5. fsdp             the blocks, then the root, sharded over the replicas (dp_shard) or, where layers are split,
                    replicated over them (HSDP with shards of one), so that fsdp reduces their gradients
6. materialise      a model built on the meta device materialised part by part on this process's device, each
                    part filled from --init-from's file or the replayed constructor (materialise.py); a model object
                    given whole: every process's part taken from its stage's first process
7. replicate        where every process holds the model whole: DistributedDataParallel (Engine.prepare); a
                    pipeline's replicas average their gradients after a batch's last micro-batch (pipeline.py)

A model given as an object is parallelized as a copy made on the meta device (its tensors are not copied), each
process's part filled from the object's values: the object itself keeps its weights, given the trained ones whole
after fit (`restore_whole`), as on one process.
"""

from __future__ import annotations

import torch
from torch import nn

from .blocks import (apply_activation_checkpointing, block_units, compile_blocks, keeps_fp32_parameters,
                     regional_blocks)
from .materialise import (Blueprint, Broadcast, FromObject, WeightsFile, completed, fill, meta_copy, on_meta,
                          start_from)
from .watch import BEAT

ORIGINAL = "_scaletrain_original"  # set on the module a copy of a model object became: the object itself
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parallelize(model: nn.Module, engine, initial: WeightsFile | None, sync_bn: bool = False,
                activation_checkpointing: bool = False, compile_scope: str = "") -> nn.Module:
    """This process's part of `model` on its device, ready to train or score (see the module's doc): the stage
    module (pipeline.Pipelined) of a pipeline, else the model (a copy of a model object where the layout splits
    it)."""
    from .pipeline import Pipelined, Runner, stage_chunks
    from .split import stage_model
    from .syncbn import convert_sync_bn
    from .tensor import apply, plan_for

    L, device = engine.layout, engine.device
    meta, given = on_meta(model), None
    if not meta and L.splits_model:  # the user's object stays as it is: its copy on the meta device is cut, each
        given, model, meta = model, meta_copy(model), True  # process's part filled from the object's tensors
        model.__dict__[ORIGINAL] = given
    if sync_bn and L.dp > 1:
        model = convert_sync_bn(model, device, engine.replica_group)
    plan = engine.agreed(lambda: plan_for(model, L.tp)) if L.tp > 1 else None  # the whole model's
    engine.fused = [f"{n}.weight" for n, style in plan.styles.items() if style == "heads"] if plan else []
    order = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    regional = regional_blocks(model) if compile_scope == "blocks" else []  # of the whole model (4. compiles them)
    part, stage = model, None
    if L.pp > 1:  # 1. the stage cut
        split, chunks = stage_chunks(model, L)
        part = stage_model(model, split, chunks)
        stage = Pipelined(part, split, chunks, Runner(engine))
    if not meta:  # held whole by every process: moved, filled from --init-from
        part = start_from(part, device, initial)
    if plan is not None:  # 2. tensor parallelism
        apply(part, plan.within(part), engine.mesh("tp"))
    if activation_checkpointing:  # 3.
        engine.runtime.checkpointed_blocks = apply_activation_checkpointing(part)
    roots = [run for _, run in stage.chunks] if stage is not None else [part]
    if compile_scope:  # 4. each repeated block compiled in place, else a stage's chunks (whole: Engine.prepare)
        engine.compiled = compile_blocks(regional, part) if regional else ""
        if not engine.compiled and stage is not None:
            for root in roots:
                root.compile()
            engine.compiled = "each stage's parts, as one graph a stage"
    if engine.fully_shards:  # 5.
        from .tensor import heads_by_columns

        for root in roots:  # fsdp shards contiguous parameters only (channels_last inputs still pick the kernels)
            root.to(memory_format=torch.contiguous_format)
        dims = ("dp_replicate", "dp_shard") if L.dp_replicate > 1 or L.tp > 1 else ("dp_shard",)
        shard_blocks(roots, engine.mesh(*dims), engine.runtime.mixed_precision,
                     placement=heads_by_columns if plan is not None else None)
    if meta:  # 6. materialised part by part
        source = _source(engine, part, initial, given)
        for root in roots:  # (an fsdp root makes its shards: through it)
            root.to_empty(device=device)
        _own_tensors_to_empty(part, device)
        if stage is not None:
            stage.refresh()
        with BEAT.during("collective"):
            fill(part, source, every=True)
    if stage is not None:
        stage.whole_index = [order[name] for name, _ in stage.named_parameters()]
        stage.__dict__[ORIGINAL] = model.__dict__.get(ORIGINAL)
    _say(engine, plan, stage, given is not None)
    return stage if stage is not None else part


def local(t: torch.Tensor) -> torch.Tensor:
    """A tensor as this process holds it (a DTensor's own part)."""
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def broadcast_tensors(module: nn.Module, src: int, group=None) -> None:
    """Every parameter and buffer of `module` (each process's own part of a split one) made `src`'s, over `group`
    (None: every process), as DistributedDataParallel's constructor does: a model built without a seed differs
    per process."""
    with BEAT.during("collective"):
        for t in [*module.parameters(), *module.buffers()]:
            torch.distributed.broadcast(local(t.data), src=src, group=group)


def _own_tensors_to_empty(model: nn.Module, device: torch.device) -> None:
    """The model's own tensors that no part's module holds (a ViT's cls_token, held by a pipeline's first stage),
    materialised: not under any fsdp root or stage chunk."""
    for name, t in list(model._parameters.items()):
        if t is not None and t.is_meta:
            model._parameters[name] = nn.Parameter(torch.empty_like(t, device=device), requires_grad=t.requires_grad)
    for name, t in list(model._buffers.items()):
        if t is not None and t.is_meta:
            model._buffers[name] = torch.empty_like(t, device=device)


def _source(engine, part: nn.Module, initial: WeightsFile | None, given: nn.Module | None):
    """Where a part still on the meta device is filled from: --init-from's file, each process reading its own part;
    a model object's tensors, each sent by its stage's first process (so every process starts from the same
    values, as DDP's constructor makes them); else the constructor replayed, each tensor by one of the processes
    that hold its parts and sent to the others (materialise.Broadcast), agreed by every process."""
    L = engine.layout
    if given is not None:
        source = FromObject(given, engine.device, engine.stage_group, L.rank_of(replica=0, tp_rank=0))
        if initial is None:
            return source
        initial.rest = source  # (what the file lacks: non-persistent buffers)
        return initial
    blueprint = Blueprint.of(part)
    if initial is not None:
        return engine.agreed(lambda: completed(initial, blueprint, part))
    members = [L.rank_of(replica=r, tp_rank=t) for r in range(L.dp) for t in range(L.tp)]
    return engine.agreed(lambda: Broadcast(part, blueprint, members.index(L.rank), len(members), engine.device,
                                           engine.stage_group, members))


def shard_blocks(roots: list[nn.Module], mesh, mixed_precision: str, placement=None) -> None:
    """torch's fully_shard over `mesh` applied to each root's blocks (`block_units`), inner blocks first, then to
    the root, which stays gathered from forward to backward. With mixed precision, blocks compute with bf16/fp16
    parameters and reduce gradients in fp32; blocks holding BatchNorm keep fp32 parameters. `placement(parameter)`:
    the dimension a parameter is sharded on (fully_shard's shard_placement_fn; None: the first)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    low = AUTOCAST_DTYPES.get(mixed_precision)
    placed = {"shard_placement_fn": placement} if placement is not None else {}

    def policy(module: nn.Module) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(param_dtype=None if keeps_fp32_parameters(module) else low,
                                    reduce_dtype=torch.float32)

    for root in roots:
        for unit in reversed(block_units(root)):  # inner blocks before the blocks that hold them
            fully_shard(unit, mesh=mesh, mp_policy=policy(unit), **placed)
        fully_shard(root, mesh=mesh, mp_policy=policy(root), reshard_after_forward=False, **placed)


def _say(engine, plan, stage, given: bool) -> None:
    """The start-up line of a layout that splits the model."""
    L = engine.layout
    if not engine.runtime.is_main or not L.splits_model:
        return
    held = "its part of its stage(s)" if stage is not None and plan is not None else "its stage(s)" \
        if stage is not None else "its part" if plan is not None else "its shards"
    built = f"the model object copied on the meta device, each process materialised only {held} from its values" \
        if given else f"built on the meta device, each process materialised only {held}"
    init = f", from {engine.init_from}" if engine.init_from else ""
    if stage is not None:
        what = f"pipeline of {L.pp} stages x {L.dp} replica(s)" + \
            (", each stage sharded over its replicas" if L.dp_shard > 1 else "") + \
            (f", each stage's layers split over {L.tp} processes ({plan.describe()})" if plan else "") + \
            f", schedule {L.stages.schedule}: {stage.split.describe()}"
    elif plan is not None:
        what = f"tensor parallelism over {L.tp} processes x {L.dp} data replica(s) " \
            f"({'fsdp' if L.dp_shard > 1 else 'ddp'}), {plan.describe()}"
    else:
        what = f"fsdp over {L.world} processes"
    print(f"{what}; {built}{init}{plan.note if plan else ''}", flush=True)


@torch.no_grad()
def restore_whole(engine, trained: nn.Module) -> None:
    """After training a copy of the user's model object on a layout that splits it: the object given the trained
    tensors whole, on every process, on the device, as fit on one process leaves it. A collective."""
    import torch.distributed as dist

    original = trained.__dict__.get(ORIGINAL)
    if original is None:
        return
    whole = engine.whole_tensors(trained)
    original.to(engine.device)
    own = original.state_dict(keep_vars=True)
    if isinstance(whole, dict):
        for name, value in whole.items():
            own[name].copy_(value)
        return
    runtime = engine.runtime
    for spec in whole.specs:  # one tensor at a time from the main process
        value = whole.read(spec.name)
        value = value if runtime.is_main else torch.empty(spec.shape, dtype=spec.dtype)
        with BEAT.during("collective"):
            dist.broadcast(value, src=0, group=runtime.cpu_group())
        own[spec.name].copy_(value)
