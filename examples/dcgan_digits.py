"""PyTorch's DCGAN example as people write it (a generator of transposed convolutions and a discriminator of
convolutions, binary cross-entropy, two Adam optimizers with betas (0.5, 0.999), per batch a discriminator step on
real and fake images and then a generator step), sized for 28 x 28 digits, with its loop replaced by scaletrain: a
`Step` with two optimizers that it steps itself, in the example's order.

    python examples/dcgan_digits.py --quick
    torchrun --nproc-per-node 2 examples/dcgan_digits.py --quick
    python examples/dcgan_digits.py --quick --loss wgan-gp     # a WGAN-GP: a gradient penalty inside the step

The digits are the 10,000 MNIST images shipped with scaletrain, scaled to [-1, 1] as the example's transform does.
Each epoch writes samples.png (64 digits from a fixed noise) into the run folder.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

import scaletrain

NZ = 64  # the noise's size


class Digits(Dataset):
    """(1 x 28 x 28 image in [-1, 1], label)."""

    def __init__(self, start: int, stop: int):
        digits = scaletrain.data.embedded_mnist()
        self.images = digits.images[start:stop].float() / 127.5 - 1
        self.labels = digits.labels[start:stop]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], int(self.labels[i])


def weights_init(m: nn.Module) -> None:
    """The example's initialisation: convolutions N(0, 0.02), BatchNorm scales N(1, 0.02)."""
    if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
        nn.init.normal_(m.weight, 0.0, 0.02)
    elif isinstance(m, nn.BatchNorm2d):
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.zeros_(m.bias)


class GAN(nn.Module):
    """The two networks in one module, so that both are saved in one weights file."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.generator = nn.Sequential(
            nn.ConvTranspose2d(NZ, width * 4, 7, 1, 0, bias=False), nn.BatchNorm2d(width * 4), nn.ReLU(True),
            nn.ConvTranspose2d(width * 4, width * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(width * 2), nn.ReLU(True),
            nn.ConvTranspose2d(width * 2, 1, 4, 2, 1, bias=False), nn.Tanh())
        self.discriminator = nn.Sequential(
            nn.Conv2d(1, width, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(width, width * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(width * 2),
            nn.LeakyReLU(0.2, inplace=True), nn.Conv2d(width * 2, 1, 7, 1, 0, bias=False))  # logits: see DCGAN
        self.apply(weights_init)


class DCGAN(scaletrain.Step):
    """The example's batch: the discriminator on real (label 1) and fake (label 0) images, then the generator, whose
    fakes the discriminator should call real. The discriminator gives logits and the loss is BCEWithLogitsLoss, not
    PyTorch's example's Sigmoid and BCELoss: CUDA's autocast refuses BCELoss in fp16 and bf16 (the CPU's allows it)."""

    def __init__(self, lr: float = 2e-4):
        self.lr = lr
        self.criterion = nn.BCEWithLogitsLoss()

    def optimizers(self, model):
        return {"discriminator": torch.optim.Adam(model.discriminator.parameters(), lr=self.lr, betas=(0.5, 0.999)),
                "generator": torch.optim.Adam(model.generator.parameters(), lr=self.lr, betas=(0.5, 0.999))}

    def train_step(self, model, batch):
        real = batch[0]
        real_label, fake_label = torch.ones(len(real), device=real.device), torch.zeros(len(real), device=real.device)
        fake = model.generator(torch.randn(len(real), NZ, 1, 1, device=real.device))
        loss_d = self.criterion(model.discriminator(real).view(-1), real_label) + \
            self.criterion(model.discriminator(fake.detach()).view(-1), fake_label)
        self.optimize("discriminator", loss_d)
        loss_g = self.criterion(model.discriminator(fake).view(-1), real_label)
        self.optimize("generator", loss_g)
        return {"d": loss_d, "g": loss_g}


class WGANGP(DCGAN):
    """The same networks trained as a WGAN-GP (Gulrajani et al.): the discriminator is a critic of unbounded scores
    whose gradient at points between real and fake images is held near norm 1 (a penalty taken with
    torch.autograd.grad inside the step), Adam with betas (0.5, 0.9), and the generator stepped once every
    `critic_steps` batches, counted by the step: its state, saved in every checkpoint and restored on resume."""

    def __init__(self, lr: float = 1e-4, critic_steps: int = 5, penalty: float = 10.0):
        self.lr, self.critic_steps, self.penalty, self.batches = lr, critic_steps, penalty, 0

    def optimizers(self, model):
        return {"discriminator": torch.optim.Adam(model.discriminator.parameters(), lr=self.lr, betas=(0.5, 0.9)),
                "generator": torch.optim.Adam(model.generator.parameters(), lr=self.lr, betas=(0.5, 0.9))}

    def train_step(self, model, batch):
        real = batch[0]
        fake = model.generator(torch.randn(len(real), NZ, 1, 1, device=real.device))
        alpha = torch.rand(len(real), 1, 1, 1, device=real.device)
        mix = (alpha * real + (1 - alpha) * fake.detach()).requires_grad_(True)
        grad, = torch.autograd.grad(model.discriminator(mix).float().sum(), mix, create_graph=True)
        penalty = ((grad.flatten(1).norm(dim=1) - 1) ** 2).mean()
        loss_d = model.discriminator(fake.detach()).float().mean() - model.discriminator(real).float().mean()
        self.optimize("discriminator", loss_d + self.penalty * penalty)
        self.batches += 1
        if self.batches % self.critic_steps == 0:
            self.optimize("generator", -model.discriminator(fake).float().mean())
        return {"d": loss_d, "penalty": penalty}

    def state_dict(self):
        return {"batches": self.batches}

    def load_state_dict(self, state):
        self.batches = state["batches"]


def save_samples(model: GAN, path: Path, seed: int = 0) -> None:
    """64 digits from a fixed noise, as an 8 x 8 grid."""
    from torchvision.utils import save_image

    noise = torch.randn(64, NZ, 1, 1, generator=torch.Generator().manual_seed(seed))
    model.generator.eval()
    with torch.no_grad():
        images = model.generator(noise.to(next(model.parameters()).device)).cpu()
    model.generator.train()
    save_image(images, path, nrow=8, normalize=True, value_range=(-1, 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/dcgan-digits")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--seed", type=int, default=999)
    p.add_argument("--mixed-precision", default="no", choices=["no", "fp16", "bf16"])
    p.add_argument("--quick", action="store_true", help="1 epoch of 1,024 digits")
    p.add_argument("--loss", default="bce", choices=["bce", "wgan-gp"],
                   help="bce: the DCGAN example's; wgan-gp: a critic with a gradient penalty (see WGANGP)")
    args = p.parse_args()
    train = Digits(0, 10000)
    if args.quick:
        args.epochs, train = 1, Digits(0, 1024)

    torch.manual_seed(args.seed)
    model = GAN()
    config = scaletrain.TrainConfig()
    config.optim.epochs, config.optim.batch_size = args.epochs, args.batch_size
    config.data.num_workers = 0
    config.run.output_dir, config.run.seed = args.out, args.seed
    config.run.mixed_precision = args.mixed_precision

    def samples(row, step):
        if os.environ.get("RANK", "0") == "0":
            save_samples(model, Path(args.out) / "samples.png")

    step = DCGAN(args.lr) if args.loss == "bce" else WGANGP()
    scaletrain.fit(model, train, None, config, step=step, on_epoch=samples)


if __name__ == "__main__":
    main()
