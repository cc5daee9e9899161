"""A photo folder's first run on the CPU: decoding the JPEGs and training on the same cores, and how to share them.

A first run over a folder has to decode every JPEG once while it trains (the next runs find the pixels in the
cache). On a machine with few cores the decoding workers and the training's intra-op threads want the same cores.
This benchmark measures, in the same run, one contender after another in fresh processes, `--rounds` times with
the order reversed every other round:

- `tensors`: the ceiling, a bare loop over the images already decoded to tensors in memory (no JPEG work);
- bare loops that decode the JPEGs as they train, each a schedule of the two: W DataLoader workers at normal
  priority against the training's threads (`decode W`), one worker counted against the cores (the training
  takes one intra-op thread fewer), the workers at the lowest priority so that training's
  threads keep the cores and the workers take what is left (`decode W, workers nice 19`), and every file decoded
  first on all cores, then trained from memory (`decode first`);
- `scaletrain train`, its first run over an empty cache (its first epoch decodes in DataLoader workers at nice 19
  while it trains, and writes the decoded batches to the cache as they pass), and its second run (the decoded
  images found in the cache).

Each bare loop is resnet18 at 64 px (channels_last, the memory format scaletrain trains in on the CPU), batch 64,
SGD 0.05 with momentum, one epoch of the folder's train/ images, decoded with scaletrain's own decode (the photo
recipe: shorter side to 73 px, the central square, then the central 64 px): the same work per image as
scaletrain's. Figures: images/s of the epoch (from its first batch to the end of its last, decoding included) and
each one's ratio to the `tensors` ceiling; also the milliseconds per file of the decode on one core, and the rate
the cores could reach if decoding and training shared them perfectly (1 / (decode ms / cores + 1 / ceiling)).

    python benchmarks/photo_schedule.py --files 8000 --rounds 3          # about 25 minutes on 2 cores
    python benchmarks/photo_schedule.py --files 8000 --rounds 3 --ways tensors,"2 workers nice",first,scaletrain
    python benchmarks/photo_schedule.py --files 800 --rounds 1 --out /tmp/smoke.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
SIZE, STORED, BATCH = 64, 73, 64


def _train_files(root: Path) -> tuple[list[Path], list[int]]:
    classes = sorted(p.name for p in (root / "train").iterdir() if p.is_dir())
    files = [(f, k) for k, c in enumerate(classes) for f in sorted((root / "train" / c).glob("*.jpg"))]
    return [f for f, _ in files], [k for _, k in files]


class Photos:
    """The folder's training JPEGs, decoded as scaletrain's photo recipe decodes them (uint8 3 x 73 x 73)."""

    def __init__(self, root: Path):
        self.paths, self.labels = _train_files(root)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        import torch

        from scaletrain.data.images import decode_image

        return decode_image(self.paths[i], 3, STORED, "photo"), torch.tensor(self.labels[i])


def _lowest_priority(_worker: int) -> None:
    os.nice(19)


def bare(args: argparse.Namespace) -> None:
    """One contender's epoch, in this process; prints its images/s."""
    import timm
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    if "1 thread" in args.bare:  # the worker counted against the cores: the training gets the rest
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) - 1))
    photos = Photos(Path(args.folder))
    model = timm.create_model("resnet18", num_classes=10).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    cut = (STORED - SIZE) // 2

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        x = (x[:, :, cut:cut + SIZE, cut:cut + SIZE].float() / 255 - 0.45) / 0.225
        loss = nn.functional.cross_entropy(model(x.contiguous(memory_format=torch.channels_last)), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    model.train()
    order = torch.randperm(len(photos))
    if args.bare in ("tensors", "first"):  # every file decoded on every core first (Pillow releases the GIL)
        from concurrent.futures import ThreadPoolExecutor

        t0 = time.perf_counter()
        with ThreadPoolExecutor(os.cpu_count()) as pool:
            items = list(pool.map(photos.__getitem__, range(len(photos)), chunksize=16))
        images, labels = torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])
        if args.bare == "tensors":  # the decoding left out of the clock: the training alone
            t0 = time.perf_counter()
        for idx in order.split(BATCH):
            step(images[idx], labels[idx])
    else:
        workers = int(args.bare.split()[0])
        loader = DataLoader(photos, batch_sampler=order.split(BATCH), num_workers=workers, persistent_workers=False,
                            worker_init_fn=_lowest_priority if "nice" in args.bare else None)
        t0 = time.perf_counter()
        for x, y in loader:
            step(x, y)
    seconds = time.perf_counter() - t0
    print(json.dumps({"images_per_second": len(photos) / seconds, "seconds": seconds}), flush=True)


def run_bare(way: str, folder: Path) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, __file__, "--bare", way, "--folder", str(folder)], capture_output=True,
                          text=True, env=env, timeout=3600)
    if proc.returncode:
        raise SystemExit(f"bare loop '{way}' failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["images_per_second"]


def run_scaletrain(folder: Path, work: Path, cache: Path) -> float:
    out = Path(tempfile.mkdtemp(dir=work))
    proc = subprocess.run([sys.executable, "-m", "scaletrain", "train", "--data", str(folder), "--model", "resnet18",
                           "--image-size", str(SIZE), "--batch-size", str(BATCH), "--lr", "0.05", "--epochs", "1",
                           "--output-dir", str(out), "--cache-dir", str(cache)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(HERE.parent / "src")}, timeout=3600)
    if proc.returncode:
        raise SystemExit(f"scaletrain train failed:\n{proc.stderr[-3000:]}")
    header, row = (out / "metrics.csv").read_text().splitlines()[:2]
    shutil.rmtree(out)
    # a first run decodes in its epoch, as the bare loops that decode in workers do: the epoch's own figure
    return float(dict(zip(header.split(","), row.split(",")))["images_per_second"])


WAYS = ("tensors", "2 workers", "1 workers", "1 workers 1 thread", "2 workers nice", "first")
NAMES = {"tensors": "bare loop, tensors in memory (ceiling)", "2 workers": "bare loop, decode in 2 workers",
         "1 workers": "bare loop, decode in 1 worker",
         "1 workers 1 thread": "bare loop, decode in 1 worker, threads = cores - 1",
         "2 workers nice": "bare loop, decode in 2 workers, nice 19",
         "first": "bare loop, decode first on every core", "first run": "scaletrain train, first run",
         "second run": "scaletrain train, second run (cache)"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=int, default=8000, help="JPEGs in the folder (80 %% train) [default: 8000]")
    p.add_argument("--data-dir", type=Path, help="where the folder is made and kept [default: "
                   "<tmp>/scaletrain-photos-<files>]")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ways", default=",".join([*WAYS, "scaletrain"]),
                   help="the contenders, comma-separated [default: all: %(default)s]")
    p.add_argument("--out", default=str(HERE / "results" / "photo_schedule_cpu.json"))
    p.add_argument("--bare", choices=WAYS, help=argparse.SUPPRESS)  # one contender, in its own process
    p.add_argument("--folder", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.bare:
        bare(args)
        return
    sys.path.insert(0, str(HERE))
    from photo_startup import make_photo_folder, per_file_ms, warm_page_cache

    folder = args.data_dir or Path(tempfile.gettempdir()) / f"scaletrain-photos-{args.files}"
    made = make_photo_folder(folder, args.files)
    warm_page_cache(folder)
    decode_ms = per_file_ms(folder, 500)["decoded to 73 px (photo recipe, 64 px crop)"]
    work = Path(tempfile.mkdtemp(prefix="photo-schedule-"))
    contenders = [w.strip() for w in args.ways.split(",")]
    unknown = sorted(set(contenders) - {*WAYS, "scaletrain"})
    if unknown or "tensors" not in contenders:
        raise SystemExit(f"--ways: {', '.join(unknown) or 'tensors (the ceiling) is needed'}: one of "
                         f"{', '.join([*WAYS, 'scaletrain'])}")
    rates: dict[str, list[float]] = {k: [] for k in (*[w for w in WAYS if w in contenders],
                                                     *(("first run", "second run") if "scaletrain" in contenders
                                                       else ()))}
    try:
        for k in range(args.rounds):
            for c in (contenders if k % 2 == 0 else contenders[::-1]):
                if c == "scaletrain":
                    cache = work / f"cache-{k}"
                    got = {"first run": run_scaletrain(folder, work, cache),
                           "second run": run_scaletrain(folder, work, cache)}
                    shutil.rmtree(cache)
                else:
                    got = {c: run_bare(c, folder)}
                for name, value in got.items():
                    rates[name].append(value)
                    print(f"round {k + 1}: {NAMES[name]}: {value:.1f} images/s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ceiling = statistics.median(rates["tensors"])
    cores = len(os.sched_getaffinity(0))
    bound = 1 / (decode_ms / 1000 / cores + 1 / ceiling)
    rows = [{"contender": NAMES[k], "images_per_second_median": round(statistics.median(v), 1),
             "of_ceiling": round(statistics.median(v) / ceiling, 3), "values": [round(x, 1) for x in v]}
            for k, v in rates.items()]
    print(f"\ndecode, one core: {decode_ms:.3f} ms a file; perfect sharing of {cores} cores: {bound:.1f} images/s "
          f"({bound / ceiling:.3f} of the ceiling)")
    for r in rows:
        print(f"  {r['contender']:42s} {r['images_per_second_median']:7.1f} images/s  {r['of_ceiling']:.3f}")
    Path(args.out).write_text(json.dumps({
        "date": date.today().isoformat(), "machine": f"{platform.machine()}, {cores} cores",
        "command": " ".join(["python", "benchmarks/photo_schedule.py", *sys.argv[1:]]), "folder": made,
        "decode_ms_one_core": round(decode_ms, 4), "perfect_sharing_images_per_second": round(bound, 1),
        "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
