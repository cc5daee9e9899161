"""Kaggle's digit recognizer with a timm model, an albumentations pipeline and a submission file, as people write it
for one GPU (a Dataset of dicts, a wrapper whose forward takes the image, Adam), with the training loop replaced by
scaletrain: the same script runs on a CPU, one GPU or several, and writes the same submission.

    python examples/kaggle_digits.py --quick
    torchrun --nproc-per-node 2 examples/kaggle_digits.py --quick
    accelerate launch --multi_gpu --num_processes 2 examples/kaggle_digits.py --quick

Without --data it makes the competition's three CSV files from the 10,000 MNIST digits shipped with scaletrain.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import albumentations as A
import cv2
import numpy as np
import pandas as pd
import timm
import torch
from albumentations.pytorch import ToTensorV2
from safetensors.torch import load_file
from torch.utils.data import Dataset

import scaletrain


def pipeline(size: int, train: bool) -> A.Compose:
    augment = [A.HorizontalFlip(p=0.5), A.RandomBrightnessContrast(p=0.3)] if train else []
    return A.Compose([*augment, A.Resize(size, size, interpolation=cv2.INTER_LINEAR),
                      A.Normalize(mean=0.1307, std=0.3081, max_pixel_value=255.0), ToTensorV2()])


class DigitRows(Dataset):
    """Rows of the competition's CSV: {"image": float32 1 x size x size, "label": int}; test rows have no label."""

    def __init__(self, pixels: np.ndarray, labels: np.ndarray | None = None, transform=None):
        self.pixels = pixels.reshape(-1, 28, 28).astype(np.float32)
        self.labels, self.transform = labels, transform

    def __len__(self):
        return len(self.pixels)

    def __getitem__(self, i):
        item = {"image": self.transform(image=self.pixels[i])["image"]}
        if self.labels is not None:
            item["label"] = int(self.labels[i])
        return item


class Classifier(torch.nn.Module):
    def __init__(self, backbone: str, classes: int = 10):
        super().__init__()
        self.net = timm.create_model(backbone, pretrained=False, in_chans=1, num_classes=classes)

    def forward(self, image):
        return self.net(image)


def competition_files(folder: Path) -> None:
    """train.csv, test.csv and sample_submission.csv laid out as Kaggle's (8,000 labelled rows, 2,000 test rows)."""
    if (folder / "sample_submission.csv").is_file():
        return
    digits = scaletrain.data.embedded_mnist()
    pixels = digits.images.reshape(len(digits), -1).numpy()
    columns = [f"pixel{i}" for i in range(784)]
    train = pd.DataFrame(pixels[:8000], columns=columns)
    train.insert(0, "label", digits.labels[:8000].numpy())
    tables = {"train.csv": train, "test.csv": pd.DataFrame(pixels[8000:], columns=columns),
              "sample_submission.csv": pd.DataFrame({"ImageId": np.arange(1, 2001), "Label": 0})}
    folder.mkdir(parents=True, exist_ok=True)
    for name, table in tables.items():  # every process may write them: each writes whole files, then renames
        tmp = folder / f".{name}.{os.getpid()}"
        table.to_csv(tmp, index=False)
        os.replace(tmp, folder / name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="runs/kaggle-digits-data", help="folder of train.csv, test.csv, "
                   "sample_submission.csv (made from the embedded digits when missing)")
    p.add_argument("--out", default="runs/kaggle-digits")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--epochs", type=int, help="default 5, or 1 with --quick")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--image-size", type=int, default=56)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--checkpoint-every", type=int, default=0, help="also save the training state every N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="1,000 rows at 28 px: seconds on a CPU")
    args = p.parse_args()

    data = Path(args.data)
    competition_files(data)
    train = pd.read_csv(data / "train.csv")
    test = pd.read_csv(data / "test.csv").values
    pixels, labels = train.iloc[:, 1:].values, train["label"].values
    args.epochs = args.epochs or (1 if args.quick else 5)
    if args.quick:
        args.image_size, pixels, labels, test = 28, pixels[:1000], labels[:1000], test[:200]
    cut = int(0.8 * len(pixels))

    config = scaletrain.TrainConfig()
    config.optim.epochs, config.optim.batch_size = args.epochs, args.batch_size
    config.data.num_workers = args.workers
    config.run.output_dir, config.run.checkpoint_every, config.run.seed = args.out, args.checkpoint_every, args.seed
    torch.manual_seed(args.seed)  # the same initial weights in every run (every process trains rank 0's)
    model = Classifier(args.model)
    result = scaletrain.fit(model, DigitRows(pixels[:cut], labels[:cut], pipeline(args.image_size, True)),
                            DigitRows(pixels[cut:], labels[cut:], pipeline(args.image_size, False)), config,
                            optimizer=lambda params: torch.optim.Adam(params, lr=args.lr))

    model.load_state_dict(load_file(Path(result.run_dir) / "best.safetensors"))
    logits = scaletrain.predict(model, DigitRows(test, transform=pipeline(args.image_size, False)), config)
    if int(os.environ.get("RANK", "0")) == 0:
        submission = pd.read_csv(data / "sample_submission.csv").iloc[:len(logits)]
        submission["Label"] = logits.argmax(1).numpy()
        submission.to_csv(Path(result.run_dir) / "submission.csv", index=False)
        print(f"best val_accuracy {result.best_val_accuracy:.4f}; wrote {Path(result.run_dir) / 'submission.csv'}")


if __name__ == "__main__":
    main()
