"""channels_last on or off: the training step of each model family, in each precision, on this machine's device.

A training step (forward, cross-entropy, backward, optimizer step) on a batch already on the device, timed with the
model and its input in the contiguous (NCHW) layout and in channels_last (NHWC), alternately, `--repeats` times;
the figure is the median images/s of each and the ratio channels_last / contiguous. scaletrain's default
(`--channels-last` on) comes from these ratios: see that flag in docs/configuration.md.

    python benchmarks/memory_format.py                    # the CPU: every family, fp32 and bf16
    python benchmarks/memory_format.py --device cuda      # a GPU (bf16 and fp16 autocast, fp32)
    python benchmarks/memory_format.py --only resnet18 --precisions no
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import date
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
# (model, image size, channels, batch): scaletrain's own CNN at the digits' size, the families users train on
# photos, at sizes a 2-core CPU steps through in a second or so
CASES = {
    "smallcnn": ("smallcnn", 28, 1, 128),
    "resnet18": ("resnet18", 56, 3, 64),
    "resnet50": ("resnet50", 64, 3, 32),
    "efficientnet_b0": ("efficientnet_b0", 64, 3, 32),
    "convnext_tiny": ("convnext_tiny", 64, 3, 32),
    "vit_small": ("vit_small_patch16_224", 64, 3, 32),
}
GPU_CASES = {k: (m, 224, c if c == 3 else 1, 128 if k != "smallcnn" else 1024) for k, (m, _, c, _) in CASES.items()}


def step_rate(name: str, size: int, channels: int, batch: int, device: str, precision: str, channels_last: bool,
              steps: int) -> float:
    """Images/s of `steps` timed training steps (after 2 untimed)."""
    import timm

    import scaletrain

    torch.manual_seed(0)
    model = (timm.create_model(name, num_classes=10, img_size=size) if name.startswith("vit")
             else scaletrain.build_model(name, channels, 10)).to(device)
    x = torch.randn(batch, channels, size, size, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    def one() -> None:
        with torch.autocast(device_type=device.split(":")[0], dtype=dtype, enabled=dtype is not None):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        one()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        one()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--only", default="", help="comma-separated families [default: all]")
    p.add_argument("--precisions", default="", help="comma-separated: no, bf16, fp16 [default: no,bf16 on the "
                   "CPU; no,bf16,fp16 on a GPU]")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=0, help="timed steps per measurement [default: 5 CPU, 30 GPU]")
    p.add_argument("--out", default="")
    args = p.parse_args()
    gpu = args.device.startswith("cuda")
    cases = GPU_CASES if gpu else CASES
    families = args.only.split(",") if args.only else list(cases)
    precisions = args.precisions.split(",") if args.precisions else (["no", "bf16", "fp16"] if gpu else ["no", "bf16"])
    steps = args.steps or (30 if gpu else 5)
    rows = []
    print("| model | size, batch | precision | contiguous images/s | channels_last images/s | channels_last / "
          "contiguous |\n|---|---|---|---|---|---|", flush=True)
    for family in families:
        name, size, channels, batch = cases[family]
        for precision in precisions:
            rates: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.repeats):
                for cl in (False, True):  # alternately, so that drift on a shared machine hits both alike
                    rates[cl].append(step_rate(name, size, channels, batch, args.device, precision, cl, steps))
            off, on = statistics.median(rates[False]), statistics.median(rates[True])
            rows.append({"family": family, "model": name, "image_size": size, "batch": batch, "precision": precision,
                         "contiguous": rates[False], "channels_last": rates[True], "ratio": on / off})
            print(f"| {name} | {size} px, {batch} | {precision} | {off:,.0f} | {on:,.0f} | {on / off:.2f}x |",
                  flush=True)
    if gpu:
        device_name = torch.cuda.get_device_name()
    else:
        from cpu_limit import cpu_name  # the model name /proc/cpuinfo gives

        device_name = cpu_name()
    record = {"date": date.today().isoformat(), "device": args.device, "device_name": device_name,
              "cores": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "command": "python benchmarks/memory_format.py " + " ".join(
                  f"{k}={v}" for k, v in vars(args).items() if v), "steps": steps, "repeats": args.repeats,
              "rows": rows}
    out = Path(args.out or HERE / "results" / f"memory_format_{'gpu' if gpu else 'cpu'}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
