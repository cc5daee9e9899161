"""PyTorch's own MNIST example as people run it (a two-convolution network ending in log_softmax, the negative
log-likelihood loss, Adadelta at rate 1.0 and StepLR(step_size=1, gamma=0.7) stepped once per epoch), with its
train/test loop replaced by scaletrain. The only line that says anything new is the scheduler's: it is stepped per
epoch, as the example steps it, because the script says so.

    python examples/mnist_steplr.py --quick
    torchrun --nproc-per-node 2 examples/mnist_steplr.py --quick

The digits are the 10,000 MNIST images shipped with scaletrain (8,000 to train on, 2,000 to validate), normalised
with MNIST's mean and standard deviation as the example's transform does.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import scaletrain


class Digits(Dataset):
    """(1 x 28 x 28 normalised float image, label): what ToTensor() and Normalize((0.1307,), (0.3081,)) give."""

    def __init__(self, start: int, stop: int):
        digits = scaletrain.data.embedded_mnist()
        self.images = (digits.images[start:stop].float() / 255 - 0.1307) / 0.3081
        self.labels = digits.labels[start:stop]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], int(self.labels[i])


class Net(nn.Module):
    """Two 3 x 3 convolutions (32 and 64 channels), a 2 x 2 max-pool, dropout, two linear layers, log-probabilities
    out."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 32, 3), nn.Conv2d(32, 64, 3)
        self.drop1, self.drop2 = nn.Dropout(0.25), nn.Dropout(0.5)
        self.fc1, self.fc2 = nn.Linear(64 * 12 * 12, 128), nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = F.relu(self.fc1(torch.flatten(self.drop1(x), 1)))
        return F.log_softmax(self.fc2(self.drop2(x)), dim=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/mnist-steplr")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1.0)
    p.add_argument("--gamma", type=float, default=0.7, help="the rate's factor after each epoch")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--mixed-precision", default="no", choices=["no", "fp16", "bf16"])
    p.add_argument("--quick", action="store_true", help="1 epoch of 2,000 digits")
    args = p.parse_args()
    train, val = Digits(0, 8000), Digits(8000, 10000)
    if args.quick:
        args.epochs, train, val = 1, Digits(0, 2000), Digits(8000, 8500)

    torch.manual_seed(args.seed)
    config = scaletrain.TrainConfig()
    config.optim.epochs, config.optim.batch_size = args.epochs, args.batch_size
    config.data.num_workers = 0  # the digits are in memory already
    config.run.output_dir, config.run.seed = args.out, args.seed
    config.run.mixed_precision = args.mixed_precision
    scaletrain.fit(Net(), train, val, config, loss_fn=F.nll_loss,
                   optimizer=lambda params: torch.optim.Adadelta(params, lr=args.lr),
                   scheduler=scaletrain.Schedule(lambda opt: torch.optim.lr_scheduler.StepLR(
                       opt, step_size=1, gamma=args.gamma), interval="epoch"))


if __name__ == "__main__":
    main()
