"""Everything parallel, and the only code that imports accelerate or torch.distributed.

- launch.py      when the job was launched, the hardware, SLURM's variables, torch's launcher for N local workers
- runtime.py     `Runtime`: one process's rank, device, precision and collectives (one accelerate.Accelerator)
- strategies.py  ddp, dp, fsdp: wrapping, no_sync, state dicts, checkpoint I/O and the loss scaler
- pipeline.py    --strategy pipeline: stages on torch.distributed.pipelining, replicated over a (pp, dp) mesh, each
                 stage's layers split with --tp over a (pp, dp, tp) one
- split.py       a model cut into stages: its parts in order, where the cuts fall, the check of its forward
- materialise.py a model built on the meta device, each process materialising only its part, filled from the
                 replayed constructor (the whole model's values at the seed) or an --init-from file
- tensor.py      --tp: each layer of a plan (a user's, timm's ViTs, a Transformers model's) split over N processes
                 on DTensor, with ddp or fsdp over the rest; the plans, their refusals, one process's part for
                 estimate-memory
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
from .materialise import build_on_meta, on_meta
from .pipeline import Layout
from .probe import measure_allreduce_gbps
from .runtime import Runtime, runtime_for, splits_model
from .strategies import AUTOCAST_DTYPES, STRATEGIES, StepModule, in_autocast
from .syncbn import CpuSyncBatchNorm2d, convert_cpu_sync_bn
from .watch import BEAT, STALL_EXIT, RankFailed, folder_bytes

__all__ = ["AUTOCAST_DTYPES", "BEAT", "CpuSyncBatchNorm2d", "Layout", "Nodes", "RankFailed", "Runtime",
           "STALL_EXIT", "STRATEGIES", "StepModule", "adopt_slurm",
           "apply_activation_checkpointing", "available_gpus", "backends_available", "block_units", "build_on_meta",
           "convert_cpu_sync_bn", "drop_legacy_local_rank", "first_host", "folder_bytes", "in_autocast",
           "keeps_fp32_parameters",
           "launch", "launched_world_size", "measure_allreduce_gbps", "mps_available", "on_meta", "resolve_nproc",
           "runtime_for", "splits_model"]
