"""The job's layout: how its processes divide the model and the data, in four dimensions, pp (pipeline stages),
dp_replicate and dp_shard (data-parallel replicas, holding the model whole or sharded over them) and tp (each
layer split). Built once from the resolved settings and the process count; everything that asks where a process
stands (its stage, its replica, its part of a split layer, which batches it reads, whether it counts the outputs,
how its random draws are seeded, what the stall watch calls it, how checkpoints are written, the DeviceMesh) asks
it, and nothing else computes a coordinate or tests a strategy's name.

Ranks are laid out pp outermost and tp innermost (rank = ((stage x dp) + replica) x tp + tp rank), as torchtitan
orders its mesh: the processes of a split layer, which talk at every layer, are neighbours, on one node where they
fit; a stage's replicas next; the pipeline's hops, one activation per micro-batch, are what crosses nodes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import torch

from ..config import CHUNKS_PER_PROCESS, check_schedule, microbatches_for
from ..errors import UserError

OLDEST_PIPELINE_TORCH = (2, 8)  # pipelining's schedules over gloo could hang before (pytorch#132644, #152938)
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class Stages:
    """The pipeline a run asks for: --stages, --split-at, --microbatches, --schedule, --shard-stages (0: chosen).
    The schedules' rules are config.schedule_runs."""

    count: int = 0
    split_at: tuple[str, ...] = ()
    microbatches: int = 0
    schedule: str = "1f1b"
    shard: bool = False  # --shard-stages: each stage sharded over its replicas (fsdp inside a stage)

    def stage_count(self, processes: int) -> int:
        """Stages of one pipeline of `processes`: --stages, one more than the --split-at names, else every one."""
        return self.count or (len(self.split_at) + 1 if self.split_at else processes)

    @property
    def chunks_per_process(self) -> int:
        """Model stages each process holds (two under interleaved 1F1B)."""
        return CHUNKS_PER_PROCESS[self.schedule]

    def cut(self, batch: int, stages: int) -> tuple[int, str]:
        """(micro-batches, schedule) for a batch of `batch` rows (config.microbatches_for): an epoch's short last
        batch that the schedule cannot run in micro-batches that divide it runs under GPipe's order."""
        return microbatches_for(batch, stages, self.schedule, self.microbatches)


@dataclass(frozen=True)
class Layout:
    """One job's layout (see the module's doc), seen from process `rank`. `strategy`: the data parallelism over
    the replicas (ddp, dp, fsdp) or pipeline (stages, replicated or, with --shard-stages, sharded over the
    rest)."""

    world: int = 1
    strategy: str = "ddp"
    tp: int = 1
    stages: Stages = field(default_factory=Stages)
    rank: int = 0
    gpus_per_process: int = 1  # --strategy dp: the GPUs its one process drives

    @classmethod
    def of(cls, r, world: int, rank: int = 0, gpus: int = 1) -> "Layout":
        """The layout a run section (RunConfig, resolved or not) asks for on `world` processes, refused on one line
        when they cannot be laid out so (`gpus`: the GPUs a --strategy dp process drives)."""
        from ..config import NAMES

        split_at = NAMES.parse("--split-at", r.split_at)  # text where the section is not resolved yet
        stages = Stages(r.stages, tuple(split_at), r.microbatches, r.schedule, r.shard_stages) \
            if r.strategy == "pipeline" else Stages()
        layout = cls(world, r.strategy, r.tp, stages, rank, gpus if r.strategy == "dp" else 1)
        layout.check(nproc_auto=getattr(r, "nproc", None) == "auto")
        return layout

    def at(self, rank: int) -> "Layout":
        """The same layout seen from process `rank`."""
        return replace(self, rank=rank)

    def for_scoring(self) -> "Layout":
        """The layout predict and evaluate run on: a pipeline's processes each hold the model whole (its stages
        become data replicas), its layers still split over --tp."""
        if self.strategy != "pipeline":
            return self
        return replace(self, strategy="ddp", stages=Stages())

    def check(self, nproc_auto: bool = False) -> None:
        """Refuse on one line a process count the degrees do not divide, and a pipeline's micro-batches that its
        schedule cannot run, or a torch too old for pipelines."""
        if self.tp < 1:
            raise UserError(f"--tp must be 1 (off) or a number of processes each layer is split over, got {self.tp}")
        if self.world % self.tp:
            raise UserError(f"--tp {self.tp} needs a multiple of {self.tp} processes (--nproc x --nnodes), got "
                            f"{self.world}" + (" (--nproc auto: one per GPU, 1 on the CPU)" if nproc_auto else ""))
        if self.strategy != "pipeline":
            return
        found = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
        if found < OLDEST_PIPELINE_TORCH:
            raise UserError(f"--strategy pipeline needs torch {'.'.join(map(str, OLDEST_PIPELINE_TORCH))} or later "
                            f"(its schedules could hang on gloo before); this is torch {torch.__version__}")
        processes, stages = self.world // self.tp, self.pp
        if processes < stages or processes % stages:
            each = f" of --tp {self.tp} processes each" if self.tp > 1 else ""
            raise UserError(f"--strategy pipeline with {stages} stages{each} needs a multiple of {stages * self.tp} "
                            f"processes (--nproc x --nnodes), got {self.world}")
        if self.stages.microbatches:
            check_schedule(self.stages.schedule, self.stages.microbatches, stages)

    # -- the degrees -----------------------------------------------------------------------------------------
    @property
    def pp(self) -> int:
        """Pipeline stages (1: none)."""
        return self.stages.stage_count(self.world // self.tp) if self.strategy == "pipeline" else 1

    @property
    def dp(self) -> int:
        """Data-parallel replicas: groups of processes that read different batches."""
        return self.world // (self.pp * self.tp)

    @property
    def dp_shard(self) -> int:
        """Replicas over which each parameter is sharded (fsdp; a pipeline's --shard-stages)."""
        sharded = self.strategy == "fsdp" or (self.strategy == "pipeline" and self.stages.shard)
        return self.dp if sharded else 1

    @property
    def dp_replicate(self) -> int:
        """Replicas that hold the model (or their shard group's parts) alike."""
        return self.dp // self.dp_shard

    @property
    def devices(self) -> int:
        """Data-parallel devices of the whole job: what its batch plan is made for."""
        return self.dp * self.gpus_per_process

    @property
    def replicates(self) -> bool:
        """Whether DistributedDataParallel wraps the model: two or more processes of ddp, each holding it whole."""
        return self.strategy == "ddp" and not self.splits_model and self.world > 1

    @property
    def splits_model(self) -> bool:
        """Whether any process holds only a part of the model (a stage, a shard, a split layer)."""
        return self.pp > 1 or self.tp > 1 or self.dp_shard > 1

    @property
    def checkpoint_format(self) -> str:
        """How this layout writes its checkpoints: "sharded" (torch.distributed.checkpoint, each process its part,
        readable on any layout) where the model is split or fsdp wraps it; "whole" (safetensors of the main
        process's model) where every process holds it whole."""
        return "sharded" if self.strategy in ("fsdp", "pipeline") or self.tp > 1 else "whole"

    # -- where this process stands ---------------------------------------------------------------------------
    @property
    def stage(self) -> int:
        return self.rank // self.tp // self.dp

    @property
    def replica(self) -> int:
        """Which data-parallel replica this process belongs to: the shard of the data it reads."""
        return self.rank // self.tp % self.dp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    def rank_of(self, stage: int | None = None, replica: int | None = None, tp_rank: int | None = None) -> int:
        """The global rank at these coordinates (each None: this process's own)."""
        stage = self.stage if stage is None else stage
        replica = self.replica if replica is None else replica
        tp_rank = self.tp_rank if tp_rank is None else tp_rank
        return (stage * self.dp + replica) * self.tp + tp_rank

    @property
    def reads_inputs(self) -> bool:
        """Whether this process's model reads the batches' inputs (a pipeline's first stage does)."""
        return self.stage == 0

    @property
    def holds_outputs(self) -> bool:
        """Whether this process counts the outputs (losses, validation, predictions): one per replica, the last
        stage's first tensor-parallel process."""
        return self.stage == self.pp - 1 and self.tp_rank == 0

    @property
    def random_rank(self) -> int:
        """What this process's random draws (dropout, after a resume) are seeded with: the processes of a split
        layer draw alike, every other process differently."""
        return self.rank // self.tp

    @property
    def role(self) -> str:
        """What the stall watch calls this process beside its rank ('' where it is the only thing to say)."""
        parts = []
        if self.tp > 1:
            parts.append(f"tensor-parallel rank {self.tp_rank + 1} of {self.tp}")
        if self.pp > 1:
            parts.append(f"pipeline stage {self.stage + 1} of {self.pp}")
        if parts and self.dp > 1:
            parts.append(f"data replica {self.replica + 1} of {self.dp}")
        return ", ".join(parts)

    def describe(self) -> str:
        """The layout in words, for the start-up line: 'fsdp, each layer split over --tp 2'."""
        said = {"pipeline": "pipeline"}.get(self.strategy, self.strategy)
        return said + (f", each layer split over --tp {self.tp}" if self.tp > 1 else "")

    # -- the mesh --------------------------------------------------------------------------------------------
    @functools.cached_property
    def _meshes(self) -> dict:
        return {}

    def mesh(self, device_type: str):
        """The job's DeviceMesh (pp, dp_replicate, dp_shard, tp), made at the first use (every process makes it at
        the same point)."""
        if device_type not in self._meshes:
            from torch.distributed.device_mesh import init_device_mesh

            self._meshes[device_type] = init_device_mesh(
                device_type, (self.pp, self.dp_replicate, self.dp_shard, self.tp), mesh_dim_names=MESH_DIMS)
        return self._meshes[device_type]

    def forget_meshes(self) -> None:
        """The meshes made so far dropped (a runtime's end)."""
        self._meshes.clear()

    def group(self, device_type: str, *dims: str):
        """The process group of this process along `dims` (several: flattened), e.g. ("dp_replicate", "dp_shard")
        for its stage's replicas."""
        mesh = self.mesh(device_type)[dims if len(dims) > 1 else dims[0]]
        return (mesh._flatten() if len(dims) > 1 else mesh).get_group()


LAYOUT_DIMS = ("pp", "ddp", "fsdp", "tp")  # as a layout is written: its dimensions and degrees joined by x


def layout_settings(text: str, flag: str = "--layouts") -> tuple[int, dict]:
    """(processes, run settings) of a layout written as its dimensions and degrees joined by `x` (`ddp2`, `fsdp2`,
    `tp2`, `pp2`, `tp2xfsdp2`, `pp2xtp2`, `pp2xddp2`, `pp2xfsdp2`: fsdp over a stage's replicas) or `1` (one
    process); the processes are the degrees' product."""
    import re

    text = text.strip()
    if text == "1":
        return 1, {"strategy": "ddp", "tp": 1, "stages": 0, "shard_stages": False}
    degrees: dict[str, int] = {}
    for token in text.split("x"):
        m = re.fullmatch(r"(pp|ddp|fsdp|tp)([1-9]\d*)", token)
        if m is None or m.group(1) in degrees:
            raise UserError(f"{flag}: '{text}' is not a layout; expected dimensions and degrees joined by x, each "
                            f"of {', '.join(LAYOUT_DIMS)} at most once, e.g. ddp2, tp2xfsdp2, pp2xtp2")
        degrees[m.group(1)] = int(m.group(2))
    if "ddp" in degrees and "fsdp" in degrees:
        raise UserError(f"{flag}: '{text}' has ddp and fsdp; a stage's replicas hold it whole (ddp) or sharded "
                        f"(fsdp), not both")
    settings: dict = {"strategy": "fsdp" if "fsdp" in degrees else "ddp", "tp": degrees.get("tp", 1), "stages": 0,
                      "shard_stages": False}
    if "pp" in degrees:
        settings.update(strategy="pipeline", stages=degrees["pp"], shard_stages="fsdp" in degrees)
    processes = 1
    for d in degrees.values():
        processes *= d
    return processes, settings
