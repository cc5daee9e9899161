"""scaletrain against the seeds' own training scripts (../shared/peers, run unchanged), side by side on one machine.

The same data for everyone: the 8,000 / 2,000 split of genuine MNIST digits that the peers' make_data.py writes
(Kaggle CSVs for seed 000, IDX files for seeds 001 and 002). Each contender is a fresh process, the contenders
take turns (`--rounds`, the order reversed every other round), and each one's per-epoch lines are read as they
are printed. Two comparisons, in one table:

* equal settings (model, per-device batch, precision, optimizer): seed 000's convnext_small at 56 px, batch 256,
  Adam, against `scaletrain train` at those settings; seed 001's 512-channel CNN at batch 1024 with AdamW, against
  scaletrain's engine training the peer's own `create_net()` through `fit`. Figure: training images/s of the
  epochs after the first, and scaletrain's ratio to its peer.
* time to 98 % validation accuracy: each peer's own recipe (its defaults; `--peer-epochs N` runs N epochs and
  stops at 98 %) against `scaletrain train --data mnist8k --epochs 2`; wall clock from process start (start-up
  and data loading included) to the end of the first epoch at 98 % or more.

    python benchmarks/peers.py                            # both: about 40 minutes on 2 cores
    python benchmarks/peers.py --only to98 --peer-epochs 20
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

import _harness as h
import _peers

TARGET = 0.98


def contenders(which: str, data: Path, peers: Path, epochs_equal: int, peer_epochs: int) -> dict[str, dict]:
    """name -> command, the line its epochs print, the images an epoch trains, its peer (for scaletrain's rows)."""
    py, kaggle, idx = sys.executable, data / "digit-recognizer", data / "mnist8k"
    ep = [str(peer_epochs)] if peer_epochs else []
    seed000 = {"cmd": [py, str(peers / "seed000_accelerate.py"), "--data", str(kaggle), "--out", ".",
                       *(["--ep", *ep] if ep else [])], "line": _peers.SEED000_LINE, "images": 6400}
    seed001 = {"cmd": [py, str(peers / "seed001_accelerate_cnn.py"), "--data", str(idx),
                       *(["--epochs", *ep] if ep else [])], "line": _peers.SEED001_LINE, "images": 7168,
               "percent": True}  # its loader drops the last partial batch of 1024
    out = {"seed 000 (convnext_small 56 px, batch 256)": seed000, "seed 001 (512-channel CNN, batch 1024)": seed001}
    if which in ("all", "to98"):
        out["seed 002 (hand-written DDP CNN, batch 128)"] = {
            "cmd": [py, str(peers / "seed002_torch_ddp.py"), "--data", str(idx), *(["--epochs", *ep] if ep else [])],
            "line": _peers.SEED002_LINE, "images": 7936}
    if which in ("all", "throughput"):
        out["scaletrain, convnext_small at seed 000's settings"] = {
            "cmd": _peers.scaletrain_as_seed000(kaggle, epochs_equal, "st-convnext", "convnext_small"),
            "images": 6400, "peer": "seed 000 (convnext_small 56 px, batch 256)"}
        out["scaletrain.fit, seed 001's CNN at its settings"] = {
            "cmd": h.job(_peers.fit_seed001_net, peers=str(peers), data=str(idx), out="st-seed001",
                         epochs=epochs_equal),
            "images": 8000, "peer": "seed 001 (512-channel CNN, batch 1024)"}
    if which in ("all", "to98"):
        out["scaletrain's recipe (smallcnn, 2 epochs)"] = {
            "cmd": h.scaletrain("train", "--data", str(idx), "--epochs", "2", "--output-dir", "st-best"),
            "images": 8000}
    return out


def reached(c: dict):
    """A test of an output line: the peer's epoch at 98 % or more (with --peer-epochs it is stopped there)."""
    pattern = re.compile(c["line"])

    def test(line: str) -> bool:
        m = pattern.search(line)
        return m is not None and float(m.group(2)) / (100 if c.get("percent") else 1) >= TARGET
    return test


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="all", choices=("all", "throughput", "to98"))
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--epochs-equal", type=int, default=2, help="scaletrain's epochs in the equal-settings runs")
    p.add_argument("--peer-epochs", type=int, default=0, help="run every peer this many epochs instead of its own "
                   "default, stopping it at 98 %%")
    p.add_argument("--cap-seconds", type=float, default=1800, help="a contender still running is stopped here")
    p.add_argument("--peers", help="the seeds' scripts [default: ../shared/peers]")
    p.add_argument("--data-dir", default="/tmp/peerdata", help="where make_data.py writes the split")
    p.add_argument("--work-dir")
    p.add_argument("--out", help="the JSON record [default: results/peers.json]")
    args = p.parse_args()
    peers = _peers.peers(args.peers)
    if peers is None:
        raise SystemExit("seed000_accelerate.py not found: pass --peers")
    data, work = _peers.data(peers, Path(args.data_dir)), h.work_dir("peers", args.work_dir, fresh=False)
    chosen = contenders(args.only, data, peers, args.epochs_equal, args.peer_epochs)
    runs: dict[str, list[dict]] = {name: [] for name in chosen}
    for k, name in h.turns(chosen, args.rounds):
        c = chosen[name]
        for folder in ("st-convnext", "st-seed001", "st-best"):  # a finished run folder would be refused
            shutil.rmtree(work / folder, ignore_errors=True)
        r = h.run(c["cmd"], cwd=work, env=h.env(), timeout=args.cap_seconds,
                  stop=reached(c) if args.peer_epochs and "line" in c else None,
                  log=work / f"{k}-{list(chosen).index(name)}")
        if r.stopped != "timeout":  # one stopped at the cap keeps the epochs it ran
            r.check(name)
        found = h.epochs(r, c.get("line", h.EPOCH_LINE), c.get("percent", False))
        runs[name].append({"epochs": found, "images_per_second": h.images_per_second(found, c["images"]),
                           "to_target_s": next((e["wall_seconds"] for e in found if e["val_accuracy"] >= TARGET),
                                               None), "stopped": r.stopped})
        print(f"round {k + 1}, {name}: {len(found)} epoch(s), {runs[name][-1]['images_per_second'] or 0:.0f} "
              f"images/s, 98 % at {runs[name][-1]['to_target_s']}", flush=True)
    rows = []
    for name, rs in runs.items():
        rate = h.median(r["images_per_second"] for r in rs)
        peer = chosen[name].get("peer")
        first98 = [next((e["epoch"] for e in r["epochs"] if e["val_accuracy"] >= TARGET), None) for r in rs]
        rows.append({"contender": name, "images/s (epochs after the first)": rate,
                     "vs its peer": h.ratio(rate, h.median(r["images_per_second"] for r in runs[peer])) if peer
                     else None, "time to 98 %, s": h.median(r["to_target_s"] for r in rs) or "not reached",
                     "epoch": h.median(first98), "best val accuracy": max((e["val_accuracy"] for r in rs
                                                                           for e in r["epochs"]), default=None),
                     "epochs run": [len(r["epochs"]) for r in rs]})
    h.record("peers", rows, args.out, title="against the seeds' own scripts", runs=runs)


if __name__ == "__main__":
    h.main(main)
