"""Each path against a bare loop, in the same run: how close scaletrain comes to the model's own step on this
machine, and where it stands against what a user would run instead.

Two settings, each contender in fresh processes, one after another, in turn, `--repeats` times:

* seed 000's: resnet18 at 56 px, batch 256, Adam 5e-5, fp32, on the 6,400 training rows of the Kaggle CSV that the
  peers' make_data.py writes. Contenders: a bare PyTorch loop over tensors already at the model's size (no
  augmentation; the model in its default memory format, and in channels_last), seed 000's own script,
  `scaletrain train` at its settings (with channels_last on and off), and `scaletrain.fit` on seed 000's own
  Dataset and model (see own_code.py). Figure: training images/s of the second epoch (the first has the warm-up).
* photos (with --photos and --timm-train): resnet18 at 64 px, batch 64, SGD 0.05, one epoch of a folder that
  photo_startup.py makes. Contenders: the bare loop over random tensors of that size, timm's train.py, and
  `scaletrain train` twice over an empty cache (the first run checks the files and decodes them while it
  trains, the second finds them decoded). Figures: the epoch's images/s, start-up excluded, and the first step
  after launch.

    python benchmarks/cpu_limit.py                                    # seed 000's settings (about 12 minutes)
    python benchmarks/cpu_limit.py --photos /tmp/scaletrain-photos-20000 --timm-train train.py --only photos
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from peers import SCALETRAIN_LINE, SEED000_LINE, SEEDS_AUGMENT, Contender, run, throughput  # noqa: E402

TIMM_LINE = r"Train: (\d+) \[\s*(\d+)/(\d+) .*\(\s*([\d.]+)s,\s*([\d.]+)/s\)"


def bare_loop(args: argparse.Namespace) -> None:
    """The model's own step: tensors at the model's size already in memory, shuffled, no augmentation."""
    import timm
    import torch
    from torch import nn

    torch.manual_seed(0)
    x = torch.randn(args.images, 3, args.size, args.size)
    y = torch.randint(0, 10, (args.images,))
    model = timm.create_model(args.model, num_classes=10)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.Adam(model.parameters(), lr=5e-5) if args.opt == "adam" else \
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    model.train()
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        for idx in torch.randperm(args.images).split(args.batch):
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        print(f"epoch {epoch}/{args.epochs} bare val_accuracy 0 {time.perf_counter() - t0:.3f}s", flush=True)


def seed000_contenders(peers: Path, data: Path, epochs: int, k: int) -> list[Contender]:
    py, me = sys.executable, str(Path(__file__).resolve())
    scaletrain = [py, "-m", "scaletrain", "train", "--data", str(data), "--model", "resnet18", "--image-size", "56",
                  "--batch-size", "256", "--optimizer", "adam", "--lr", "5e-5", "--weight-decay", "0", "--scheduler",
                  "constant", "--warmup-epochs", "0", "--augment", SEEDS_AUGMENT, "--epochs", str(epochs)]
    return [
        Contender("bare loop", [py, me, "bare", "--model", "resnet18", "--size", "56", "--batch", "256", "--opt",
                                "adam", "--images", "6400", "--epochs", str(epochs)], SCALETRAIN_LINE, 6400),
        Contender("bare loop, channels_last", [py, me, "bare", "--model", "resnet18", "--size", "56", "--batch",
                                               "256", "--opt", "adam", "--images", "6400", "--epochs", str(epochs),
                                               "--channels-last"], SCALETRAIN_LINE, 6400),
        Contender("seed 000's script", [py, str(peers / "seed000_accelerate.py"), "--data", str(data), "--out", ".",
                                        "--ep", str(epochs), "--model", "resnet18", "--bs", "256", "--image_size",
                                        "56", "--workers", "2"], SEED000_LINE, 6400),
        Contender("scaletrain train", [*scaletrain, "--output-dir", f"st-{k}"], SCALETRAIN_LINE, 6400),
        Contender("scaletrain train --no-channels-last", [*scaletrain, "--no-channels-last", "--output-dir",
                                                          f"st-contiguous-{k}"], SCALETRAIN_LINE, 6400),
        Contender("scaletrain.fit, seed 000's Dataset and model", [
            py, str(HERE / "own_code.py"), "fit-job", "--peers", str(peers), "--data", str(data), "--out",
            f"fit-{k}", "--epochs", str(epochs), "--channels-last"], SCALETRAIN_LINE, 6400),
    ]


def photo_rates(folder: Path, timm_train: Path, work: Path, env: dict, k: int) -> tuple[dict, dict]:
    """Images/s of one epoch of each photo contender (start-up excluded), and each one's first step after launch.
    scaletrain runs twice over an empty cache: its first run checks the files and decodes them while it trains,
    the second finds them decoded."""
    import shutil

    from photo_startup import run_scaletrain, run_timm

    py = sys.executable
    bare_cmd = [py, str(Path(__file__).resolve()), "bare", "--model", "resnet18", "--size", "64", "--batch", "64",
                "--opt", "sgd", "--images", "16000", "--epochs", "1"]
    bare = run(Contender("bare loop (photos)", bare_cmd, SCALETRAIN_LINE, 16000), 1200, work, env)
    bare_cl = run(Contender("bare loop, channels_last (photos)", [*bare_cmd, "--channels-last"], SCALETRAIN_LINE,
                            16000), 1200, work, env)
    cache = work / f"photo-cache-{k}"
    shutil.rmtree(cache, ignore_errors=True)
    first = run_scaletrain(folder, work, env, ["--cache-dir", str(cache)], f"photos-first-{k}")
    second = run_scaletrain(folder, work, env, ["--cache-dir", str(cache)], f"photos-second-{k}")
    theirs = run_timm(timm_train, folder, work, env, name=f"timm-{k}")
    rates = {"bare loop": throughput(bare), "bare loop, channels_last": throughput(bare_cl),
             "timm train.py": theirs.get("images_per_second"),
             "scaletrain train, first run": first.get("images_per_second"),
             "scaletrain train, second run": second.get("images_per_second")}
    starts = {"timm train.py": theirs.get("first_step_s"), "scaletrain train, first run": first.get("first_step_s"),
              "scaletrain train, second run": second.get("first_step_s")}
    return rates, starts


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "bare":
        p = argparse.ArgumentParser()
        for flag, kind, default in (("--model", str, "resnet18"), ("--size", int, 56), ("--batch", int, 256),
                                    ("--opt", str, "adam"), ("--images", int, 6400), ("--epochs", int, 2)):
            p.add_argument(flag, type=kind, default=default)
        p.add_argument("--channels-last", action="store_true")
        return bare_loop(p.parse_args(sys.argv[2:]))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", default=str(HERE.parent.parent / "shared" / "peers"))
    p.add_argument("--data-dir", default="/tmp/peerdata", help="where make_data.py writes the Kaggle CSVs")
    p.add_argument("--work-dir", default="/tmp/scaletrain-cpu-limit")
    p.add_argument("--photos", type=Path, help="a folder photo_startup.py made (train/ and val/)")
    p.add_argument("--timm-train", type=Path, help="timm's train.py (see photo_startup.py)")
    p.add_argument("--only", choices=("seed000", "photos"), help="one setting [default: both when --photos is "
                   "given, else seed 000's]")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--results", default=str(HERE / "results" / "cpu_limit.json"))
    args = p.parse_args()
    peers, work = Path(args.peers), Path(args.work_dir)
    import shutil

    shutil.rmtree(work, ignore_errors=True)  # run folders of an earlier run would be refused as finished
    work.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent / "src"),
                                                                       os.environ.get("PYTHONPATH", "")]))}
    # One setting run alone keeps the other's figures in the results file.
    results = Path(args.results)
    record = json.loads(results.read_text()) if results.is_file() else {"settings": {}}
    run_info = {"date": date.today().isoformat(), "machine": cpu_name(), "cores": os.cpu_count(),
                "command": "python benchmarks/cpu_limit.py " + " ".join(sys.argv[1:]), "repeats": args.repeats}
    if args.only in (None, "seed000"):
        data = Path(args.data_dir) / "digit-recognizer"
        if not (data / "train.csv").is_file():
            import subprocess

            subprocess.run([sys.executable, str(peers / "make_data.py"), args.data_dir], check=True)
        rates: dict[str, list[float]] = {}
        for k in range(args.repeats):
            for c in seed000_contenders(peers, data, 2, k):
                done = run(c, 900, work, env)
                if done.status != "ok":
                    raise SystemExit(f"{c.name}: {done.status}")
                rates.setdefault(c.name, []).append(throughput(done))  # type: ignore[arg-type]
        record["settings"]["seed000"] = {**run_info, **_table("seed 000's settings: resnet18 56 px, batch 256, "
                                                             "Adam, fp32", rates)}
    if args.only in (None, "photos") and args.photos:
        rates, starts = {}, {}
        for k in range(args.repeats):
            for got, into in zip(photo_rates(args.photos, args.timm_train, work, env, k), (rates, starts)):
                for name, value in got.items():
                    into.setdefault(name, []).append(value or float("nan"))
        record["settings"]["photos"] = {**run_info, **_table("photos: resnet18 64 px, batch 64, SGD, fp32, one "
                                                            "epoch", rates)}
        timm_start = statistics.median(starts["timm train.py"])
        record["settings"]["photos"]["first_step_after_launch"] = [
            {"contender": name, "seconds_median": statistics.median(v), "values": v,
             "vs_timm": statistics.median(v) / timm_start} for name, v in starts.items()]
        print("\n| contender | first step after launch (median) | values | vs timm |\n|---|---|---|---|")
        for r in record["settings"]["photos"]["first_step_after_launch"]:
            print(f"| {r['contender']} | {r['seconds_median']:.1f} s | {', '.join(f'{v:.1f}' for v in r['values'])} "
                  f"| {r['vs_timm']:.2f}x |")
    results.parent.mkdir(parents=True, exist_ok=True)
    tmp = results.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(results)
    print(f"wrote {results}")


def cpu_name() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (platform.processor() is often empty on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _table(title: str, rates: dict[str, list[float]]) -> dict:
    # The limit: the fastest bare loop (the model's own step, in whichever memory format is faster here).
    bare = max(statistics.median(v) for name, v in rates.items() if name.startswith("bare loop"))
    rows = [{"contender": name, "images_per_second_median": statistics.median(v), "values": v,
             "vs_bare_loop": statistics.median(v) / bare} for name, v in rates.items()]
    print(f"\n{title}\n\n| contender | images/s (median) | values | of the fastest bare loop |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['contender']} | {r['images_per_second_median']:.1f} | "
              f"{', '.join(f'{v:.1f}' for v in r['values'])} | {r['vs_bare_loop']:.3f} |")
    return {"title": title, "rows": rows}


if __name__ == "__main__":
    main()
