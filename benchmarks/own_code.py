"""Seed 000's own training script against the same Dataset and model through `scaletrain.fit`, at equal settings, in
the same run: what a user pays for handing their loop to scaletrain.

Both train seed 000's `MiniDataSet` (dict items, its albumentations pipeline, 2 DataLoader workers) and `TimmModel`
(resnet18 at 56 px, from ../shared/peers, imported unchanged) with Adam at 5e-5, batch 256, fp32, on the 6,400 /
1,600 split of the Kaggle CSV that the peers' make_data.py writes. The script runs as written; scaletrain gets the
same objects through `fit(..., optimizer=...)`, once with its defaults (channels_last on) and once with
channels_last off, the script's own memory format. Figure: training images/s of each epoch after the first (the
first has the warm-up), from the script's own per-epoch training seconds and from scaletrain's metrics.csv.
Contenders run one after another in fresh processes, in turn, `--repeats` times.

    python benchmarks/own_code.py                      # 3 repeats of 2 epochs: about 15 minutes on a 2-core CPU
    python benchmarks/own_code.py --repeats 1 --epochs 2
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import re
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEED000_LINE = re.compile(r"Epoch (\d+), .*train_seconds ([\d.]+)")
TRAIN_ROWS = 6400  # 80 % of make_data.py's 8,000 rows, as seed 000's script splits them; batch 256 divides it


def fit_job(args: argparse.Namespace) -> None:
    """The scaletrain side, in a process of its own: seed 000's classes through fit."""
    sys.path.insert(0, args.peers)
    import pandas as pd
    import torch

    import scaletrain
    from seed000_accelerate import MiniDataSet, TimmModel, get_transform

    table = pd.read_csv(Path(args.data) / "train.csv")
    images, labels = table.iloc[:, 1:].values.reshape(-1, 28, 28), table.iloc[:, 0].values
    n = int(len(images) * 0.8)
    config = scaletrain.TrainConfig()
    config.optim.epochs, config.optim.batch_size = args.epochs, args.batch_size
    config.data.num_workers = 2
    config.model.channels_last = args.channels_last
    config.run.output_dir, config.run.mixed_precision = args.out, args.mixed_precision
    scaletrain.fit(TimmModel(args.model, 10), MiniDataSet(images[:n], labels[:n], get_transform(args.image_size, True)),
                   MiniDataSet(images[n:], labels[n:], get_transform(args.image_size, False)), config,
                   optimizer=lambda params: torch.optim.Adam(params, lr=5e-5))


def seed000(peers: Path, data: Path, work: Path, epochs: int) -> list[float]:
    """Images/s of each epoch after the first, from the script's own train_seconds lines."""
    proc = subprocess.run([sys.executable, str(peers / "seed000_accelerate.py"), "--data", str(data), "--out",
                           str(work), "--ep", str(epochs), "--model", "resnet18", "--bs", "256", "--image_size", "56",
                           "--workers", "2"], capture_output=True, text=True, cwd=work)
    if proc.returncode:
        raise SystemExit(f"seed 000's script failed: {proc.stderr[-2000:]}")
    seconds = [float(m.group(2)) for m in SEED000_LINE.finditer(proc.stdout)]
    return [TRAIN_ROWS / s for s in seconds[1:]]


def scaletrain_fit(peers: Path, data: Path, work: Path, epochs: int, channels_last: bool, k: int) -> list[float]:
    out = work / f"fit-{'cl' if channels_last else 'contiguous'}-{k}"
    proc = subprocess.run([sys.executable, __file__, "fit-job", "--peers", str(peers), "--data", str(data), "--out",
                           str(out), "--epochs", str(epochs), *(["--channels-last"] if channels_last else [])],
                          capture_output=True, text=True, cwd=work)
    if proc.returncode:
        raise SystemExit(f"scaletrain.fit failed: {proc.stderr[-2000:]}")
    with (out / "metrics.csv").open() as f:
        return [float(r["images_per_second"]) for r in csv.DictReader(f)][1:]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "fit-job":
        p = argparse.ArgumentParser()
        for flag in ("--peers", "--data", "--out"):
            p.add_argument(flag, required=True)
        p.add_argument("--epochs", type=int, default=2)
        p.add_argument("--channels-last", action="store_true")
        p.add_argument("--model", default="resnet18")
        p.add_argument("--image-size", type=int, default=56)
        p.add_argument("--batch-size", type=int, default=256)
        p.add_argument("--mixed-precision", default="no")
        return fit_job(p.parse_args(sys.argv[2:]))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", default=str(ROOT.parent / "shared" / "peers"))
    p.add_argument("--data-dir", default="/tmp/peerdata", help="where make_data.py writes the Kaggle CSVs")
    p.add_argument("--work-dir", default="/tmp/scaletrain-own-code")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "own_code_cpu.json"))
    args = p.parse_args()
    peers, data, work = Path(args.peers), Path(args.data_dir), Path(args.work_dir)
    if not (data / "digit-recognizer" / "train.csv").is_file():
        subprocess.run([sys.executable, str(peers / "make_data.py"), str(data)], check=True)
    data = data / "digit-recognizer"
    work.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[float]] = {"seed 000's script": [], "scaletrain.fit": [], "scaletrain.fit, channels_last off": []}
    for k in range(args.repeats):
        runs["seed 000's script"] += seed000(peers, data, work, args.epochs)
        runs["scaletrain.fit"] += scaletrain_fit(peers, data, work, args.epochs, True, k)
        runs["scaletrain.fit, channels_last off"] += scaletrain_fit(peers, data, work, args.epochs, False, k)
        print(f"repeat {k + 1}: " + "; ".join(f"{name} {v[-1]:.1f}" for name, v in runs.items()), flush=True)
    script = statistics.median(runs["seed 000's script"])
    rows = [{"contender": name, "images_per_second_median": statistics.median(v), "values": v,
             "vs_script": statistics.median(v) / script} for name, v in runs.items()]
    print("\n| contender | images/s (median) | values | vs seed 000's script |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['contender']} | {r['images_per_second_median']:.1f} | "
              f"{', '.join(f'{v:.1f}' for v in r['values'])} | {r['vs_script']:.3f}x |")
    record = {"date": date.today().isoformat(), "machine": platform.processor() or platform.machine(),
              "cores": __import__("os").cpu_count(), "command": " ".join(["python", "benchmarks/own_code.py",
                                                                             *sys.argv[1:]]),
              "settings": "resnet18 56px, batch 256, Adam 5e-5, fp32, 2 workers, 6,400 training images",
              "epochs": args.epochs, "repeats": args.repeats, "rows": rows, "finished": time.strftime("%H:%M")}
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
