"""A model bigger than one process: given to `fit` as a function, never whole in any process.

    python examples/big_model.py --out runs/whole --save-initial-weights                        # 1 process
    torchrun --nproc-per-node 2 examples/big_model.py --out runs/p2 --stages 2 \
        --init-from runs/whole/initial.safetensors                                              # 2 stages
    torchrun --nproc-per-node 2 examples/big_model.py --out runs/f2 --strategy fsdp \
        --init-from runs/whole/initial.safetensors                                              # 2 shards
    torchrun --nproc-per-node 2 examples/big_model.py --out runs/t2 --tp 2 \
        --init-from runs/whole/initial.safetensors                                              # layers split

Under fsdp, pipeline and --tp scaletrain calls `make_model` on the meta device (shapes, no memory) and each
process materialises only its stage, its shards or its part of each split layer. Without --init-from each
process's part holds what the whole model holds at the run's seed; with it, what the file holds, each process
reading only its own tensors or rows. Every run prints each process's peak memory (ru_maxrss) and the first
epoch's training loss.
"""

from __future__ import annotations

import argparse
import os
import resource

import torch
from torch import nn
from torch.utils.data import TensorDataset

import scaletrain


def make_model(width: int, depth: int, inputs: int = 64, classes: int = 10) -> nn.Sequential:
    """An MLP: inputs -> width, depth - 1 more layers of width x width, then the classes (ReLU between). Its
    tp_plan (for --tp) splits the width x width layers in pairs, as Megatron splits an MLP: the first of each pair
    by its outputs (colwise), the second by its inputs (rowwise), so that only the second's outputs are summed."""
    layers: list[nn.Module] = [nn.Linear(inputs, width)]
    for _ in range(depth - 1):
        layers += [nn.ReLU(), nn.Linear(width, width)]
    model = nn.Sequential(*layers, nn.ReLU(), nn.Linear(width, classes))
    square = [str(2 * i) for i in range(1, depth)]  # the width x width layers' names in the Sequential
    pairs = square[:len(square) // 2 * 2]
    model.tp_plan = {name: "colwise" if i % 2 == 0 else "rowwise" for i, name in enumerate(pairs)}
    return model


def data(n: int, seed: int, inputs: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, inputs, generator=g)
    return TensorDataset(x, (x[:, :5].sum(1) > 0).long() + 2 * (x[:, 5:10].sum(1) > 0).long())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", default="ddp", choices=("ddp", "fsdp", "pipeline"))
    parser.add_argument("--stages", type=int, default=0, help="2 or more: --strategy pipeline")
    parser.add_argument("--tp", type=int, default=1, help="2 or more: each pair of layers split over this many")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=8, help="layers of width x width, the first one included")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"))
    parser.add_argument("--init-from", default="", help="a whole model's weights file to start from")
    parser.add_argument("--save-initial-weights", action="store_true")
    parser.add_argument("--whole-object", action="store_true",
                        help="give fit the model object itself (built whole in every process) instead of a function")
    args = parser.parse_args()

    config = scaletrain.TrainConfig()
    config.optim.epochs, config.optim.global_batch_size = args.epochs, 32
    config.optim.optimizer, config.optim.lr, config.optim.scheduler = args.optimizer, 1e-4, "constant"
    config.optim.momentum = 0.0  # (SGD's) no state beside the weights
    config.optim.warmup_epochs = 0
    config.run.output_dir, config.run.log_with = args.out, "none"
    config.run.strategy = "pipeline" if args.stages else args.strategy
    config.run.stages, config.run.tp = args.stages, args.tp
    config.run.init_from, config.run.save_initial_weights = args.init_from, args.save_initial_weights
    build = lambda: make_model(args.width, args.depth)  # noqa: E731
    if args.whole_object:
        torch.manual_seed(config.run.seed)
    result = scaletrain.fit(build() if args.whole_object else build, data(args.samples, 1), data(64, 2), config)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak memory of rank {os.environ.get('RANK', '0')}: {peak:.0f} MiB", flush=True)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"first epoch's training loss {result.history[0]['train_loss']:.9f}", flush=True)


if __name__ == "__main__":
    main()
