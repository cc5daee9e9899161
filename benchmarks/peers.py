"""scaletrain against the seeds' own training scripts (../shared/peers), side by side on one machine.

Same data for everyone: the 8,000 / 2,000 split of genuine MNIST digits that the peers' make_data.py writes
(Kaggle CSVs for seed 000, IDX files for seeds 001 and 002). Each contender runs in fresh processes, one after
the other, and its per-epoch lines are read as they are printed.

Two comparisons:

* equal settings (same model, per-device batch, precision and optimizer): seed 000's convnext_small at 56x56
  with batch 256 and Adam, and seed 001's 512-channel CNN with batch 1024 and AdamW, trained by scaletrain
  (the latter through the Python API, with the peer's own `create_net`). Figure: steady-state training
  images/s (the first epoch, with its warm-up, left out).
* time to 98 % validation accuracy: every contender's own recipe (the peers' defaults, at most 20 epochs)
  against scaletrain's; wall clock from process start, start-up and data loading included, to the end of the
  first epoch that validates at 98 % or more.

    python benchmarks/peers.py                  # everything (about 40 minutes on a 2-core CPU)
    python benchmarks/peers.py --only to98      # one comparison
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = 0.98


@dataclass
class Contender:
    name: str
    cmd: list[str]
    pattern: str  # groups: epoch, validation accuracy, training seconds of the epoch
    images_per_epoch: int  # training images one epoch processes (the peers drop the last partial batch)
    percent: bool = False  # the peer prints accuracy in percent
    epochs: list[dict] = field(default_factory=list)
    wall_seconds: float = 0.0
    status: str = "ok"


def run(c: Contender, cap_seconds: float, log_dir: Path, env: dict[str, str], stop_at_target: bool = False
        ) -> Contender:
    """Run one contender, timestamping each epoch line against the process start; with `stop_at_target`, stop
    it at the first epoch that reaches the target accuracy."""
    log = (log_dir / f"{c.name.replace(' ', '_')}.log").open("w")
    start = time.perf_counter()
    proc = subprocess.Popen(c.cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=log_dir,
                            start_new_session=True)
    pattern = re.compile(c.pattern)
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            log.write(line)
            m = pattern.search(line)
            if m:
                acc = float(m.group(2)) / (100 if c.percent else 1)
                c.epochs.append({"epoch": len(c.epochs) + 1, "val_accuracy": acc,
                                 "train_seconds": float(m.group(3)), "wall_seconds": time.perf_counter() - start})
                print(f"  {c.name}: epoch {len(c.epochs)} val {acc:.4f} train {float(m.group(3)):.1f}s "
                      f"at {c.epochs[-1]['wall_seconds']:.0f}s", flush=True)
            if time.perf_counter() - start > cap_seconds:
                c.status = f"stopped at the {cap_seconds:.0f} s cap"
                break
            if stop_at_target and c.epochs and c.epochs[-1]["val_accuracy"] >= TARGET:
                c.status = f"stopped on reaching {TARGET:.0%}"
                break
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        c.wall_seconds = time.perf_counter() - start
        log.close()
    if proc.returncode not in (0, -signal.SIGKILL) or not c.epochs:
        c.status = f"failed (exit {proc.returncode}; see {log.name})"
    return c


def throughput(c: Contender) -> float | None:
    steady = [e["train_seconds"] for e in c.epochs[1:]] or [e["train_seconds"] for e in c.epochs]
    return c.images_per_epoch / statistics.median(steady) if steady else None


def time_to_target(c: Contender) -> tuple[float | None, int | None]:
    for e in c.epochs:
        if e["val_accuracy"] >= TARGET:
            return e["wall_seconds"], e["epoch"]
    return None, None


# -- the contenders --------------------------------------------------------------------------------------------
SCALETRAIN_LINE = r"^epoch (\d+)/\d+ .*val_accuracy ([\d.]+)\s+([\d.]+)s"
SEED000_LINE = r"Epoch (\d+), train loss \S+, val acc ([\d.]+), train_seconds ([\d.]+)"
SEED001_LINE = r"epoch【(\d+)】.*eval_metric= ([\d.]+)% train_seconds ([\d.]+)"
SEED002_LINE = r"\[epoch (\d+)\] accuracy: ([\d.]+) .*train_seconds ([\d.]+)"
SEEDS_AUGMENT = "hflip,vflip,brightness,contrast"  # seed 000's list; its resize and normalisation are built in


def contenders(which: str, data: Path, peers: Path, epochs_equal: int, peer_epochs: int = 0) -> list[Contender]:
    py, kaggle, idx = sys.executable, str(data / "digit-recognizer"), str(data / "mnist8k")
    ep = {"--ep": str(peer_epochs), "--epochs": str(peer_epochs)} if peer_epochs else {}
    scaletrain = [py, "-m", "scaletrain", "train"]
    out: list[Contender] = []
    if which in ("all", "throughput", "to98"):
        # Each peer's run is its own recipe and, for seeds 000 and 001, also the equal-settings reference.
        out += [
            Contender("seed000 (convnext_small 56px b256)", [py, str(peers / "seed000_accelerate.py"),
                      "--data", kaggle, "--out", ".", *_flag(ep, "--ep")], SEED000_LINE, 6400),
            Contender("seed001 (512-channel CNN b1024)", [py, str(peers / "seed001_accelerate_cnn.py"),
                      "--data", idx, *_flag(ep, "--epochs")], SEED001_LINE, 7168, percent=True),
        ]
    if which in ("all", "to98"):
        out.append(Contender("seed002 (hand-written DDP CNN b128)", [py, str(peers / "seed002_torch_ddp.py"),
                             "--data", idx, *_flag(ep, "--epochs")], SEED002_LINE, 7936))
    if which in ("all", "throughput"):
        out += [
            Contender("scaletrain convnext_small 56px b256", [
                *scaletrain, "--data", kaggle, "--model", "convnext_small", "--image-size", "56",
                "--batch-size", "256", "--optimizer", "adam", "--lr", "5e-5", "--weight-decay", "0",
                "--scheduler", "constant", "--warmup-epochs", "0", "--augment", SEEDS_AUGMENT,
                "--epochs", str(epochs_equal), "--output-dir", "st-convnext"], SCALETRAIN_LINE, 6400),
            Contender("scaletrain seed001's CNN b1024", [
                py, str(Path(__file__).resolve()), "fit-seed001-net", "--data", idx, "--peers", str(peers),
                "--epochs", str(epochs_equal)], SCALETRAIN_LINE, 8000),
        ]
    if which in ("all", "to98"):
        out.append(Contender("scaletrain best recipe (smallcnn)", [
            *scaletrain, "--data", idx, "--epochs", "2", "--output-dir", "st-best"], SCALETRAIN_LINE, 8000))
    return out


def _flag(values: dict[str, str], name: str) -> list[str]:
    return [name, values[name]] if name in values else []


def fit_seed001_net(args: argparse.Namespace) -> None:
    """scaletrain's engine on seed 001's own network and optimiser settings (equal-settings comparison)."""
    sys.path.insert(0, str(Path(args.peers).resolve()))
    from seed001_accelerate_cnn import create_net

    from scaletrain import DataConfig, OptimConfig, RunConfig, TrainConfig, fit, load_image_sets

    cfg = TrainConfig(data=DataConfig(data=args.data, augment="none"),
                      optim=OptimConfig(epochs=args.epochs, batch_size=1024, optimizer="adamw", lr=25 * 1e-4,
                                        weight_decay=0.01, scheduler="onecycle", warmup_epochs=0.3 * args.epochs),
                      run=RunConfig(output_dir="st-seed001-net"))
    train, val = load_image_sets(cfg.data)
    fit(create_net(), train, val, cfg, model_name="seed001 CNN")


# -- report ----------------------------------------------------------------------------------------------------
def report(results: list[Contender], meta: dict) -> str:
    by = {c.name: c for c in results}
    lines = [f"{meta['date']}, {meta['hardware']}, torch {meta['torch']}", ""]
    pairs = [("seed000 (convnext_small 56px b256)", "scaletrain convnext_small 56px b256"),
             ("seed001 (512-channel CNN b1024)", "scaletrain seed001's CNN b1024")]
    if any(a in by and b in by for a, b in pairs):
        lines += ["Equal settings, steady-state training throughput (epochs after the first):", "",
                  "| model | peer images/s | scaletrain images/s | ratio |", "|---|---|---|---|"]
        for a, b in pairs:
            if a in by and b in by:
                ta, tb = throughput(by[a]), throughput(by[b])
                ratio = f"{tb / ta:.2f}x" if ta and tb else "n/a"
                lines.append(f"| {a} | {ta or 0:,.0f} | {tb or 0:,.0f} | {ratio} |")
        lines.append("")
    to98 = [c for c in results if "best recipe" in c.name or c.name.startswith("seed")]
    if any("best recipe" in c.name for c in to98):
        lines += [f"Time to {TARGET:.0%} validation accuracy, own recipes, wall clock from process start:", "",
                  "| contender | time to 98 % | epoch | best accuracy | epochs run | status |",
                  "|---|---|---|---|---|---|"]
        for c in to98:
            t, ep = time_to_target(c)
            best = max((e["val_accuracy"] for e in c.epochs), default=0.0)
            lines.append(f"| {c.name} | {f'{t:.1f} s' if t else 'not reached'} | {ep or ''} | {best:.4f} | "
                         f"{len(c.epochs)} | {c.status} |")
        ours = next(c for c in to98 if "best recipe" in c.name)
        t_ours, _ = time_to_target(ours)
        peer_times = [t for c in to98 if c is not ours for t in [time_to_target(c)[0]] if t]
        if t_ours and peer_times:
            lines += ["", f"Fastest peer to {TARGET:.0%}: {min(peer_times):.1f} s; scaletrain {t_ours:.1f} s: "
                          f"{min(peer_times) / t_ours:.1f}x sooner."]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode")
    inner = sub.add_parser("fit-seed001-net")
    for a in ("--data", "--peers"):
        inner.add_argument(a, required=True)
    inner.add_argument("--epochs", type=int, default=2)
    p.add_argument("--only", default="all", choices=("all", "throughput", "to98"))
    p.add_argument("--peers", default=str(ROOT.parent / "shared" / "peers"), help="the seeds' scripts")
    p.add_argument("--data-dir", default="/tmp/peerdata", help="where make_data.py writes the shared split")
    p.add_argument("--work-dir", default="/tmp/scaletrain-peers", help="run folders and logs")
    p.add_argument("--epochs-equal", type=int, default=2, help="scaletrain's epochs in the equal-settings runs")
    p.add_argument("--cap-seconds", type=float, default=1800, help="a contender still running is stopped here")
    p.add_argument("--select", default="", help="comma-separated parts of contender names to run (default: all)")
    p.add_argument("--peer-epochs", type=int, default=0, help="run every peer for this many epochs (at most 20) "
                   "instead of its own default, stopping it once it reaches 98 %%")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "peers_cpu.json"))
    args = p.parse_args()
    if args.mode == "fit-seed001-net":
        return fit_seed001_net(args)

    import torch

    peers, data = Path(args.peers).resolve(), Path(args.data_dir)
    if not (data / "mnist8k").is_dir():
        subprocess.run([sys.executable, str(peers / "make_data.py"), str(data)], check=True)
    work = Path(args.work_dir)
    if work.exists():
        import shutil

        shutil.rmtree(work)
    work.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    results = []
    chosen = [c for c in contenders(args.only, data, peers, args.epochs_equal, args.peer_epochs)
              if not args.select or any(part in c.name for part in args.select.split(","))]
    for c in chosen:
        print(f"running {c.name}", flush=True)
        results.append(run(c, args.cap_seconds, work, env, stop_at_target=bool(args.peer_epochs)))
    meta = {"date": date.today().isoformat(), "torch": torch.__version__,
            "hardware": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores".strip(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    text = report(results, meta)
    print("\n" + text)
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps({**meta, "contenders": [
        {"name": c.name, "cmd": c.cmd[1:], "epochs": c.epochs, "wall_seconds": c.wall_seconds,
         "images_per_epoch": c.images_per_epoch, "throughput": throughput(c), "status": c.status,
         "time_to_98": time_to_target(c)[0]} for c in results], "report": text}, indent=2) + "\n")


if __name__ == "__main__":
    main()
