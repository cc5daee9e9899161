"""Segmenting the digits, a task that is not classification: every pixel of an MNIST digit is labelled with the
digit's class (1 to 10) or as background (0). A small fully convolutional net gives N x 11 x 28 x 28 logits,
nn.CrossEntropyLoss takes them against N x 28 x 28 masks, and torchmetrics measures the mean IoU, the pixel accuracy
and the Dice score (macro F1), as people write it for one GPU, with the training loop replaced by scaletrain.

    python examples/segment_digits.py --quick
    torchrun --nproc-per-node 2 examples/segment_digits.py --quick

Validation computes each metric over exactly the whole validation set on any number of processes (val_iou,
val_pixel_accuracy, val_dice in metrics.csv); there is no val_accuracy, which only single-label classification has.
best.safetensors is the epoch with the best mean IoU. After training, its predicted masks of the validation digits
(N x 28 x 28, uint8) are written in dataset order to <out>/masks.npy, by the main process, as they come.

The digits are the 10,000 MNIST images shipped with scaletrain (8,000 to train on, 2,000 to validate).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import Dataset
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score, MulticlassJaccardIndex

import scaletrain

CLASSES = 11  # background, then the digits 0-9 as 1-10


class DigitMasks(Dataset):
    """(1 x 28 x 28 float image in [0, 1], 28 x 28 int64 mask): the digit's pixels (ink above half) are its class
    + 1, the rest is background."""

    def __init__(self, start: int, stop: int):
        digits = scaletrain.data.embedded_mnist()
        self.images = digits.images[start:stop].float() / 255
        self.masks = torch.where(self.images[:, 0] > 0.5, digits.labels[start:stop, None, None] + 1, 0)

    def __len__(self):
        return len(self.masks)

    def __getitem__(self, i):
        return self.images[i], self.masks[i]


def make_net(width: int = 32) -> nn.Sequential:
    """Dilated convolutions at full resolution: every pixel sees the whole digit (a receptive field of 31)."""
    layers: list[nn.Module] = []
    channels = 1
    for dilation in (1, 2, 4, 8):
        layers += [nn.Conv2d(channels, width, 3, padding=dilation, dilation=dilation), nn.BatchNorm2d(width),
                   nn.ReLU()]
        channels = width
    return nn.Sequential(*layers, nn.Conv2d(width, CLASSES, 1))


class Masks(nn.Module):
    """The trained net giving a mask per image (the most likely class of every pixel) instead of logits."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x).argmax(1).to(torch.uint8)


def metrics() -> dict:
    """torchmetrics' mean IoU over the 11 classes, pixel accuracy, and Dice (the F1 score, averaged over classes)."""
    return {"iou": MulticlassJaccardIndex(CLASSES), "pixel_accuracy": MulticlassAccuracy(CLASSES, average="micro"),
            "dice": MulticlassF1Score(CLASSES)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/segment-digits")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--width", type=int, default=32, help="channels of every convolution")
    p.add_argument("--checkpoint-every", type=int, default=0, help="also save training state every N steps")
    p.add_argument("--quick", action="store_true", help="1 epoch of 2,000 digits with 16 channels")
    args = p.parse_args()
    train, val = DigitMasks(0, 8000), DigitMasks(8000, 10000)
    if args.quick:
        args.width, train, val = 16, DigitMasks(0, 2000), DigitMasks(8000, 8500)
        args.epochs = 1 if args.epochs == p.get_default("epochs") else args.epochs

    config = scaletrain.TrainConfig()
    config.optim.epochs, config.optim.batch_size = args.epochs, args.batch_size
    config.optim.optimizer, config.optim.lr, config.optim.monitor = "adamw", 1e-2, "val_iou"
    config.data.num_workers = 0  # the digits are in memory already
    config.run.output_dir, config.run.checkpoint_every = args.out, args.checkpoint_every
    torch.manual_seed(0)  # the same initial weights in every run (every process trains rank 0's)
    net = make_net(args.width)
    result = scaletrain.fit(net, train, val, config, loss_fn=nn.CrossEntropyLoss(), metrics=metrics())

    net.load_state_dict(load_file(Path(result.run_dir) / "best.safetensors"))
    masks = scaletrain.predict(Masks(net), val, config, output=Path(result.run_dir) / "masks.npy")
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"best val_iou {result.best['val_iou']:.4f} at epoch {result.summary['best_epoch']}; "
              f"validation masks in {masks}", flush=True)


if __name__ == "__main__":
    main()
