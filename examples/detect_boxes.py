"""torchvision's object detection finetuning tutorial as people write it (items `(image, {"boxes", "labels"})`,
`collate_fn=lambda batch: tuple(zip(*batch))`, `model(images, targets)` returning a dict of losses in training and
a list of detections in evaluation, SGD with StepLR stepped per epoch, mAP from torchmetrics), with its loop
replaced by scaletrain: a `Step` says how a batch reaches the model in training and in evaluation, and the mAP is
over every validation image exactly once on any number of processes.

    python examples/detect_boxes.py --quick
    torchrun --nproc-per-node 2 examples/detect_boxes.py --quick

Offline and small: the images are synthetic (squares of two colours on noise, one to three per image), and the
detector is torchvision's Faster R-CNN built without pretrained weights around a small convolutional backbone.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import Dataset
from torchmetrics.detection import MeanAveragePrecision
from torchvision.models.detection import FasterRCNN
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.ops import MultiScaleRoIAlign

import scaletrain

SIZE, CLASSES = 96, 3  # background, red squares, blue squares


class Squares(Dataset):
    """(3 x 96 x 96 float image, {"boxes": N x 4 (x1, y1, x2, y2), "labels": N}) of 1-3 coloured squares."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            image = torch.rand(3, SIZE, SIZE, generator=g) * 0.3
            count = int(torch.randint(1, 4, (), generator=g))
            boxes, labels = [], []
            for _ in range(count):
                side = int(torch.randint(16, 40, (), generator=g))
                x, y = (int(v) for v in torch.randint(0, SIZE - side, (2,), generator=g))
                label = int(torch.randint(1, CLASSES, (), generator=g))
                image[label - 1, y:y + side, x:x + side] = 0.9  # red (channel 0) or blue-ish (channel 1)
                boxes.append([x, y, x + side, y + side])
                labels.append(label)
            self.items.append((image, {"boxes": torch.tensor(boxes, dtype=torch.float32),
                                       "labels": torch.tensor(labels, dtype=torch.int64)}))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate(batch):
    return tuple(zip(*batch))


def make_detector() -> FasterRCNN:
    backbone = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
                             nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
                             nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU())
    backbone.out_channels = 64
    anchors = AnchorGenerator(sizes=((16, 32, 48),), aspect_ratios=((1.0,),))
    pooler = MultiScaleRoIAlign(featmap_names=["0"], output_size=7, sampling_ratio=2)
    return FasterRCNN(backbone, num_classes=CLASSES, rpn_anchor_generator=anchors, box_roi_pool=pooler,
                      min_size=SIZE, max_size=SIZE, rpn_pre_nms_top_n_train=300, rpn_post_nms_top_n_train=100,
                      rpn_pre_nms_top_n_test=200, rpn_post_nms_top_n_test=50, box_batch_size_per_image=64,
                      box_detections_per_img=10)


class Detection(scaletrain.Step):
    """The tutorial's two calls: the losses from images and targets in training, detections in evaluation."""

    def train_step(self, model, batch):
        images, targets = batch
        return model(list(images), list(targets))  # loss_classifier, loss_box_reg, loss_objectness, ...

    def eval_step(self, model, batch):
        images, targets = batch
        return model(list(images)), list(targets)  # what MeanAveragePrecision.update takes


class BoxMAP(MeanAveragePrecision):
    """The mAP over IoU 0.5:0.95, the tutorial's headline figure (MeanAveragePrecision computes a dict)."""

    def compute(self):
        return super().compute()["map"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/detect-boxes")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mixed-precision", default="no", choices=["no", "fp16", "bf16"])
    p.add_argument("--quick", action="store_true", help="2 epochs of 200 images")
    args = p.parse_args()
    train, val = Squares(600, seed=0), Squares(101, seed=1)
    if args.quick:
        args.epochs, train, val = 2, Squares(200, seed=0), Squares(21, seed=1)

    torch.manual_seed(args.seed)
    config = scaletrain.TrainConfig()
    config.optim.epochs, config.optim.batch_size = args.epochs, args.batch_size
    config.data.num_workers = 0
    config.run.output_dir, config.run.seed = args.out, args.seed
    config.run.mixed_precision = args.mixed_precision
    scaletrain.fit(make_detector(), train, val, config, step=Detection(), collate_fn=collate,
                   metrics={"map": BoxMAP()},
                   optimizer=lambda params: torch.optim.SGD([q for q in params if q.requires_grad], lr=args.lr,
                                                            momentum=0.9, weight_decay=0.0005),
                   scheduler=scaletrain.Schedule(lambda opt: torch.optim.lr_scheduler.StepLR(
                       opt, step_size=4, gamma=0.1), interval="epoch"))


if __name__ == "__main__":
    main()
