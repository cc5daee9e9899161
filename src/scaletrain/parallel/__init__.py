"""Everything parallel, and the only code that imports accelerate or torch.distributed.

- launch.py      when the job was launched, the hardware, SLURM's variables, torch's launcher for N local workers
- layout.py      `Layout`: the degrees (pp, dp_replicate, dp_shard, tp), their checks, every coordinate, which
                 processes read the same batches and which counts the outputs, the checkpoint format, the mesh
- runtime.py     `Runtime`: one process's rank, device, precision and collectives (one accelerate.Accelerator), and
                 the seam to its Engine
- engine.py      `Engine`: the model on the layout: built, a batch through it, one clipping norm over any mix of
                 placements and stages, buffers made alike, whole tensors, checkpoints; the fp16 loss scaler
- parallelize.py one parallelize in a fixed order: stage cut, tensor parallelism, activation checkpointing,
                 compile, fsdp, materialisation (then DDP); a model object's copy given back whole
- saved.py       checkpoint files in the layout's format (whole, or torch.distributed.checkpoint's), read by any
- pipeline.py    a pipeline's stages on torch.distributed.pipelining: the schedules, the checks of data and model
- split.py       a model cut into stages: its parts in order, where the cuts fall, the check of its forward
- materialise.py a model built on the meta device, each process materialising only its part, filled from the
                 replayed constructor (the whole model's values at the seed) or an --init-from file
- tensor.py      --tp: the plans (a user's, timm's ViTs, a Transformers model's), their refusals, their
                 application on DTensor, one process's part for estimate-memory
- heads.py       timm's fused q, k, v split by heads, and the checkpoint views that keep it readable on any layout
- whole.py       the whole model's tensors read one at a time from stages and shards, for a weights file
- syncbn.py      SyncBatchNorm on GPUs and its gloo counterpart on CPUs
- blocks.py      a model's repeated blocks: FSDP units, activation checkpointing, the memory estimate's units
- probe.py       the measured all-reduce bandwidth for `bench`
- trackers.py    TensorBoard, MLflow and W&B as accelerate trackers, started by `Runtime.start_trackers`
- threads.py     each process's share of the usable cores (affinity, cgroup quota); OMP_NUM_THREADS lowered to it
- watch.py       each rank's heartbeat on the job's store: a stalled rank named, a failed rank named everywhere
- stacks.py      the Python stack of a stalled process and of the DataLoader worker it waits for
"""

# launch first: where there is no /proc, its import time is the launch time, taken before torch is imported
from .launch import (Nodes, adopt_slurm, available_gpus, backends_available, drop_legacy_local_rank,
                     first_host, launch, launched_world_size, mps_available, resolve_nproc)
from .blocks import apply_activation_checkpointing, block_units, keeps_fp32_parameters  # noqa: I001
from .engine import StepModule, in_autocast
from .parallelize import AUTOCAST_DTYPES
from .layout import Layout, Stages, layout_settings
from .materialise import build_on_meta, on_meta
from .parts import read_part
from .probe import measure_allreduce_gbps
from .runtime import Runtime, runtime_for
from .syncbn import CpuSyncBatchNorm2d, convert_cpu_sync_bn
from .watch import BEAT, STALL_EXIT, RankFailed, folder_bytes

__all__ = ["AUTOCAST_DTYPES", "BEAT", "CpuSyncBatchNorm2d", "Layout", "Nodes", "RankFailed", "Runtime",
           "STALL_EXIT", "Stages", "StepModule", "adopt_slurm",
           "apply_activation_checkpointing", "available_gpus", "backends_available", "block_units", "build_on_meta",
           "convert_cpu_sync_bn", "drop_legacy_local_rank", "first_host", "folder_bytes", "in_autocast",
           "keeps_fp32_parameters",
           "launch", "launched_world_size", "layout_settings", "measure_allreduce_gbps", "mps_available", "on_meta", "read_part", "resolve_nproc",
           "runtime_for"]
