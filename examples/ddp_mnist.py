"""A hand-written DDP script's model and data (a small CNN ending in a softmax, MNIST, SGD with momentum, a cosine
schedule, the learning rate scaled by the number of processes, SyncBatchNorm on request), with everything that
made it distributed removed: no init_process_group, no DistributedSampler, no rank-0 initial weights saved and
loaded, no all_reduce of the loss. scaletrain does each of those, and counts every validation digit once.

    python examples/ddp_mnist.py --quick
    torchrun --nproc-per-node 2 examples/ddp_mnist.py --quick
    accelerate launch --multi_gpu --num_processes 2 examples/ddp_mnist.py --quick
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import scaletrain


class MNIST(Dataset):
    """(1 x 28 x 28 float image, label), normalised by MNIST's mean and standard deviation."""

    def __init__(self, start: int, stop: int):
        digits = scaletrain.data.embedded_mnist()
        self.images = (digits.images[start:stop].float() / 255 - 0.1307) / 0.3081
        self.labels = digits.labels[start:stop]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]


class ConvNet(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 5, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.conv3 = nn.Conv2d(32, 32, 5, padding=1)
        self.fc1, self.fc2, self.out = nn.Linear(32 * 5 * 5, 128), nn.Linear(128, 64), nn.Linear(64, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2, padding=1)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2, padding=1)
        x = F.relu(self.conv3(x)).flatten(1)
        return torch.softmax(self.out(F.relu(self.fc2(F.relu(self.fc1(x))))), dim=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/ddp-mnist")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64, help="per process")
    p.add_argument("--lr", type=float, default=0.01, help="for one process; multiplied by the process count")
    p.add_argument("--sync-bn", action="store_true")
    p.add_argument("--quick", action="store_true", help="1 epoch of 2,000 digits")
    args = p.parse_args()
    train, val = MNIST(0, 8000), MNIST(8000, 10000)
    if args.quick:
        args.epochs, train, val = 1, MNIST(0, 2000), MNIST(8000, 8500)

    config = scaletrain.TrainConfig()
    config.optim.epochs, config.optim.batch_size = args.epochs, args.batch_size
    config.optim.optimizer, config.optim.momentum, config.optim.weight_decay = "sgd", 0.9, 0.005
    config.optim.lr, config.optim.lr_scaling, config.optim.scheduler = args.lr, "linear", "cosine"
    config.model.sync_bn = args.sync_bn
    config.data.num_workers = 0
    config.run.output_dir = args.out
    scaletrain.fit(ConvNet(), train, val, config)


if __name__ == "__main__":
    main()
