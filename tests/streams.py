"""Scripts of the shapes users bring with their own data order, cut from the embedded digits: streams (an
`IterableDataset`: plain, sharding itself unevenly by rank, or resumable through state_dict()) and a sampler (a
`WeightedRandomSampler` balancing a 90/10 two-class set). Imported by the tests, and run on one or two processes:

    python tests/streams.py CASE OUT                torchrun --nproc-per-node 2 tests/streams.py CASE OUT

which trains CASE through scaletrain.fit into the run folder OUT/run and writes OUT/result.json (the history) and
OUT/seen-RANK.json (each training batch's targets as the loss saw them), so the tests can see which samples
trained and in which order. CASE is split, uneven, stateful or sampler; SCALETRAIN_FAULT stops it
where a test wants (see scaletrain/training/faults.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, WeightedRandomSampler

import scaletrain
from scaletrain.config import TrainConfig

TRAIN, VAL = (0, 300), (300, 401)  # 101 validation items: uneven on two processes


def _digits(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    digits = scaletrain.data.embedded_mnist()
    return digits.images[start:stop].float() / 255, digits.labels[start:stop]


class Digits(IterableDataset):
    """A plain stream of (image, label, index): scaletrain splits it among ranks and workers."""

    def __init__(self, start: int, stop: int):
        self.x, self.y = _digits(start, stop)
        self.index = torch.arange(start, stop)

    def __iter__(self):
        for i in range(len(self.y)):
            yield self.x[i], {"label": self.y[i], "index": self.index[i]}


def _rank_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class Uneven(Digits):
    """A stream that shards itself, unevenly: on two processes rank 0 reads the first 80 % of the items, rank 1 the
    rest (one process reads them all)."""

    shards_by_rank = True

    def __iter__(self):
        rank, world = _rank_world()
        cut = int(len(self.y) * 0.8) if world == 2 else len(self.y)
        mine = range(0, cut) if rank == 0 else range(cut, len(self.y))
        for i in mine:
            yield self.x[i], {"label": self.y[i], "index": self.index[i]}


class Resumable(Digits):
    """A plain stream that can say where it is and continue from there (the state_dict protocol), reshuffled per
    epoch by set_epoch."""

    def __init__(self, start: int, stop: int):
        super().__init__(start, stop)
        self.epoch, self.position = 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]

    def __iter__(self):
        order = torch.randperm(len(self.y), generator=torch.Generator().manual_seed(self.epoch))
        while self.position < len(order):
            i = int(order[self.position])
            self.position += 1
            yield self.x[i], {"label": self.y[i], "index": self.index[i]}
        self.position = 0


class Skewed(Dataset):
    """Two classes, 90 % zeros and 10 % ones: (image, {label, index})."""

    def __init__(self, n: int = 400):
        x, y = _digits(0, n)
        self.x, self.y = x, (torch.arange(n) % 10 == 0).long()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], {"label": self.y[i], "index": torch.tensor(i)}


class Recorded(nn.Module):
    """Cross-entropy on the label, recording each training batch's (label, index) pairs."""

    def __init__(self):
        super().__init__()
        self.seen: list[list[list[int]]] = []

    def forward(self, outputs, targets):
        if torch.is_grad_enabled():
            self.seen.append(torch.stack([targets["label"], targets["index"]], 1).tolist())
        return nn.functional.cross_entropy(outputs, targets["label"])


def make_net(classes: int = 10) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, classes))


def config(out: Path, **optim) -> TrainConfig:
    cfg = TrainConfig()
    cfg.optim.epochs, cfg.optim.batch_size = 2, int(os.environ.get("BATCH", "16"))
    cfg.model.find_unused_parameters = "no"  # no probing forward: the loss sees the training batches only
    for k, v in optim.items():
        setattr(cfg.optim, k, v)
    cfg.data.num_workers = int(os.environ.get("WORKERS", "0"))
    cfg.optim.steps_per_epoch = int(os.environ.get("STEPS", "0"))
    cfg.run.output_dir, cfg.run.checkpoint_every = str(out / "run"), 2
    return cfg


def main(case: str, out: Path) -> None:
    loss = Recorded()
    stream = dict(scheduler="constant", warmup_epochs=0)
    if case == "sampler":
        data = Skewed()
        sampler = WeightedRandomSampler(torch.where(data.y == 1, 9.0, 1.0), num_samples=len(data))
        result = scaletrain.fit(make_net(2), data, None, config(out), loss_fn=loss, sampler=sampler,
                                metrics={})
    else:
        kind = {"split": Digits, "uneven": Uneven, "stateful": Resumable}[case]
        model = make_net()
        result = scaletrain.fit(model, kind(*TRAIN), kind(*VAL), config(out, **stream), loss_fn=loss)
    rank = int(os.environ.get("RANK", "0"))
    (out / f"seen-{rank}.json").write_text(json.dumps(loss.seen))
    if rank == 0:
        (out / "result.json").write_text(json.dumps({"history": result.history}))
    if os.environ.get("SCORE") and case != "sampler":
        score(model, kind, out)


def score(model: nn.Module, kind, out: Path) -> None:
    """predict and evaluate over the validation stream, against the same items as a Dataset on one process:
    OUT/scored.json."""
    cfg = config(out)
    cfg.run.output_dir = ""
    loss = lambda outputs, targets: nn.functional.cross_entropy(outputs, targets["label"], reduction="none")  # noqa
    outputs = scaletrain.predict(model, kind(*VAL), cfg)
    path = scaletrain.predict(model, kind(*VAL), cfg, output=out / "outputs.npy")
    measured = scaletrain.evaluate(model, kind(*VAL), cfg, loss)
    if int(os.environ.get("RANK", "0")) == 0:
        x, y = _digits(*VAL)
        with torch.no_grad():
            alone = model.eval()(x)
        whole = nn.functional.cross_entropy(alone, y).item()
        (out / "scored.json").write_text(json.dumps({
            "rows": len(outputs), "npy_rows": len(np.load(path)), "samples": measured["samples"],
            "loss": measured["loss"], "loss_of_dataset": whole,
            "max_difference_to_dataset": (outputs - alone).abs().max().item()}))


def seen(out: Path) -> list[list[list[int]]]:
    """Per training step (across the runs of OUT), the global batch's (label, index) pairs, every rank's."""
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("seen-*.json"))]
    return [sum((r[k] for r in ranks if k < len(r)), []) for k in range(max(map(len, ranks)))]

if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
