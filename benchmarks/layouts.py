"""Every pair of layouts resumes: a run's first epoch trained on layout A, its second on layout B (the same run
folder continued), for a ViT and a CNN, each cell against the same two epochs trained whole on one process. A cell
is the largest relative gap of the two epochs' training and validation losses, and of the final weights (each
tensor's largest difference over its largest value), or the refusal and its reason.

Both models at 32 px on the embedded digits, AdamW, a constant rate, the gradient norm clipped to 0.5 (below it at
every step: every step clips), a global batch of 32 on every layout (--global-batch-size), channels_last at its
default. The ViT is timm's vit_tiny_patch16_224 cut to 4 blocks of 4 heads with patches of 4; the CNN timm's
convnext_atto (no tensor-parallel plan: its --tp cells are refusals).

    python benchmarks/layouts.py                      # both models, 7 x 7 cells each: about 40 minutes on 2 cores
    python benchmarks/layouts.py --models vit --layouts "1 process,tp 2,2 stages"
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import _data
import _harness as h

LAYOUTS = {"1 process": (1, []), "ddp 2": (2, []), "fsdp 2": (2, ["--strategy", "fsdp"]), "tp 2": (2, ["--tp", "2"]),
           "2 stages": (2, ["--strategy", "pipeline", "--stages", "2"]),
           "tp 2 x fsdp 2": (4, ["--tp", "2", "--strategy", "fsdp"]),
           "2 stages x tp 2": (4, ["--strategy", "pipeline", "--stages", "2", "--tp", "2"])}
TRAINING = ["--image-size", "32", "--global-batch-size", "32", "--augment", "none", "--log-with", "none",
            "--optimizer", "adamw", "--lr", "0.001", "--clip-grad-norm", "0.5", "--scheduler", "constant",
            "--warmup-epochs", "0", "--checkpoint-every", "0"]


def train(data: Path, out: Path, model: str, layout: str, epochs: int) -> h.Run:
    nproc, flags = LAYOUTS[layout]
    cmd = ["train", "--data", str(data), "--model", model, *TRAINING, *flags, "--epochs", str(epochs),
           "--output-dir", str(out)]
    return h.run(h.scaletrain(*cmd, "--nproc", str(nproc)), env=h.env(OMP_NUM_THREADS="1"), timeout=900)


def gaps(run: Path, whole: Path) -> tuple[float, float]:
    """(largest relative loss gap over both epochs, largest relative weight gap) of `run` to `whole`."""
    from safetensors.torch import load_file

    loss = max(abs(a[k] - b[k]) / abs(b[k]) for a, b in zip(h.metrics(run), h.metrics(whole), strict=True)
               for k in ("train_loss", "val_loss"))
    wa, wb = load_file(str(run / "last.safetensors")), load_file(str(whole / "last.safetensors"))
    weight = max(((wa[k].double() - wb[k].double()).abs().max() / wb[k].double().abs().max().clamp_min(1e-12)).item()
                 for k in wb if wb[k].is_floating_point())
    return loss, weight


def refusal(r: h.Run) -> str:
    last = r.tail(1).removeprefix("scaletrain: error: ")
    return f"refused: {last}" if r.returncode == 2 else f"failed ({r.returncode}): {last}"


def matrix(name: str, model: str, data: Path, work: Path, layouts: list[str]) -> list[dict]:
    whole = work / f"{name}-whole"
    train(data, whole, model, "1 process", 2).check(f"{name}: 2 epochs on one process")
    rows = []
    for a in layouts:
        first = work / f"{name}-{a}"
        started = train(data, first, model, a, 1)
        for b in layouts:
            row = {"model": name, "epoch 1 on": a, "epoch 2 on": b}
            if started.returncode != 0:
                rows.append({**row, "cell": refusal(started)})
                continue
            folder = work / f"{name}-{a}-then-{b}"
            shutil.copytree(first, folder)
            second = train(data, folder, model, b, 2)
            if second.returncode != 0:
                rows.append({**row, "cell": refusal(second)})
            else:
                loss, weight = gaps(folder, whole)
                rows.append({**row, "loss_gap": loss, "weight_gap": weight, "cell": f"{loss:.1e} / {weight:.1e}"})
            shutil.rmtree(folder, ignore_errors=True)
            print(f"{name}: {a} -> {b}: {rows[-1]['cell']}", flush=True)
    return rows


def table(rows: list[dict], layouts: list[str]) -> list[dict]:
    """One row per epoch-1 layout, one column per epoch-2 layout."""
    return [{"epoch 1 \\ epoch 2": a, **{b: next(r["cell"] for r in rows if (r["epoch 1 on"], r["epoch 2 on"]) == (a, b))
                                         for b in layouts}} for a in layouts]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="vit,cnn")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--work", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    work = h.work_dir("layouts", args.work)
    layouts = args.layouts.split(",")
    data = _data.digits_npz(work / "digits.npz", 256, 64)
    (work / "vit.py").write_text(h.VIT)
    models = {"vit": f"{work / 'vit.py'}:make", "cnn": "convnext_atto"}
    rows: list[dict] = []
    for name in args.models.split(","):  # recorded after each model: a long run keeps what it measured
        rows += matrix(name, models[name], data, work, layouts)
        shown = [t for m in dict.fromkeys(r["model"] for r in rows) for t in
                 table([r for r in rows if r["model"] == m], layouts)]
        h.record("layouts_cpu", rows, args.out, title="largest relative loss gap / weight gap to 2 epochs whole on "
                 "one process (epoch 1 on the row's layout, epoch 2 on the column's)", shown=shown, layouts=layouts)
    return 0


if __name__ == "__main__":
    h.main(main)
