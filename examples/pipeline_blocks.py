"""A model of your own, a stack of blocks, trained as pipeline stages: the same script on 1, 2 and 4 processes.

    python examples/pipeline_blocks.py --out runs/whole                                    # the model whole
    torchrun --nproc-per-node 2 examples/pipeline_blocks.py --out runs/p2 --stages 2        # 2 stages
    torchrun --nproc-per-node 4 examples/pipeline_blocks.py --out runs/p2x2 --stages 2      # 2 stages x 2 replicas
    torchrun --nproc-per-node 4 examples/pipeline_blocks.py --out runs/p2s2 --stages 2 --shard-stages  # fsdp in each
    torchrun --nproc-per-node 2 examples/pipeline_blocks.py --out runs/t2 --tp 2           # each block's MLP split

Each run ends with the same losses per epoch (up to float rounding) and writes last.safetensors, which loads into
the model unsplit (`--check` does so and scores it).
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn
from torch.utils.data import TensorDataset

import scaletrain


class Block(nn.Module):
    """A residual MLP block: the skip connection stays inside the block, so the model can be cut between blocks."""

    def __init__(self, width: int):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class BlockNet(nn.Module):
    tp_plan = {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}  # for --tp: each block's MLP split in two

    def __init__(self, inputs: int = 16, width: int = 32, depth: int = 4, classes: int = 4):
        super().__init__()
        self.embed = nn.Linear(inputs, width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)))


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return TensorDataset(x, (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--stages", type=int, default=0, help="0: the model whole (ddp); 2 or more: pipeline")
    parser.add_argument("--tp", type=int, default=1, help="2 or more: each block's fc1 and fc2 split (--tp)")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--clip-grad-norm", type=float, default=0.0, help="over every stage's gradients at once")
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--mixed-precision", default="no", choices=("no", "bf16", "fp16"))
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--checkpoint-every", type=int, default=0, help="optimizer steps between checkpoints")
    parser.add_argument("--shard-stages", action="store_true", help="each stage sharded over its replicas (fsdp)")
    parser.add_argument("--activation-checkpointing", action="store_true", help="recompute each block's activations")
    parser.add_argument("--check", action="store_true", help="load last.safetensors into the unsplit model")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = BlockNet(width=args.width, depth=args.depth)
    config = scaletrain.TrainConfig()
    config.optim.epochs, config.optim.batch_size = args.epochs, args.batch_size
    config.optim.grad_accum = args.grad_accum
    config.optim.optimizer, config.optim.lr, config.optim.scheduler = "adamw", 1e-3, "constant"
    config.optim.warmup_epochs, config.optim.clip_grad_norm = 0, args.clip_grad_norm
    config.run.output_dir, config.run.log_with = args.out, "none"
    config.run.checkpoint_every, config.run.mixed_precision = args.checkpoint_every, args.mixed_precision
    config.run.tp = args.tp
    if args.stages:
        config.run.strategy, config.run.stages, config.run.schedule = "pipeline", args.stages, args.schedule
        config.run.microbatches, config.run.shard_stages = args.microbatches, args.shard_stages
    config.model.activation_checkpointing = args.activation_checkpointing
    result = scaletrain.fit(model, data(args.samples, 1), data(128, 2), config)
    losses = ", ".join(f"{row['train_loss']:.6f}" for row in result.history)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"train losses: {losses}; val accuracy {result.best_val_accuracy:.4f}")
    if args.check and int(os.environ.get("RANK", "0")) == 0:
        from safetensors.torch import load_file

        whole = BlockNet(width=args.width, depth=args.depth)
        whole.load_state_dict(load_file(f"{args.out}/last.safetensors"))
        x, y = data(128, 2).tensors
        print(f"last.safetensors in the unsplit model: accuracy {(whole(x).argmax(1) == y).float().mean():.4f}")


if __name__ == "__main__":
    main()
