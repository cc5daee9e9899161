"""One training script written four ways, timed side by side: a bare PyTorch loop, HF accelerate's loop, PyTorch
Lightning, and scaletrain.fit, on the same network and data, in the same run.

The workload is PyTorch's MNIST example: its network (two convolutions, dropout, two linear layers, log_softmax),
F.nll_loss, Adadelta at 1.0 with StepLR(1, 0.7) stepped per epoch, batch 64 per process, 3 epochs of the 8,000
embedded digits (in memory) with validation on the other 2,000 after each; scaletrain twice: with no DataLoader
workers and no tracker set by hand, and with its defaults (what a user gets). Each side runs in a fresh
process (2 processes under torchrun for the second table: accelerate, Lightning's ddp, scaletrain; the bare loop
is one process's), the sides in turn, the order reversed every other round, `--rounds` times. Figure: the last
epoch's training seconds (the training loop alone: from its first batch to the end of its last, no validation),
median per side, and each side's speed relative to scaletrain's.

    pip install lightning                       # the Lightning side (not a dependency of scaletrain)
    python benchmarks/four_ways.py --rounds 3
    python benchmarks/four_ways.py --rounds 5 --nproc 1 --sides bare,scaletrain,scaletrain-defaults
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EPOCHS, BATCH, SEED = 3, 64, 1


def _parts():
    sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "src")]
    from mnist_steplr import Digits, Net  # the example's own classes

    return Digits(0, 8000), Digits(8000, 10000), Net


def _say(epoch: int, seconds: float, accuracy: float) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"epoch": epoch, "train_seconds": seconds, "val_accuracy": accuracy}), flush=True)


def bare(out: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    train, val, Net = _parts()
    torch.manual_seed(SEED)
    model = Net()
    opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    loader, val_loader = DataLoader(train, BATCH, shuffle=True), DataLoader(val, 1000)
    for epoch in range(1, EPOCHS + 1):
        model.train()
        t0 = time.perf_counter()
        for x, y in loader:
            opt.zero_grad()
            F.nll_loss(model(x), y).backward()
            opt.step()
        seconds = time.perf_counter() - t0
        model.eval()
        with torch.no_grad():
            correct = sum(int((model(x).argmax(1) == y).sum()) for x, y in val_loader)
        sched.step()
        _say(epoch, seconds, correct / len(val))


def accelerate(out: str) -> None:
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    train, val, Net = _parts()
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(SEED)
    model = Net()
    opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    model, opt, loader, val_loader = accelerator.prepare(model, opt, DataLoader(train, BATCH, shuffle=True),
                                                         DataLoader(val, 1000))
    for epoch in range(1, EPOCHS + 1):
        model.train()
        t0 = time.perf_counter()
        for x, y in loader:
            opt.zero_grad()
            accelerator.backward(F.nll_loss(model(x), y))
            opt.step()
        seconds = time.perf_counter() - t0
        model.eval()
        correct = 0
        with torch.no_grad():
            for x, y in val_loader:
                guess, y = accelerator.gather_for_metrics((model(x).argmax(1), y))
                correct += int((guess == y).sum())
        sched.step()
        _say(epoch, seconds, correct / len(val))
    accelerator.end_training()


def lightning(out: str) -> None:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    train, val, Net = _parts()

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net, self.t0, self.seconds = Net(), 0.0, 0.0

        def training_step(self, batch, _):
            return F.nll_loss(self.net(batch[0]), batch[1])

        def validation_step(self, batch, _):
            self.log("val_accuracy", (self.net(batch[0]).argmax(1) == batch[1]).float().mean(), sync_dist=True)

        def configure_optimizers(self):
            opt = torch.optim.Adadelta(self.parameters(), lr=1.0)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)]

        def on_train_epoch_start(self):
            self.t0 = time.perf_counter()

        def on_validation_start(self):  # the epoch's training loop has ended
            self.seconds = time.perf_counter() - self.t0

        def on_train_epoch_end(self):
            _say(self.current_epoch + 1, self.seconds, float(self.trainer.callback_metrics["val_accuracy"]))

    torch.manual_seed(SEED)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = L.Trainer(max_epochs=EPOCHS, accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto",
                        num_sanity_val_steps=0, enable_progress_bar=False, enable_checkpointing=False, logger=False,
                        enable_model_summary=False, default_root_dir=out)
    trainer.fit(Module(), DataLoader(train, BATCH, shuffle=True), DataLoader(val, 1000))


def scaletrain_fit(out: str, defaults: bool = False) -> None:
    """`defaults`: nothing set beyond the run folder, the epochs, the batch and the seed (DataLoader workers and
    trackers as scaletrain decides them: what a user gets); else no workers and no tracker, set by hand."""
    import torch
    import torch.nn.functional as F

    import scaletrain

    train, val, Net = _parts()
    torch.manual_seed(SEED)
    config = scaletrain.TrainConfig()
    config.optim.epochs, config.optim.batch_size = EPOCHS, BATCH
    config.run.output_dir, config.run.seed = out, SEED
    if not defaults:
        config.data.num_workers, config.run.log_with = 0, "none"
    scaletrain.fit(Net(), train, val, config, loss_fn=F.nll_loss,
                   optimizer=lambda params: torch.optim.Adadelta(params, lr=1.0),
                   scheduler=scaletrain.Schedule(lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.7),
                                                 interval="epoch"))
    if int(os.environ.get("RANK", "0")) == 0:
        for row in csv.DictReader((Path(out) / "metrics.csv").open()):
            _say(int(row["epoch"]), float(row["epoch_seconds"]), float(row["val_accuracy"]))


SIDES = {"bare": bare, "accelerate": accelerate, "lightning": lightning, "scaletrain": scaletrain_fit,
         "scaletrain-defaults": lambda out: scaletrain_fit(out, defaults=True)}


def run_side(side: str, nproc: int, work: Path) -> dict:
    out = tempfile.mkdtemp(prefix=f"{side}-", dir=work)
    script = [str(Path(__file__).resolve()), "--side", side, "--out", out]
    command = [sys.executable, *script] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *script]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    assert proc.returncode == 0, f"{side} on {nproc}: {proc.stderr[-3000:]}"
    epochs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"epoch"')]
    return epochs[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one side, in its own process
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--nproc", type=int, choices=(1, 2), action="append",
                   help="the table(s) to make: 1 process, 2 processes [default: both]")
    p.add_argument("--sides", default="", help="comma-separated sides to run [default: all]: " + ", ".join(SIDES))
    p.add_argument("--work-dir", default="/tmp/scaletrain-four-ways")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "four_ways_cpu.json"))
    args = p.parse_args()
    if args.side:
        SIDES[args.side](args.out)
        return
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    plans = {1: ["bare", "accelerate", "lightning", "scaletrain", "scaletrain-defaults"],
             2: ["accelerate", "lightning", "scaletrain", "scaletrain-defaults"]}
    plans = {n: [s for s in sides if not args.sides or s in args.sides.split(",")]
             for n, sides in plans.items() if n in (args.nproc or plans)}
    runs: dict[str, dict[str, list[dict]]] = {str(n): {s: [] for s in sides} for n, sides in plans.items()}
    for k in range(args.rounds):
        for nproc, sides in plans.items():
            for side in (sides if k % 2 == 0 else sides[::-1]):
                last = run_side(side, nproc, work)
                runs[str(nproc)][side].append(last)
                print(f"round {k + 1}, {nproc} process(es), {side}: last epoch {last['train_seconds']:.3f} s, "
                      f"val accuracy {last['val_accuracy']:.4f}", flush=True)
    table = {}
    for nproc, sides in runs.items():
        medians = {s: statistics.median(r["train_seconds"] for r in rs) for s, rs in sides.items()}
        table[nproc] = {s: {"train_seconds": round(m, 3),  # >= 1: scaletrain at least as fast as this side
                            "scaletrain_speed_over_this": round(m / medians["scaletrain"], 3),
                            "val_accuracy": statistics.median(r["val_accuracy"] for r in sides[s])}
                        for s, m in medians.items()}
        print(f"\n{nproc} process(es): last epoch's training seconds, median of {args.rounds}")
        for s, row in table[nproc].items():
            print(f"  {s:11s} {row['train_seconds']:7.3f} s  scaletrain's speed / this side's "
                  f"{medians[s] / medians['scaletrain']:.3f}  val accuracy {row['val_accuracy']:.4f}")
    Path(args.results).write_text(json.dumps({
        "date": date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "command": " ".join(["python", "benchmarks/four_ways.py", *sys.argv[1:]]), "table": table, "runs": runs},
        indent=1) + "\n")


if __name__ == "__main__":
    main()
