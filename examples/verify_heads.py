"""A small vision transformer with its own tensor-parallel plan, to prove with `scaletrain verify` that it trains
the same on every layout as on one process, and the same model with the bug that verify exists to find: its
attention viewed by the head count, which under --tp 2 computes something else without an error (each process holds
half the heads' columns). docs/verify.md walks through both.

    scaletrain verify --model examples/verify_heads.py:make --cpu                     # every layout equal
    scaletrain verify --model examples/verify_heads.py:make_by_count --layouts fsdp2,tp2 --cpu   # tp2 differs
    python examples/verify_heads.py --by-count --layouts fsdp2,tp2                    # the same from Python
"""

import argparse

import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim, heads, by_count):
        super().__init__()
        self.heads, self.head_dim, self.by_count = heads, dim // heads, by_count
        self.q, self.k, self.v, self.proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, n, _ = x.shape
        shape = (b, n, self.heads, -1) if self.by_count else (b, n, -1, self.head_dim)  # the planted bug: by count
        q, k, v = (f(x).view(shape).transpose(1, 2) for f in (self.q, self.k, self.v))
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, -1))


class Block(nn.Module):
    def __init__(self, dim, heads, by_count):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads, by_count)
        self.norm2, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm2(x)))))


class Patches(nn.Module):
    def __init__(self, in_chans, dim):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, dim, 7, stride=7)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class Pool(nn.Module):
    def __init__(self, dim, num_classes):
        super().__init__()
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, num_classes)

    def forward(self, x):
        return self.head(self.norm(x).mean(1))


class TinyViT(nn.Module):
    def __init__(self, num_classes, in_chans, dim=32, heads=4, depth=2, by_count=False):
        super().__init__()
        self.patch = Patches(in_chans, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads, by_count) for _ in range(depth)))
        self.pool = Pool(dim, num_classes)
        self.tp_plan = {f"blocks.{i}.{n}": s for i in range(depth) for n, s in
                        (("attn.q", "colwise"), ("attn.k", "colwise"), ("attn.v", "colwise"),
                         ("attn.proj", "rowwise"), ("fc1", "colwise"), ("fc2", "rowwise"))}

    def forward(self, x):
        return self.pool(self.blocks(self.patch(x)))


def make(num_classes, in_chans):
    return TinyViT(num_classes, in_chans)


def make_by_count(num_classes, in_chans):
    return TinyViT(num_classes, in_chans, by_count=True)


if __name__ == "__main__":
    import scaletrain

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--by-count", action="store_true", help="the planted bug: attention viewed by the head count")
    parser.add_argument("--layouts", default="ddp2,fsdp2,tp2,pp2")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="", help="verify's folder [default: verify/<timestamp>]")
    args = parser.parse_args()
    train, _ = scaletrain.load_image_sets("default")  # the embedded MNIST digits
    config = scaletrain.TrainConfig()
    config.optim.global_batch_size, config.run.output_dir, config.run.cpu = 32, args.out, True
    result = scaletrain.verify(lambda: TinyViT(len(train.classes), train.channels, by_count=args.by_count), train,
                               config, layouts=args.layouts.split(","), steps=args.steps)
    print("every layout equal" if result.equal else
          "different: " + ", ".join(f"{r.layout} at {r.first_module}" for r in result.layouts if not r.equal))
