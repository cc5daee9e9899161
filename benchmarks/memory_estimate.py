"""`scaletrain estimate-memory` against the memory a real training step takes, on this machine's device.

For each case the estimate (parameters, buffers, gradients, optimizer state, activations) is compared with the
peak a real step reaches, optimizer state included: on a GPU `torch.cuda.max_memory_allocated`, on the CPU the C
allocator's bytes in use (glibc), sampled after every op. One warm-up step first (kernel caches, optimizer
state); the measured step starts with gradients set to None, as training does. Prints a Markdown table and
writes benchmarks/results/memory_estimate_<device>.json.

    python benchmarks/memory_estimate.py                       # the default cases
    python benchmarks/memory_estimate.py --case resnet50:224:128:bf16
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
from pathlib import Path

import torch
import torch.nn.functional as F

from scaletrain.config import TrainConfig
from scaletrain.parallel import apply_activation_checkpointing
from scaletrain.training.optim import make_optimizer
from scaletrain.measure.memory import AllocatorPeak, c_allocator_bytes, estimate
from scaletrain.models import build_model

CPU_CASES = ["resnet18:64:64:no", "resnet18:64:64:bf16:ac", "convnext_atto:64:64:no", "test_vit:64:64:bf16"]
GPU_CASES = ["resnet18:224:128:no", "resnet50:224:128:bf16", "resnet50:224:128:bf16:ac",
             "convnext_small:224:64:bf16", "vit_base_patch16_224:224:64:bf16:ac"]


def measured_peak(name: str, size: int, batch: int, precision: str, checkpointing: bool, device: torch.device,
                  optimizer: str) -> int:
    """Peak bytes in use during one real SGD/AdamW training step, above what was in use before the model."""
    cuda = device.type == "cuda"
    in_use = torch.cuda.memory_allocated if cuda else c_allocator_bytes()
    gc.collect()
    base = in_use()
    model = build_model(name, 3, 10).to(device).train()
    if checkpointing:
        apply_activation_checkpointing(model)
    opt = make_optimizer(model, TrainConfig.from_dict({"optim": {"optimizer": optimizer}}).optim)
    images = torch.randn(batch, 3, size, size, device=device)
    labels = torch.randint(0, 10, (batch,), device=device)
    base += images.nbytes + labels.nbytes  # the batch is data, not the step's memory

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision != "no"):
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        opt.step()

    step()  # warm-up: optimizer state and kernel caches exist from here on
    opt.zero_grad(set_to_none=True)
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        sampler = AllocatorPeak(in_use)
        with sampler:
            step()
        peak = sampler.peak
    return peak - base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", help="MODEL:IMAGE_SIZE:BATCH:PRECISION[:ac] (repeatable)")
    parser.add_argument("--optimizer", default="adamw", choices=("sgd", "adam", "adamw"))
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cases = args.case or (GPU_CASES if device.type == "cuda" else CPU_CASES)
    hardware = torch.cuda.get_device_name(0) if device.type == "cuda" else f"CPU {platform.machine()}"
    rows = []
    for case in cases:
        name, size, batch, precision, *rest = case.split(":")
        size, batch, ac = int(size), int(batch), rest == ["ac"]
        est = estimate(name, image_size=size, channels=3, batch_size=batch, mixed_precision=precision,
                       optimizer=args.optimizer, activation_checkpointing=ac)
        measured = measured_peak(name, size, batch, precision, ac, device, args.optimizer)
        rows.append({"case": case, "estimate": est.total, "activations": est.parts["activations"],
                     "measured_peak": measured, "ratio": est.total / measured})
        print(f"{case}: estimate {est.total / 2**20:,.1f} MiB, measured {measured / 2**20:,.1f} MiB", flush=True)
    print(f"\n{datetime.date.today()}, {hardware}, torch {torch.__version__}, optimizer {args.optimizer}\n")
    print("| model:size:batch:precision[:ac] | estimate MiB | of which activations | measured peak MiB | "
          "estimate / measured |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['estimate'] / 2**20:,.1f} | {r['activations'] / 2**20:,.1f} | "
              f"{r['measured_peak'] / 2**20:,.1f} | {r['ratio']:.3f} |")
    out = Path(__file__).parent / "results" / f"memory_estimate_{device.type}.json"
    out.write_text(json.dumps({"date": str(datetime.date.today()), "hardware": hardware,
                               "torch": torch.__version__, "optimizer": args.optimizer, "rows": rows}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
