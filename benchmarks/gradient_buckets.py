"""The memory a Step with several optimizers costs to average its gradients over 2 processes: each process's peak
resident memory over 3 training steps of two 8192 x 8192 linear networks (67 M parameters each, 268 MB of fp32
gradients each) trained by SGD, each stepped by the step itself, at this checkout and at an earlier commit (a git
worktree), the two alternated. Before buckets the gradients were averaged through one buffer as large as the
optimizer's; now through 25-MB buckets, two in flight.

    python benchmarks/gradient_buckets.py --base f08dc14 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def job() -> None:
    """One run, in a worker of torchrun: its peak resident memory in MB written beside the run."""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    import scaletrain

    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(8192, 8192), nn.Linear(8192, 8192)

    class TwoOptimizers(scaletrain.Step):
        def optimizers(self, model):
            # plain SGD: its update makes no temporaries, so the peak is the averaging's (Adam's foreach update
            # allocates its own copies of the state, which would hide it)
            return {"a": torch.optim.SGD(model.a.parameters(), lr=1e-3),
                    "b": torch.optim.SGD(model.b.parameters(), lr=1e-3)}

        def train_step(self, model, batch):
            x, = batch
            self.optimize("a", model.a(x).square().mean())
            self.optimize("b", model.b(x).square().mean())
            return model.a(x).mean().detach() * 0

    cfg = scaletrain.TrainConfig()
    cfg.optim.epochs, cfg.optim.batch_size, cfg.data.num_workers = 1, 4, 0
    scaletrain.fit(Pair(), TensorDataset(torch.randn(24, 8192)), None, cfg, step=TwoOptimizers())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(os.environ["PEAK_DIR"], f"rank-{os.environ['RANK']}.txt").write_text(f"{peak:.0f}")


def run(src: Path) -> float:
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "PYTHONPATH": str(src), "PEAK_DIR": out, "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        __file__, "--job"], env=env, check=True, capture_output=True)
        return max(float(p.read_text()) for p in Path(out).glob("rank-*.txt"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="f08dc14", help="the earlier commit to compare with")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.job:
        return job()
    base = Path(tempfile.mkdtemp()) / "base"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.base], check=True,
                   capture_output=True)
    try:
        peaks: dict[str, list[float]] = {"base": [], "now": []}
        for r in range(args.rounds):
            for side in (("base", "now") if r % 2 == 0 else ("now", "base")):
                peaks[side].append(run(base / "src" if side == "base" else ROOT / "src"))
                print(side, peaks[side][-1], flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=True)
    a, b = statistics.median(peaks["base"]), statistics.median(peaks["now"])
    print(f"| side | peak resident MB per process (median of {args.rounds}) |\n|---|---|\n"
          f"| {args.base} (one buffer) | {a:.0f} |\n| now (25-MB buckets) | {b:.0f} |\n| saved | {a - b:.0f} |")
    Path(ROOT / "benchmarks" / "results").mkdir(exist_ok=True)
    (ROOT / "benchmarks" / "results" / "gradient_buckets.json").write_text(json.dumps(
        {"base": args.base, "peaks_mb": peaks, "median_base": a, "median_now": b}, indent=1))


if __name__ == "__main__":
    main()
