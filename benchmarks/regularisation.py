"""Whether the regularisation recipe pays: validation accuracy with and without it, same model, data and epochs.

A small-data regime where a model overfits: the first --train images of genuine MNIST (the t10k set in
../shared/datasets/mnist-t10k) for training and the last --val for validation, written once as an .npz. For each
seed, two runs of

    scaletrain train --data SUBSET.npz --model smallcnn --epochs E --batch-size 64 [recipe] --seed S

- baseline: the default digits recipe (random translation), nothing else;
- one regulariser at a time (randaugment 2,5; random erasing 0.25; mixup 0.2 with cutmix 1.0; label smoothing 0.1;
  a weight average of decay 0.99, whose best accuracy is reported beside the raw weights');
- regularised: all of them together.

Records the best and final validation accuracy of each run and the medians per recipe, as JSON.

    python benchmarks/regularisation.py                        # 1000 training images, 60 epochs, 2 seeds
    python benchmarks/regularisation.py --epochs 2 --seeds 1 --out /tmp/smoke.json
    python benchmarks/regularisation.py --cost                 # what each adds to making a batch, CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
MNIST = HERE.parent.parent / "shared" / "datasets" / "mnist-t10k"
RECIPES = {
    "baseline": [],
    "randaugment": ["--randaugment", "2,5"],
    "random_erasing": ["--random-erasing", "0.25"],
    "mixup_cutmix": ["--mixup", "0.2", "--cutmix", "1.0"],
    "label_smoothing": ["--label-smoothing", "0.1"],
    "ema": ["--ema-decay", "0.99"],
    "regularised": ["--randaugment", "2,5", "--random-erasing", "0.25", "--mixup", "0.2", "--cutmix", "1.0",
                    "--label-smoothing", "0.1", "--ema-decay", "0.99"],
}


def make_subset(path: Path, n_train: int, n_val: int) -> Path:
    sys.path.insert(0, str(HERE.parent / "src"))
    from scaletrain.data.sources.idx import read_idx_folder

    if path.is_file():
        return path
    images, labels = read_idx_folder(MNIST)["t10k"]
    np.savez(path, images=images[:n_train], labels=labels[:n_train], val_images=images[-n_val:],
             val_labels=labels[-n_val:])
    return path


def run(data: Path, out: Path, recipe: str, seed: int, epochs: int) -> dict:
    cmd = [sys.executable, "-m", "scaletrain", "train", "--data", str(data), "--model", "smallcnn", "--epochs",
           str(epochs), "--batch-size", "64", "--seed", str(seed), "--output-dir", str(out), *RECIPES[recipe]]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    summary = json.loads((out / "summary.json").read_text())
    row = {"recipe": recipe, "seed": seed, "best_val_accuracy": summary["best_val_accuracy"],
           "final_val_accuracy": summary["final_val_accuracy"], "seconds": time.perf_counter() - t0,
           "command": " ".join(cmd[1:])}
    if "best_ema_val_accuracy" in summary:
        row["best_ema_val_accuracy"] = summary["best_ema_val_accuracy"]
    print(json.dumps(row), flush=True)
    return row


def cost(repeats: int = 7) -> None:
    """What each regulariser adds to making one training batch on the CPU: 128 colour images of 160 px,
    RandomResizedCrop to 128 and flip, the median of `repeats` (the first two left out as warm-up)."""
    import torch

    sys.path.insert(0, str(HERE.parent / "src"))
    from scaletrain.data.transforms import Preprocess, to_model_input
    from scaletrain.data.regularise import Regularise

    x = torch.randint(0, 256, (128, 3, 160, 160), dtype=torch.uint8)
    pre = Preprocess(3, 128, [0.5] * 3, [0.25] * 3, "photo", 0.875, (0.08, 1.0), (3 / 4, 4 / 3))

    def batch_ms(reg) -> float:
        seconds = []
        for i in range(repeats):
            g = torch.Generator().manual_seed(i)
            t0 = time.perf_counter()
            to_model_input(x, pre, True, ("rrc", "hflip"), g, reg)
            seconds.append(time.perf_counter() - t0)
        return statistics.median(seconds[2:]) * 1e3

    base = batch_ms(None)
    print(f"rrc,hflip alone: {base:.0f} ms per batch of 128 ({torch.get_num_threads()} threads)")
    for name, reg in [("--randaugment 2,9", Regularise(randaugment=(2, 9))),
                      ("--randaugment trivial", Regularise(randaugment=(1, -1))),
                      ("--random-erasing 0.25", Regularise(random_erasing=0.25))]:
        ms = batch_ms(reg)
        print(f"{name}: {ms:.0f} ms per batch, +{(ms - base) / 128:.2f} ms an image")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cost", action="store_true", help="only time what each regulariser adds to a batch")
    p.add_argument("--train", type=int, default=1000)
    p.add_argument("--val", type=int, default=2000)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated, from: " + ", ".join(RECIPES))
    p.add_argument("--work-dir", default="/tmp/scaletrain-regularisation")
    p.add_argument("--out", default=str(HERE / "results" / "regularisation_cpu.json"))
    args = p.parse_args()
    if args.cost:
        return cost()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    data = make_subset(work / f"mnist-{args.train}-{args.val}.npz", args.train, args.val)
    recipes = args.recipes.split(",")
    rows = [run(data, work / f"{recipe}-{seed}-{args.epochs}", recipe, seed, args.epochs)
            for seed in range(args.seeds) for recipe in recipes]
    medians = {}
    for recipe in recipes:
        mine = [r for r in rows if r["recipe"] == recipe]
        medians[recipe] = {k: statistics.median(r[k] for r in mine)
                           for k in ("best_val_accuracy", "final_val_accuracy", "best_ema_val_accuracy")
                           if k in mine[0]}
    result = {"date": time.strftime("%Y-%m-%d"), "train_images": args.train, "val_images": args.val,
              "epochs": args.epochs, "seeds": args.seeds, "runs": rows, "medians": medians}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(medians, indent=1))


if __name__ == "__main__":
    main()
