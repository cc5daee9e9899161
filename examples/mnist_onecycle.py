"""MNIST with a plain nn.Sequential CNN, AdamW and a one-cycle schedule peaking at 25 x the base rate, as people
write it for one GPU, with the training loop replaced by scaletrain: the optimizer and the schedule come in as they
are, through `optimizer=` and `scheduler=`, and keep resuming exactly.

    python examples/mnist_onecycle.py --quick
    torchrun --nproc-per-node 2 examples/mnist_onecycle.py --quick
    accelerate launch --multi_gpu --num_processes 2 examples/mnist_onecycle.py --quick

The digits are the 10,000 MNIST images shipped with scaletrain (8,000 to train on, 2,000 to validate).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import Dataset

import scaletrain


class Digits(Dataset):
    """(1 x 28 x 28 float image in [0, 1], label) pairs, as torchvision's MNIST with ToTensor() gives them."""

    def __init__(self, start: int, stop: int):
        digits = scaletrain.data.embedded_mnist()
        self.images = digits.images[start:stop].float() / 255
        self.labels = digits.labels[start:stop]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], int(self.labels[i])


def make_net(width: int = 512) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, width, kernel_size=3), nn.MaxPool2d(2),
        nn.Conv2d(width, width // 2, kernel_size=5), nn.MaxPool2d(2),
        nn.Dropout2d(0.1), nn.AdaptiveMaxPool2d(1), nn.Flatten(),
        nn.Linear(width // 2, 128), nn.ReLU(), nn.Linear(128, 10))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/mnist-onecycle")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--width", type=int, default=512, help="channels of the first convolution")
    p.add_argument("--quick", action="store_true", help="1 epoch of 2,000 digits with 32 channels")
    args = p.parse_args()
    train, val = Digits(0, 8000), Digits(8000, 10000)
    if args.quick:
        args.epochs, args.width, train, val = 1, 32, Digits(0, 2000), Digits(8000, 8500)

    config = scaletrain.TrainConfig()
    config.optim.epochs, config.optim.batch_size = args.epochs, args.batch_size
    config.data.num_workers = 0  # the digits are in memory already
    config.run.output_dir = args.out
    scaletrain.fit(make_net(args.width), train, val, config,
                   optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr),
                   scheduler=lambda optimizer, total_steps: torch.optim.lr_scheduler.OneCycleLR(
                       optimizer, max_lr=25 * args.lr, total_steps=total_steps))


if __name__ == "__main__":
    main()
