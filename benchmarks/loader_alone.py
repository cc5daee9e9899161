"""The input pipeline alone, no model: timm's loader against scaletrain's ways of reading the same photos.

On the photo folder of `photo_startup.py` (made there; pass its path), each contender yields training batches of
64 normalised float images of 3 x 64 x 64 with RandomResizedCrop and horizontal flip, on the CPU, and is timed
over `--batches` batches after one warm-up batch:

- timm: `timm.data.create_dataset` (an ImageFolder) and `create_loader(is_training=True, use_prefetcher=False,
  num_workers=2)`, what timm's train.py runs with `--no-prefetcher -j 2`: every image decoded from its JPEG;
- scaletrain, files streamed: the same folder, DataLoader workers decoding each image at the stored size, crop
  and flip made for the whole batch;
- scaletrain, prepared shards streamed: `scaletrain prepare`'s shards read by memory map in DataLoader workers;
- scaletrain, prepared shards in memory: the shards held in memory, each batch indexed and built in place.

Each contender runs `--rounds` times, taking turns; the figure is the median images/s, with the ratio to timm's.

    python benchmarks/loader_alone.py --data /tmp/scaletrain-photos-20000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SIZE, BATCH, WORKERS = 64, 64, 2


def timm_batches(root: Path):
    from timm.data import create_dataset, create_loader

    dataset = create_dataset("", root=str(root / "train"), split="train", is_training=True)
    loader = create_loader(dataset, input_size=(3, SIZE, SIZE), batch_size=BATCH, is_training=True,
                           use_prefetcher=False, num_workers=WORKERS, persistent_workers=False)
    return iter(loader)


def scaletrain_batches(data: str, on_device: str, cache: str):
    import torch

    from scaletrain.config import DataConfig, TrainConfig, resolve
    from scaletrain.data import load_image_sets
    from scaletrain.data.transforms import default_preprocess
    from scaletrain.data.batches import DeviceBatches, LoaderBatches

    cfg = TrainConfig(data=DataConfig(data=data, image_size=SIZE, data_on_device=on_device, cache_dir=cache,
                                      num_workers=WORKERS))
    train, _ = load_image_sets(cfg.data, seed=0)
    settings = resolve(cfg, cfg.plan(1), train.recipe)
    pre = default_preprocess(train, settings.data)
    common = dict(train=True, rank=0, world=1, seed=0, augment=settings.data.augment, channels_last=False)
    cpu = torch.device("cpu")
    if on_device == "yes":
        return DeviceBatches(train, pre, cpu, BATCH, **common).epoch(0)
    return LoaderBatches(train, cpu, BATCH, num_workers=WORKERS, pre=pre, **common).epoch(0)


def measure(name: str, root: Path, prepared: Path, cache: str, batches: int) -> float:
    """Images/s of `batches` batches after a warm-up one (run in a fresh process, see main)."""
    make = {"timm": lambda: timm_batches(root),
            "scaletrain, files streamed": lambda: scaletrain_batches(str(root), "no", cache),
            "scaletrain, prepared shards streamed": lambda: scaletrain_batches(str(prepared), "no", cache),
            "scaletrain, prepared shards in memory": lambda: scaletrain_batches(str(prepared), "yes", cache)}[name]
    it = make()
    x, _ = next(it)
    assert tuple(x.shape) == (BATCH, 3, SIZE, SIZE), x.shape
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    return batches * BATCH / (time.perf_counter() - t0)


NAMES = ("timm", "scaletrain, files streamed", "scaletrain, prepared shards streamed",
         "scaletrain, prepared shards in memory")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="a photo folder with train/ and val/ (photo_startup.py)")
    p.add_argument("--batches", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=HERE / "results" / "loader_alone_cpu.json")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one contender in this process
    p.add_argument("--prepared", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.data, args.prepared, args.cache, args.batches)))
        return 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"),
                                                        os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    rates: dict[str, list[float]] = {n: [] for n in NAMES}
    with tempfile.TemporaryDirectory() as tmp:
        cache, prepared = str(Path(tmp) / "cache"), Path(tmp) / "prepared"
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "scaletrain", "prepare", "--data", str(args.data), "--image-size",
                        str(SIZE), "--cache-dir", cache, "--output", str(prepared)], env=env, check=True,
                       stdout=subprocess.DEVNULL)
        prepare_s = time.perf_counter() - t0
        for _ in range(args.rounds):
            for name in NAMES:
                out = subprocess.run([sys.executable, __file__, "--one", name, "--data", str(args.data),
                                      "--prepared", str(prepared), "--cache", cache, "--batches",
                                      str(args.batches)], env=env, capture_output=True, text=True)
                if out.returncode:
                    sys.exit(f"{name} failed:\n{out.stderr[-2000:]}")
                rates[name].append(float(out.stdout.strip().splitlines()[-1]))
                print(f"{name}: {rates[name][-1]:.0f} images/s", flush=True)
    median = {n: statistics.median(r) for n, r in rates.items()}
    print("\n| loader alone | images/s (median) | x timm |\n|---|---|---|")
    for n in NAMES:
        print(f"| {n} | {median[n]:.0f} | {median[n] / median['timm']:.2f} |")
    meta = {"date": time.strftime("%Y-%m-%d"), "cpu_cores": os.cpu_count(), "batches": args.batches,
            "batch": BATCH, "size": SIZE, "workers": WORKERS, "prepare_seconds": prepare_s,
            "command": " ".join(sys.argv)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "images_per_second": rates, "median": median,
                                    "vs_timm": {n: median[n] / median["timm"] for n in NAMES}}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
