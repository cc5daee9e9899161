"""A SimCLR-style contrastive model as people write it (two augmented views of each image, an encoder and a
projection head, the NT-Xent loss over the batch's pairs, Adam), with its loop replaced by scaletrain: a `Step`
whose loss gathers every process's embeddings with `self.all_gather`, so that each image's negatives are the
whole global batch and the loss is the same on one process or several; validation measures how often an image's
nearest neighbour among the other validation images (by the encoder's embedding) is the same digit, over the whole
validation set on any number of processes.

    python examples/simclr_digits.py --quick
    torchrun --nproc-per-node 2 examples/simclr_digits.py --quick

The digits are the 10,000 MNIST images shipped with scaletrain (8,000 to train on, 2,000 to validate); the views
are random shifts, rotations and erasures drawn per item (seeded per batch by scaletrain, so a run resumes exactly).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset
from torchmetrics import Metric
from torchvision.transforms import v2

import scaletrain


class TwoViews(Dataset):
    """((view 1, view 2), label): two random augmentations of one 1 x 28 x 28 digit."""

    def __init__(self, start: int, stop: int):
        digits = scaletrain.data.embedded_mnist()
        self.images, self.labels = digits.images[start:stop].float() / 255, digits.labels[start:stop]
        self.augment = v2.Compose([v2.RandomAffine(degrees=15, translate=(0.15, 0.15), scale=(0.8, 1.1)),
                                   v2.RandomErasing(p=0.5, scale=(0.02, 0.1), value=0.0)])

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return (self.augment(self.images[i]), self.augment(self.images[i])), int(self.labels[i])


class Plain(Dataset):
    """(1 x 28 x 28 digit, label) for validation."""

    def __init__(self, start: int, stop: int):
        digits = scaletrain.data.embedded_mnist()
        self.images, self.labels = digits.images[start:stop].float() / 255, digits.labels[start:stop]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], int(self.labels[i])


class Encoder(nn.Module):
    """A small CNN (the representation) and a projection head (where the loss is taken)."""

    def __init__(self, width: int = 32, dim: int = 64):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                                  nn.MaxPool2d(2), nn.Conv2d(width, 2 * width, 3, padding=1),
                                  nn.BatchNorm2d(2 * width), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Sequential(nn.Linear(2 * width, 2 * width), nn.ReLU(), nn.Linear(2 * width, dim))

    def forward(self, x):
        return self.head(self.body(x))


def nt_xent(z1: torch.Tensor, z2: torch.Tensor, temperature: float) -> torch.Tensor:
    """SimCLR's loss: each of the 2N embeddings should pick its pair out of the other 2N - 1."""
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    similarity = z @ z.T / temperature
    similarity.fill_diagonal_(float("-inf"))
    n = len(z1)
    pairs = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
    return F.cross_entropy(similarity, pairs)


class SimCLR(scaletrain.Step):
    def __init__(self, temperature: float = 0.2):
        self.temperature = temperature

    def train_step(self, model, batch):
        (view1, view2), _ = batch
        z1, z2 = model(torch.cat([view1, view2])).chunk(2)
        # every process's pairs: the negatives are the global batch's, the loss that of one process with all of it
        return nt_xent(self.all_gather(z1), self.all_gather(z2), self.temperature)

    def eval_step(self, model, batch):
        images, labels = batch
        return F.normalize(model.body(images), dim=1), labels


class NearestNeighbourAccuracy(Metric):
    """How often an image's nearest other image (cosine similarity of the embeddings) has its label."""

    higher_is_better = True

    def __init__(self):
        super().__init__()
        self.add_state("embeddings", default=[], dist_reduce_fx="cat")
        self.add_state("labels", default=[], dist_reduce_fx="cat")

    def update(self, embeddings, labels):
        self.embeddings.append(embeddings)
        self.labels.append(labels)

    def compute(self):
        z = torch.cat(self.embeddings) if isinstance(self.embeddings, list) else self.embeddings
        y = torch.cat(self.labels) if isinstance(self.labels, list) else self.labels
        similarity = z @ z.T
        similarity.fill_diagonal_(float("-inf"))
        return (y[similarity.argmax(1)] == y).float().mean()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/simclr-digits")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mixed-precision", default="no", choices=["no", "fp16", "bf16"])
    p.add_argument("--quick", action="store_true", help="1 epoch of 1,024 digits")
    args = p.parse_args()
    train, val = TwoViews(0, 8000), Plain(8000, 10000)
    if args.quick:
        args.epochs, train, val = 1, TwoViews(0, 1024), Plain(8000, 8301)

    torch.manual_seed(args.seed)
    config = scaletrain.TrainConfig()
    config.optim.epochs, config.optim.batch_size = args.epochs, args.batch_size
    config.data.num_workers = 0
    config.run.output_dir, config.run.seed = args.out, args.seed
    config.run.mixed_precision = args.mixed_precision
    scaletrain.fit(Encoder(), train, val, config, step=SimCLR(), metrics={"knn_accuracy": NearestNeighbourAccuracy()},
                   optimizer=lambda params: torch.optim.Adam(params, lr=args.lr))


if __name__ == "__main__":
    main()
