"""A model bigger than one process (examples/big_model.py, an MLP of width 4096, AdamW, one epoch, global batch
32): each process's peak memory (ru_maxrss, printed by every rank) as 2 pipeline stages, as 2-process fsdp and
with each pair of layers split over 2 processes (--tp 2), beside the whole model trained on one process, in one run. Each layout three ways: given to `fit` as a function
and started from the whole run's initial weights (--init-from, written by its --save-initial-weights), as a
function alone (each part replayed at the seed), and as a model object built whole in every process (what a
user's script that builds its model first gets, and what every layout did before). A process's fixed cost is
measured too: the same commands at width 64 ("at rest"), so that what the model itself costs a process reads as
peak - at rest. The first epoch's training loss of each layout beside the whole run's.

`--case build` isolates the construction: 4 stages under plain SGD (no optimizer state), where a stage's training
holds less than the whole model that a model object makes every process build first.

    python benchmarks/big_model.py                      # about 6 minutes on 2 cores
    python benchmarks/big_model.py --case build         # about 4 minutes
    python benchmarks/big_model.py --width 2048 --depth 9
"""

from __future__ import annotations

import argparse
import re

import _harness as h

EXAMPLE = h.ROOT / "examples" / "big_model.py"


def arms(init: str, case: str) -> dict[str, tuple[int, list[str]]]:
    """name -> (processes, the example's arguments)."""
    if case == "build":
        sgd = ["--stages", "4", "--optimizer", "sgd"]
        return {"4 pipeline stages, SGD, a function": (4, sgd), "4 pipeline stages, SGD, a model object":
                (4, [*sgd, "--whole-object"])}
    out = {}
    for layout, nproc, args in (("2 pipeline stages", 2, ["--stages", "2"]), ("2-process fsdp", 2, ["--strategy",
                                "fsdp"]), ("--tp 2 (each pair of layers split)", 2, ["--tp", "2"])):
        out[f"{layout}, a function, --init-from"] = (nproc, [*args, "--init-from", init])
        out[f"{layout}, a function (replayed at the seed)"] = (nproc, args)
        out[f"{layout}, a model object"] = (nproc, [*args, "--whole-object"])
    return out


def launch(nproc: int, out, width: int, depth: int, samples: int, args: list[str]) -> tuple[dict[int, float], float]:
    """(each rank's peak MiB, the first epoch's training loss) of one run of the example."""
    cmd = [*h.launcher(nproc), str(EXAMPLE), "--out", str(out), "--width", str(width), "--depth", str(depth),
           "--samples", str(samples), *args]
    r = h.run(cmd, env=h.env(), merge=True).check(" ".join(cmd[-6:]))
    text = "\n".join(line for _, line in r.lines)
    peaks = {int(rank): float(mib) for rank, mib in re.findall(r"peak memory of rank (\d+): (\d+) MiB", text)}
    return peaks, float(re.search(r"first epoch's training loss ([\d.]+)", text).group(1))


def entry() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=9, help="layers of width x width, the first one included")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--case", default="train", choices=("train", "build"))
    parser.add_argument("--work", default=None)
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    work = h.work_dir("big_model", a.work)
    sgd = ["--optimizer", "sgd"] if a.case == "build" else []
    whole_peaks, whole_loss = launch(1, work / "whole", a.width, a.depth, a.samples, ["--save-initial-weights", *sgd])
    rest = {1: launch(1, work / "rest-1", 64, 2, 64, [])[0][0]}
    layouts = (("pipeline", ["--stages", "4"], 4),) if a.case == "build" else \
        (("pipeline", ["--stages", "2"], 2), ("fsdp", ["--strategy", "fsdp"], 2), ("tp", ["--tp", "2"], 2))
    for name, args, nproc in layouts:
        rest[name] = max(launch(nproc, work / f"rest-{name}", 64, 4, 64, args)[0].values())
    whole = whole_peaks[0]
    rows = [{"way": "whole, 1 process", "peak_mib_per_process": [whole], "of_whole": 1.0, "at_rest_mib": rest[1],
             "model_mib": [whole - rest[1]], "model_of_whole": 1.0, "first_epoch_loss": whole_loss, "loss_gap": 0.0}]
    for k, (name, (nproc, args)) in enumerate(arms(str(work / "whole" / "initial.safetensors"), a.case).items()):
        peaks, loss = launch(nproc, work / f"arm-{k}", a.width, a.depth, a.samples, args)
        at_rest = rest[next(k for k in ("pipeline", "fsdp", "tp") if k in name)]
        by_rank = [peaks[r] for r in sorted(peaks)]
        rows.append({"way": name, "peak_mib_per_process": by_rank, "of_whole": max(by_rank) / whole,
                     "at_rest_mib": at_rest, "model_mib": [p - at_rest for p in by_rank],
                     "model_of_whole": (max(by_rank) - at_rest) / (whole - rest[1]), "first_epoch_loss": loss,
                     "loss_gap": abs(loss - whole_loss)})
    shown = [{"way": r["way"], "peak per process (MiB)": " / ".join(f"{p:.0f}" for p in r["peak_mib_per_process"]),
              "largest / whole's": f"{r['of_whole']:.2f}", "at rest (MiB)": f"{r['at_rest_mib']:.0f}",
              "model's share (largest, above rest) / whole's": f"{r['model_of_whole']:.2f}",
              "first epoch's loss": f"{r['first_epoch_loss']:.6f}", "gap to whole": f"{r['loss_gap']:.1e}"}
             for r in rows]
    h.record("big_model", rows, a.out, f"examples/big_model.py, width {a.width}, depth {a.depth}, {a.samples} samples, "
             f"{'SGD' if sgd else 'AdamW'}, 1 epoch", shown, width=a.width, depth=a.depth, samples=a.samples,
             case=a.case)


if __name__ == "__main__":
    h.main(entry)
