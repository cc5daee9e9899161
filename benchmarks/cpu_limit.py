"""Each way of training at seed 000's settings against the model's own step, in the same run: how close scaletrain
comes to the limit of this machine, and where it stands against seed 000's own script.

Seed 000's settings: resnet18 at 56 px, batch 256, Adam 5e-5, fp32, the 6,400 training rows of the Kaggle CSV
that the peers' make_data.py writes. Contenders, each a fresh process, taking turns (the order reversed every
other round): the bare loop (harness.bare_loop: random tensors at the model's size, no augmentation; in the
default memory format and in channels_last; the faster is the limit), seed 000's script, `scaletrain train` at its
settings (channels_last on, the default, and off), and seed 000's own Dataset and model handed to `scaletrain.fit`
(channels_last on and off). Figure: training images/s of the epochs after the first, median over the rounds.

    python benchmarks/cpu_limit.py                       # 2 rounds of 2 epochs: about 15 minutes on 2 cores
    python benchmarks/cpu_limit.py --rounds 3 --only "bare loop, channels_last,seed 000's script,scaletrain train"
"""

from __future__ import annotations

import argparse
from pathlib import Path

import _harness as h
import _peers

IMAGES = 6400  # 80 % of make_data.py's 8,000 rows, as seed 000's script splits them; batch 256 divides it


def contenders(peers: Path, kaggle: Path, epochs: int, k: int) -> dict[str, tuple[list[str], str | None]]:
    """Each contender's command and, for scaletrain's, the run folder whose metrics.csv gives its figure."""
    bare = {"model": "resnet18", "size": 56, "batch": 256, "images": IMAGES, "epochs": epochs, "opt": "adam"}
    fit = {"peers": str(peers), "data": str(kaggle), "epochs": epochs}
    return {
        "bare loop": (h.job(h.bare_loop, **bare), None),
        "bare loop, channels_last": (h.job(h.bare_loop, channels_last=True, **bare), None),
        "seed 000's script": (_peers.seed000(peers, kaggle, epochs), None),
        "scaletrain train": (_peers.scaletrain_as_seed000(kaggle, epochs, f"st-{k}"), f"st-{k}"),
        "scaletrain train --no-channels-last": (
            [*_peers.scaletrain_as_seed000(kaggle, epochs, f"st-cf-{k}"), "--no-channels-last"], f"st-cf-{k}"),
        "scaletrain.fit, seed 000's Dataset and model": (h.job(_peers.fit_seed000, out=f"fit-{k}", **fit),
                                                         f"fit-{k}"),
        "scaletrain.fit, the same, channels_last off": (
            h.job(_peers.fit_seed000, out=f"fit-cf-{k}", channels_last=False, **fit), f"fit-cf-{k}"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2, help="per run; the first is left out of the figure")
    p.add_argument("--only", default="", help="comma-separated contenders [default: all]")
    p.add_argument("--peers", help="the seeds' scripts [default: ../shared/peers]")
    p.add_argument("--data-dir", default="/tmp/peerdata", help="where make_data.py writes the Kaggle CSVs")
    p.add_argument("--work-dir")
    p.add_argument("--out", help="the JSON record [default: results/cpu_limit.json]")
    args = p.parse_args()
    peers = _peers.peers(args.peers)
    if peers is None:
        raise SystemExit("seed000_accelerate.py not found: pass --peers")
    kaggle = _peers.data(peers, Path(args.data_dir)) / "digit-recognizer"
    work = h.work_dir("cpu-limit", args.work_dir)
    names = list(contenders(peers, kaggle, args.epochs, 0))
    if args.only:
        wanted = args.only.split(",")
        if set(wanted) - set(names):
            p.error(f"--only: choose from {'; '.join(names)}")
        names = [n for n in names if n in wanted]
    rates: dict[str, list] = {n: [] for n in names}
    for k, name in h.turns(names, args.rounds):
        cmd, folder = contenders(peers, kaggle, args.epochs, k)[name]
        r = h.run(cmd, cwd=work, env=h.env(), log=work / f"{k}-{names.index(name)}").check(name)
        # the script's and the bare loop's own epoch lines; scaletrain's metrics.csv
        rates[name].append(h.steady(h.metrics(work / folder)) if folder else h.images_per_second(
            h.epochs(r, _peers.SEED000_LINE if name.startswith("seed") else h.EPOCH_LINE), IMAGES))
        print(f"round {k + 1}, {name}: {rates[name][-1]:.1f} images/s", flush=True)
    limit = max((h.median(v) for n, v in rates.items() if n.startswith("bare")), default=None)
    rows = []
    for name, values in rates.items():
        rows.append({"contender": name, "images/s (median)": h.median(values), "values": values,
                     "of the limit": h.ratio(h.median(values), limit),
                     "vs seed 000's script": h.ratio(h.median(values), h.median(rates.get("seed 000's script", [])))})
    h.record("cpu_limit", rows, args.out, title="seed 000's settings: resnet18 56 px, batch 256, Adam, fp32; "
             "training images/s of the epochs after the first", rounds=args.rounds, epochs=args.epochs)


if __name__ == "__main__":
    h.main(main)
