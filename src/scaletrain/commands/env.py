"""`scaletrain env`: what a bug report needs to know about this machine and how the job was started: versions,
devices and the launcher environment."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from importlib import metadata
from pathlib import Path

from .. import __version__


def add_parser(subparsers) -> None:
    subparsers.add_parser("env", help="versions, devices and launcher environment, for a bug report",
                          description="Print torch, CUDA, NCCL and accelerate versions, the devices and their "
                                      "memory, and the launcher environment this process sees.")


def run(args: argparse.Namespace) -> int:
    print(render())
    return 0


# Variables by which launchers tell a process who it is; shown when set.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "TORCHELASTIC_RUN_ID", "ACCELERATE_MIXED_PRECISION", "ACCELERATE_CONFIG_FILE",
                      "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST",
                      "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "NCCL_DEBUG", "NCCL_SOCKET_IFNAME")


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def launcher() -> str:
    """How this process was started, as far as the environment tells."""
    env = os.environ
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1 and "TORCHELASTIC_RUN_ID" not in env:
        return f"SLURM srun (task {env['SLURM_PROCID']} of {env['SLURM_NTASKS']})"
    if "TORCHELASTIC_RUN_ID" in env:
        return f"torchrun / torch's launcher (rank {env.get('RANK')} of {env.get('WORLD_SIZE')})"
    if "ACCELERATE_MIXED_PRECISION" in env or "ACCELERATE_DYNAMO_BACKEND" in env:
        return "accelerate launch"
    if "SLURM_JOB_ID" in env:
        return f"inside SLURM job {env['SLURM_JOB_ID']}, not under srun"
    return "none (a single process)"


def environment() -> list[tuple[str, str]]:
    """(name, value) lines, in the order a reader wants them."""
    import torch

    from ..parallel import backends_available, mps_available

    rows = [("scaletrain", __version__), ("python", sys.version.split()[0]),
            ("platform", platform.platform()), ("cpu cores", str(os.cpu_count())),
            ("torch", f"{torch.__version__} (built for CUDA {torch.version.cuda or 'none'})")]
    for package in ("accelerate", "timm", "torchvision", "safetensors", "numpy", "tensorboard"):
        rows.append((package, _version(package)))
    cuda = torch.cuda.is_available()
    rows.append(("CUDA available", f"yes, driver sees {torch.cuda.device_count()} GPU(s)" if cuda else "no"))
    if cuda:
        nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
        rows.append(("NCCL", ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)))
        rows.append(("cuDNN", str(torch.backends.cudnn.version())))
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            rows.append((f"GPU {i}", f"{p.name}, {p.total_memory / 2**30:.1f} GiB, compute {p.major}.{p.minor}, "
                                     f"bf16 {'yes' if p.major >= 8 else 'no'}"))
    rows.append(("Apple MPS", "available" if mps_available() else "no"))
    rows.append(("distributed backends", ", ".join(backends_available()) or "none"))
    rows.append(("launcher", launcher()))
    config = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "accelerate" / \
        "default_config.yaml"
    rows.append(("accelerate config", str(config) if config.exists() else "none (accelerate config not run)"))
    for name in LAUNCHER_VARIABLES:
        if name in os.environ:
            rows.append((name, os.environ[name]))
    return rows


def render() -> str:
    rows = environment()
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
