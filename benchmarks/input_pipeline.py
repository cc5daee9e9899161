"""Input-pipeline throughput: the seeds' training augmentation (flips, brightness/contrast, resize 28 -> 56,
normalise) through scaletrain's batch pipeline against seed 000's per-sample albumentations DataLoader.

Both produce normalised 256-image training batches from the same 8,000 MNIST digits on the same machine in the
same run; only the batches are timed (no model). The peer's pipeline is imported from ../shared/peers as written.

    python benchmarks/input_pipeline.py [--repeats 5] [--device cpu|cuda] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
AUGMENT = ("hflip", "vflip", "brightness", "contrast")
SIZE, BATCH = 56, 256


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_epoch(batches, device: torch.device) -> tuple[float, int]:
    """Seconds for one pass over the batches, and the images produced."""
    _sync(device)
    t0 = time.perf_counter()
    n = 0
    for x, _ in batches:
        n += len(x)
    _sync(device)
    return time.perf_counter() - t0, n


def scaletrain_batches(train, device, on_device: bool):
    from scaletrain.data import mean_std
    from scaletrain.data.batches import DeviceBatches, LoaderBatches
    from scaletrain.data.transforms import Preprocess

    pre = Preprocess(1, SIZE, *mean_std(train))
    common = dict(train=True, rank=0, world=1, seed=0, augment=AUGMENT, channels_last=True)
    if on_device:
        return DeviceBatches(train, pre, device, BATCH, **common)
    return LoaderBatches(train, device, BATCH, num_workers=2, pre=pre, **common)


def peer_loader(train, peers: str):
    sys.path.insert(0, peers)
    import seed000_accelerate as peer  # the seed's get_transform and MiniDataSet, unchanged

    images = train.images[:, 0].numpy()
    dataset = peer.MiniDataSet(images, train.labels.numpy(), peer.get_transform(SIZE, train=True))
    return torch.utils.data.DataLoader(dataset, batch_size=BATCH, num_workers=2, shuffle=True, drop_last=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--peers", default=str(HERE.parent.parent / "shared" / "peers"), help="the seeds' scripts")
    args = p.parse_args()

    from scaletrain.data import load_image_sets

    device = torch.device(args.device)
    train, _ = load_image_sets("default")
    contenders = {
        "scaletrain (data on device)": lambda: scaletrain_batches(train, device, on_device=True),
        "scaletrain (DataLoader, 2 workers)": lambda: scaletrain_batches(train, device, on_device=False),
        "seed 000 albumentations DataLoader, 2 workers": lambda: peer_loader(train, args.peers),
    }
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    made = {name: make() for name, make in contenders.items()}
    for name, batches in made.items():  # warm-up: worker start, first allocations, kernel selection
        time_epoch(batches.epoch(0) if hasattr(batches, "epoch") else batches, device)
    for r in range(args.repeats):  # interleaved, so drift of the machine hits every contender alike
        for name, batches in made.items():
            it = batches.epoch(r + 1) if hasattr(batches, "epoch") else (
                (b["image"].to(device), b["label"]) for b in batches)
            seconds, n = time_epoch(it, device)
            rates[name].append(n / seconds)

    peer = statistics.median(rates["seed 000 albumentations DataLoader, 2 workers"])
    hardware = (torch.cuda.get_device_name(device) if device.type == "cuda"
                else f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    rows = []
    print(f"\ninput pipeline, 28x28 -> {SIZE}x{SIZE}, batch {BATCH}, {len(train)} images, {args.repeats} repeats, "
          f"device {device.type} ({hardware})\n")
    print("| pipeline | images/s (median) | min | max | vs seed 000 |")
    print("|---|---|---|---|---|")
    for name, values in rates.items():
        med = statistics.median(values)
        rows.append({"pipeline": name, "images_per_second_median": med, "min": min(values), "max": max(values),
                     "ratio_vs_peer": med / peer})
        print(f"| {name} | {med:,.0f} | {min(values):,.0f} | {max(values):,.0f} | {med / peer:.1f}x |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"date": time.strftime("%Y-%m-%d"), "device": device.type, "hardware": hardware,
              "torch": torch.__version__, "repeats": args.repeats, "rows": rows}
    (out / f"input_pipeline_{device.type}.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
