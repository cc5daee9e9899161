"""A folder of photos, scaletrain against timm's train.py in the same run: the first training step after launch,
the epoch's images/s, the whole command and its peak memory.

Makes (once, kept) a class folder of photo-like JPEGs of 400 x 300 px (_data.photo_folder: smooth colour fields,
edges and grain, quality 90, about ImageNet's shape and bytes), 80 % in train/ and 20 % in val/, and reads every
file once so that every contender finds the page cache warm. Then one epoch of resnet18 at 64 px, batch 64, SGD lr
0.05 on the CPU, each contender a fresh process, taking turns for `--rounds` rounds (the order reversed every other
round): timm's train.py (`--device cpu --no-prefetcher -j 2`), and `scaletrain train` twice over one empty
`--cache-dir` (its first run checks every file and decodes the images while its first epoch trains; the second
finds them decoded; with --first-step-only the second runs start from a cache that one whole run, untimed, filled
before the rounds). Every contender runs from compiled bytecode, as an installed package has it (scaletrain's src/
is compiled first; PYTHONDONTWRITEBYTECODE is unset for the runs). On request also: scaletrain streamed
(`--data-on-device no`), on 2 processes, and the limit, the bare loop on random tensors of that size
(harness.bare_loop, default memory format and channels_last).

Figures: the first step, seconds from launch to the line that ends it (timm's first `Train: 0 [`, scaletrain's
`first step done`) as seen from here; images/s (timm's running average over the epoch, scaletrain's metrics.csv,
the bare loop's epoch); the whole command and the peak resident memory of its largest process; medians, and the
ratios to timm's. Before the runs, the milliseconds per file on one core of the first run's check and of decodes.

timm's train.py is not part of the timm package: take it from huggingface/pytorch-image-models at the commit of
the installed timm (aa4b5850 for timm 1.0.x) and pass its path.

    python benchmarks/photo_startup.py --timm-train train.py                          # 20,000 JPEGs, 1 round
    python benchmarks/photo_startup.py --timm-train train.py --files 5000 --rounds 2 --first-step-only
    python benchmarks/photo_startup.py --timm-train train.py --rounds 3 --limit --streamed --nproc2
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _data
import _harness as h
import _peers


def per_file_ms(root: Path, count: int = 2000) -> dict[str, float]:
    """Milliseconds per file on one core over `count` evenly spaced files: the check of a large folder's first run
    (header and end marker), the 1/8-scale decode that checks any other file, and the decodes to the stored size of
    a 64 px and of a 224 px crop."""
    from scaletrain.data.images import check_image, read_image

    files = sorted(root.rglob("*.jpg"))
    files = files[::max(1, len(files) // count)][:count]
    ways = {"header and end marker": check_image, "decoded at 1/8 scale": read_image,
            "decoded to 73 px (64 px crop)": lambda f: read_image(f, 3, 73, "photo"),
            "decoded to 256 px (224 px crop)": lambda f: read_image(f, 3, 256, "photo")}
    times = {}
    for name, way in ways.items():
        t0 = time.perf_counter()
        for f in files:
            way(f)
        times[name] = 1000 * (time.perf_counter() - t0) / len(files)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--timm-train", required=True, type=Path, help="timm's train.py (see above)")
    p.add_argument("--files", type=int, default=20000, help="JPEGs to make [default: 20000]")
    p.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "scaletrain-photos",
                   help="the folder is made and kept at <data-dir>-<files>")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--first-step-only", action="store_true", help="stop each command once its first step is done")
    p.add_argument("--streamed", action="store_true", help="also scaletrain streamed (--data-on-device no)")
    p.add_argument("--nproc2", action="store_true", help="also scaletrain on 2 processes (a second run)")
    p.add_argument("--limit", action="store_true", help="also the bare loop on random tensors (the limit)")
    p.add_argument("--work-dir")
    p.add_argument("--out", help="the JSON record [default: results/photo_startup.json]")
    args = p.parse_args()
    if not args.timm_train.is_file():
        raise SystemExit(f"--timm-train {args.timm_train}: no such file")
    root = args.data_dir.with_name(f"{args.data_dir.name}-{args.files}")
    made = _data.photo_folder(root, args.files)
    print(f"folder {root}: {made['files']} JPEGs ({made['train']} train), {made['mean_kb']:.1f} KB each; page cache "
          f"warmed: {_data.warm(root):.0f} MB read", flush=True)
    costs = per_file_ms(root)
    print("per file, one core: " + ", ".join(f"{k} {v:.3f} ms" for k, v in costs.items()), flush=True)
    work, job, env = h.work_dir("photo-startup", args.work_dir), _peers.PhotoJob(), h.env(PYTHONDONTWRITEBYTECODE=None)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(h.ROOT / "src")], check=True)
    if filled := (work / "cache-filled" if args.first_step_only else None):  # the second runs' cache: one whole run
        h.run(job.scaletrain(root, work / "filling", "--cache-dir", str(filled)), cwd=work, env=env).check("filling")
    bare = {"model": "resnet18", "size": 64, "batch": 64, "images": made["train"], "epochs": 1, "opt": "sgd"}
    ours = {"scaletrain, first run": [], "scaletrain, second run": [],  # one cache: the first run fills it
            **({"scaletrain, streamed": ["--data-on-device", "no"]} if args.streamed else {}),
            **({"scaletrain --nproc 2, second run": ["--nproc", "2"]} if args.nproc2 else {})}
    sides = ["timm train.py", "scaletrain", *(["bare loop", "bare loop, channels_last"] if args.limit else [])]
    runs: dict[str, list[dict]] = {}

    def measure(name: str, cmd: list[str], folder: Path | None, k: int) -> None:
        first = _peers.TIMM_FIRST_STEP if name.startswith("timm") else _peers.FIRST_STEP
        r = h.run(cmd, cwd=work, env=env, memory=True, merge=True, stop=first if args.first_step_only else None,
                  log=work / f"{k}-{sum(map(len, runs.values()))}").check(name)
        rate = _peers.timm_images_per_second(r) if name.startswith("timm") else \
            h.images_per_second(h.epochs(r), made["train"]) if name.startswith("bare") else \
            None if args.first_step_only else h.metrics(folder)[0]["images_per_second"]
        runs.setdefault(name, []).append({"first_step_s": r.first(first), "images_per_second": rate,
                                          "whole_command_s": r.seconds, "peak_rss_mib": r.peak_rss_mib})
        print(f"round {k + 1}, {name}: {runs[name][-1]}", flush=True)

    for k, side in h.turns(sides, args.rounds):
        if side == "timm train.py":
            measure(side, job.timm(args.timm_train, root, work / f"timm-{k}"), None, k)
        elif side.startswith("bare"):
            measure(side, h.job(h.bare_loop, channels_last=side.endswith("channels_last"), **bare), None, k)
        else:
            for i, (name, extra) in enumerate(ours.items()):
                folder = work / f"scaletrain-{k}-{i}"
                cache = filled if filled and "second run" in name else work / f"cache-{k}"
                measure(name, job.scaletrain(root, folder, "--cache-dir", str(cache), *extra), folder, k)
    timm = {key: h.median(r[key] for r in runs["timm train.py"]) for key in ("first_step_s", "images_per_second")}
    limit = max((h.median(r["images_per_second"] for r in v) for n, v in runs.items() if n.startswith("bare")),
                default=None)
    rows = []
    for name, values in runs.items():
        med = {key: h.median(r[key] for r in values) for key in values[0]}
        rows.append({"contender": name, "first step after launch, s": med["first_step_s"],
                     "values": [r["first_step_s"] for r in values],
                     "vs timm": h.ratio(med["first_step_s"], timm["first_step_s"]),
                     "images/s": med["images_per_second"], "of the limit": h.ratio(med["images_per_second"], limit),
                     "images/s vs timm": h.ratio(med["images_per_second"], timm["images_per_second"]),
                     "whole command, s": med["whole_command_s"], "peak RSS, MiB": med["peak_rss_mib"]})
    h.record("photo_startup", rows, args.out, title=f"{args.files} JPEGs of 400x300, resnet18 64 px, batch 64, SGD, "
             f"one epoch; medians of {args.rounds} round(s)", made=made, per_file_ms_one_core=costs, runs=runs)


if __name__ == "__main__":
    h.main(main)
