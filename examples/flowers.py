"""A folder of flower photos, torchvision's resnet34 with weights loaded wherever their shapes match, every layer
but the classifier frozen, SyncBatchNorm, SGD and a cosine schedule, as people write it for one GPU (an
ImageFolder with torchvision transforms), with the training loop replaced by scaletrain. The random crops and flips
are drawn anew for every batch from seeds scaletrain sets, so a run resumed mid-epoch draws what it would have.

    python examples/flowers.py --quick
    torchrun --nproc-per-node 2 examples/flowers.py --quick
    accelerate launch --multi_gpu --num_processes 2 examples/flowers.py --quick

Without --data it paints a folder of five kinds of flower-like pictures to learn from (no download here); the
"pretrained" weights are a resnet34 of 1,000 classes saved by the script, where you would use torchvision's file.
"""

from __future__ import annotations

import argparse
import math
import os
import random
from pathlib import Path

import torch
from PIL import Image, ImageDraw, ImageFilter
from torch import nn
from torchvision import datasets, models, transforms

import scaletrain

KINDS = {"daisy": ((250, 250, 245), 12), "dandelion": ((250, 210, 30), 30), "rose": ((200, 20, 60), 7),
         "sunflower": ((255, 180, 0), 16), "tulip": ((235, 90, 160), 5)}
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def paint_flowers(folder: Path, per_kind: int, size: int = 96) -> None:
    """folder/<kind>/<n>.jpg: petals of the kind's colour and number around a centre, on a green-brown ground."""
    if folder.is_dir():
        return
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}")
    rng = random.Random(0)
    for kind, (colour, petals) in KINDS.items():
        (tmp / kind).mkdir(parents=True)
        for n in range(per_kind):
            img = Image.new("RGB", (size, size), (rng.randint(40, 90), rng.randint(90, 140), rng.randint(30, 70)))
            draw = ImageDraw.Draw(img)
            cx, cy, r = rng.uniform(0.35, 0.65) * size, rng.uniform(0.35, 0.65) * size, rng.uniform(0.2, 0.35) * size
            turn = rng.uniform(0, math.pi)
            shade = tuple(max(0, min(255, c + rng.randint(-25, 25))) for c in colour)
            for k in range(petals):
                a = turn + 2 * math.pi * k / petals
                px, py = cx + 0.6 * r * math.cos(a), cy + 0.6 * r * math.sin(a)
                draw.ellipse([px - r / 3, py - r / 3, px + r / 3, py + r / 3], fill=shade)
            draw.ellipse([cx - r / 4, cy - r / 4, cx + r / 4, cy + r / 4], fill=(90, 60, 20))
            img.filter(ImageFilter.GaussianBlur(0.6)).save(tmp / kind / f"{n}.jpg", quality=90)
    try:
        os.replace(tmp, folder)  # another process may have painted it first
    except OSError:
        pass


def load_matching(model: nn.Module, path: Path) -> None:
    """Load the tensors of a state dict whose shapes fit the model (not the 1,000-class head)."""
    own = model.state_dict()
    weights = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict({k: v for k, v in weights.items() if k in own and own[k].shape == v.shape}, strict=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="runs/flowers-data", help="a folder with one subfolder per class")
    p.add_argument("--weights", default="runs/resnet34-imagenet-shaped.pth")
    p.add_argument("--out", default="runs/flowers")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--image-size", type=int, default=96)
    p.add_argument("--freeze-layers", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--quick", action="store_true", help="1 epoch of 100 pictures at 48 px")
    args = p.parse_args()
    if args.quick:
        args.epochs, args.image_size = 1, 48
    paint_flowers(Path(args.data), per_kind=20 if args.quick else 80)
    weights = Path(args.weights)
    if not weights.is_file():
        weights.parent.mkdir(parents=True, exist_ok=True)
        tmp = weights.with_name(f".{weights.name}.{os.getpid()}")
        torch.save(models.resnet34(num_classes=1000).state_dict(), tmp)
        os.replace(tmp, weights)

    size = args.image_size
    train_tf = transforms.Compose([transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    val_tf = transforms.Compose([transforms.Resize(round(size * 1.14)), transforms.CenterCrop(size),
                                 transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    everything = datasets.ImageFolder(args.data)
    order = torch.randperm(len(everything), generator=torch.Generator().manual_seed(0)).tolist()
    cut = int(0.8 * len(order))
    train = torch.utils.data.Subset(datasets.ImageFolder(args.data, train_tf), order[:cut])
    val = torch.utils.data.Subset(datasets.ImageFolder(args.data, val_tf), order[cut:])

    model = models.resnet34(num_classes=len(everything.classes))
    load_matching(model, weights)
    if args.freeze_layers:
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(name.startswith("fc."))

    config = scaletrain.TrainConfig()
    config.optim.epochs, config.optim.batch_size = args.epochs, args.batch_size
    config.model.sync_bn = True  # one set of BatchNorm statistics across the processes
    config.data.num_workers = 2
    config.run.output_dir = args.out
    scaletrain.fit(model, train, val, config,  # the class names: from the Subsets' ImageFolder
                   optimizer=lambda params: torch.optim.SGD([q for q in params if q.requires_grad], lr=args.lr,
                                                            momentum=0.9, weight_decay=0.005),
                   scheduler=lambda optimizer, total: torch.optim.lr_scheduler.LambdaLR(
                       optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / total)) * 0.99 + 0.01))


if __name__ == "__main__":
    main()
