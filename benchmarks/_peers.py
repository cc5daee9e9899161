"""The peers scaletrain is measured against. The seeds' own training scripts (../shared/peers, or .carry/peers on a
GPU machine): where they are, the data their make_data.py writes, the lines they print per epoch, their commands and
scaletrain's at the same settings, seed 000's own Dataset and model trained through `scaletrain.fit`. timm's
train.py on a photo folder: its command and scaletrain's at the same settings, and what its output says."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from _harness import ROOT, Run, main

PEER_FOLDERS = (ROOT.parent / "shared" / "peers", ROOT / ".carry" / "peers")  # here, and on a GPU machine
# per-epoch lines: epoch, validation accuracy, training seconds (harness.epochs reads them)
SEED000_LINE = r"Epoch (\d+), train loss \S+, val acc ([\d.]+), train_seconds ([\d.]+)"
SEED001_LINE = r"epoch【(\d+)】.*eval_metric= ([\d.]+)% train_seconds ([\d.]+)"
SEED002_LINE = r"\[epoch (\d+)\] accuracy: ([\d.]+) .*train_seconds ([\d.]+)"
AUGMENT = "hflip,vflip,brightness,contrast"  # seed 000's list; its resize and normalisation are built in


def peers(given: str | None = None) -> Path | None:
    """The folder holding seed000_accelerate.py: `given`, else the shared one or the carried one; None when absent."""
    for folder in ([Path(given)] if given else PEER_FOLDERS):
        if (folder / "seed000_accelerate.py").is_file():
            return folder.resolve()
    return None


def data(peer_folder: Path, folder: Path = Path("/tmp/peerdata")) -> Path:
    """make_data.py's 8,000 / 2,000 split of genuine MNIST digits: digit-recognizer/ (Kaggle CSVs) and mnist8k/
    (IDX files), written once."""
    if not (folder / "mnist8k").is_dir() or not (folder / "digit-recognizer" / "train.csv").is_file():
        subprocess.run([sys.executable, str(peer_folder / "make_data.py"), str(folder)], check=True)
    return folder


def train_rows(kaggle: Path) -> int:
    """The training images of a Kaggle folder as seed 000's script splits it (80 % of train.csv's rows)."""
    with (kaggle / "train.csv").open() as f:
        return (sum(1 for _ in f) - 1) * 4 // 5


def seed000(peer_folder: Path, kaggle: Path, epochs: int, model: str = "resnet18", size: int = 56,
            batch: int = 256, precision: str = "no") -> list[str]:
    return [sys.executable, str(peer_folder / "seed000_accelerate.py"), "--data", str(kaggle), "--out", ".",
            "--ep", str(epochs), "--model", model, "--bs", str(batch), "--image_size", str(size), "--workers", "2",
            "--mixed_precision", precision]


def scaletrain_as_seed000(kaggle: Path, epochs: int, out: str, model: str = "resnet18", size: int = 56,
                          batch: int = 256, precision: str = "no") -> list[str]:
    """`scaletrain train` at seed 000's settings: its model, batch, Adam 5e-5 at a constant rate, augmentations."""
    return [sys.executable, "-m", "scaletrain", "train", "--data", str(kaggle), "--model", model, "--image-size",
            str(size), "--batch-size", str(batch), "--optimizer", "adam", "--lr", "5e-5", "--weight-decay", "0",
            "--scheduler", "constant", "--warmup-epochs", "0", "--augment", AUGMENT, "--epochs", str(epochs),
            "--mixed-precision", precision, "--output-dir", out]


def fit_seed000(peers: str, data: str, out: str, epochs: int = 2, channels_last: bool = True,
                model: str = "resnet18", image_size: int = 56, batch_size: int = 256) -> None:
    """Seed 000's own `MiniDataSet` (its albumentations pipeline, 2 DataLoader workers) and `TimmModel`, imported
    unchanged, trained by `scaletrain.fit` with Adam at 5e-5; run it with harness.job(fit_seed000, ...)."""
    sys.path.insert(0, peers)
    import pandas as pd
    import torch
    from seed000_accelerate import MiniDataSet, TimmModel, get_transform

    import scaletrain

    table = pd.read_csv(Path(data) / "train.csv")
    images, labels = table.iloc[:, 1:].values.reshape(-1, 28, 28), table.iloc[:, 0].values
    n = int(len(images) * 0.8)
    config = scaletrain.TrainConfig()
    config.optim.epochs, config.optim.batch_size = epochs, batch_size
    config.data.num_workers = 2
    config.model.channels_last = channels_last
    config.run.output_dir = out
    scaletrain.fit(TimmModel(model, 10), MiniDataSet(images[:n], labels[:n], get_transform(image_size, True)),
                   MiniDataSet(images[n:], labels[n:], get_transform(image_size, False)), config,
                   optimizer=lambda params: torch.optim.Adam(params, lr=5e-5))


def fit_seed001_net(peers: str, data: str, out: str, epochs: int = 2) -> None:
    """scaletrain's engine on seed 001's own network, with its batch (1024) and AdamW settings."""
    sys.path.insert(0, peers)
    from seed001_accelerate_cnn import create_net

    import scaletrain as st

    cfg = st.TrainConfig(data=st.DataConfig(data=data, augment="none"),
                         optim=st.OptimConfig(epochs=epochs, batch_size=1024, optimizer="adamw", lr=25 * 1e-4,
                                              weight_decay=0.01, scheduler="onecycle", warmup_epochs=0.3 * epochs),
                         run=st.RunConfig(output_dir=out))
    train, val = st.load_image_sets(cfg.data)
    st.fit(create_net(), train, val, cfg, model_name="seed001 CNN")


@dataclass(frozen=True)
class PhotoJob:
    """What timm's train.py and `scaletrain train` both train on a photo folder: resnet18 at 64 px, SGD, on the CPU
    by default; the GPU suite asks for resnet50 at 224 px in bf16 and channels_last."""

    model: str = "resnet18"
    size: int = 64
    batch: int = 64
    lr: float = 0.05
    workers: int = 2
    epochs: int = 1
    cuda: bool = False

    def timm(self, train_py: Path, root: Path, out: Path) -> list[str]:
        """timm's train.py (not part of the timm package: huggingface/pytorch-image-models at the installed
        timm's commit) on root/train and root/val."""
        device = ["--amp", "--amp-dtype", "bfloat16", "--channels-last", "--device", "cuda"] if self.cuda else [
            "--device", "cpu", "--no-prefetcher"]
        return [sys.executable, str(train_py), "--data-dir", str(root), "--train-split", "train", "--val-split",
                "val", "--model", self.model, "--num-classes", "10", "--img-size", str(self.size), "-b",
                str(self.batch), "--lr", str(self.lr), "--opt", "sgd", "--epochs", str(self.epochs),
                "--warmup-epochs", "0", "-j", str(self.workers), "--log-interval", "10", *device, "--output", str(out)]

    def scaletrain_args(self) -> list[str]:
        return ["--model", self.model, "--image-size", str(self.size), "--batch-size", str(self.batch), "--lr",
                str(self.lr), "--epochs", str(self.epochs), "--num-workers", str(self.workers),
                *(["--mixed-precision", "bf16"] if self.cuda else [])]

    def scaletrain(self, root: Path, out: Path, *extra: str) -> list[str]:
        return [sys.executable, "-m", "scaletrain", "train", "--data", str(root), *self.scaletrain_args(),
                "--output-dir", str(out), *extra]


TIMM_FIRST_STEP = r"Train: 0 \["  # the line that ends timm's first optimizer step
FIRST_STEP = r"first step done"  # scaletrain's


def timm_images_per_second(r: Run) -> float | None:
    """timm's running average over its first epoch, as its last line of that epoch gives it (run(merge=True):
    timm logs to stderr)."""
    rates = [float(m.group(1)) for _, line in r.lines if line.startswith("Train: 0 [")
             and (m := re.search(r"\(\s*[\d.]+s,\s*([\d.]+)/s\)", line))]
    return rates[-1] if rates else None


if __name__ == "__main__":
    main(None, fit_seed000, fit_seed001_net)
