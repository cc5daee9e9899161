"""--tp N: each layer of a plan split over N processes on DTensor, beside ddp and fsdp over the others. A timm ViT
split by heads, a user's own transformer with its tp_plan and a Transformers model with its _tp_plan each end where
the model trained whole on one process does; a tp checkpoint resumes on one process; each process holds its part
of the split layers; a stalled process is named by its tensor-parallel rank; every refusal on one line."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from helpers import run_cli, run_python, train_cli
from scaletrain.commands.train import job_shape
from scaletrain.config import TrainConfig
from scaletrain.errors import UserError
from scaletrain.parallel.tensor import plan_for

VIT = '''
import timm


def make(num_classes, in_chans):
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=4, num_heads=4, embed_dim=64,
                             num_classes=num_classes, in_chans=in_chans)
'''
TRAINING = ["--image-size", "32", "--batch-size", "8", "--augment", "none", "--log-with", "none", "--optimizer",
            "adamw", "--lr", "0.001", "--clip-grad-norm", "0.5", "--no-channels-last", "--scheduler", "constant",
            "--warmup-epochs", "0"]  # a 1-epoch run is the first epoch of a 2-epoch one


def _vit():
    import timm

    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=4, num_heads=4, embed_dim=64,
                             num_classes=10, in_chans=1)


@pytest.fixture(scope="module")
def vit_runs(tmp_path_factory, mnist):
    """A ViT (4 blocks, 4 heads, 32 px) trained 2 epochs whole on one process, and with --tp 2 for one epoch that
    one process then resumes for the second."""
    tmp = tmp_path_factory.mktemp("tp")
    images, labels = mnist.images[:, 0].numpy(), mnist.labels.numpy()
    data = tmp / "digits.npz"
    np.savez(data, images=images[:64], labels=labels[:64], val_images=images[64:101], val_labels=labels[64:101])
    (tmp / "vit.py").write_text(VIT)
    common = ["--model", str(tmp / "vit.py:make"), *TRAINING]
    whole = train_cli(data, tmp / "whole", *common, "--epochs", "2", "--nproc", "1")
    split = train_cli(data, tmp / "tp2", *common, "--epochs", "1", "--nproc", "2", "--tp", "2")
    resumed = train_cli(data, tmp / "tp2", *common, "--epochs", "2", "--nproc", "1")
    return tmp, data, common, whole, split, resumed


def _rows(run: Path) -> list[dict[str, str]]:
    with (run / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.slow
def test_a_vit_split_by_heads_ends_where_the_whole_model_does_and_resumes_on_one_process(vit_runs):
    tmp, _, _, whole, split, resumed = vit_runs
    assert "timm's vision transformer plan, 16 layers: 4 q, k, v split by heads, 8 rowwise, 4 colwise; built on " \
           "the meta device, each process materialised only its part" in split.stdout
    assert "resuming from" in resumed.stdout
    for a, b in zip(_rows(tmp / "whole"), _rows(tmp / "tp2"), strict=True):  # epoch 1 on 2 processes, 2 on one
        for key in ("train_loss", "val_loss", "val_accuracy"):
            assert float(a[key]) == pytest.approx(float(b[key]), abs=1e-4), (a["epoch"], key)
    weights = load_file(str(tmp / "tp2" / "last.safetensors"))
    assert _close(weights, load_file(str(tmp / "whole" / "last.safetensors"))) < 1e-4
    _vit().load_state_dict(weights, strict=True)  # whole tensors under the unsplit model's names and shapes


@pytest.mark.slow
def test_tp_2_by_fsdp_2_on_four_processes_ends_where_the_whole_model_does(vit_runs):
    tmp, data, common, *_ = vit_runs
    proc = train_cli(data, tmp / "tp2-fsdp2", *common, "--epochs", "2", "--nproc", "4", "--tp", "2",
                     "--strategy", "fsdp", "--batch-size", "4")  # 2 replicas x 4: the whole run's batch of 8
    assert "tensor parallelism over 2 processes x 2 data replica(s) (fsdp)" in proc.stdout
    for a, b in zip(_rows(tmp / "whole"), _rows(tmp / "tp2-fsdp2"), strict=True):
        assert float(a["train_loss"]) == pytest.approx(float(b["train_loss"]), abs=1e-4)
        assert float(a["val_loss"]) == pytest.approx(float(b["val_loss"]), abs=1e-4)
    weights = load_file(str(tmp / "tp2-fsdp2" / "last.safetensors"))
    assert _close(weights, load_file(str(tmp / "whole" / "last.safetensors"))) < 1e-4


THREE = '''
import sys
import torch
from torch import nn
from torch.utils.data import TensorDataset
from timm.models.vision_transformer import Block
import scaletrain


class Pool(nn.Module):
    def forward(self, x):
        return x.mean(1)


class Tokens(nn.Module):  # timm's transformer blocks between an embedding and a head: stages can be cut
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.blocks = nn.Sequential(*(Block(32, 4, qkv_bias=True) for _ in range(4)))
        self.head = nn.Sequential(Pool(), nn.Linear(32, 3))

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)))


out, tp, stages, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
x = torch.randn(96, 6, 8, generator=torch.Generator().manual_seed(0))
data = TensorDataset(x, (x[:, 0, 0] > 0).long() + (x[:, 1, 0] > 0).long())
config = scaletrain.TrainConfig()
config.optim.epochs, config.optim.global_batch_size, config.run.log_with = epochs, 16, "none"
config.optim.optimizer, config.optim.lr, config.optim.clip_grad_norm = "adamw", 1e-3, 0.5
config.optim.scheduler, config.optim.warmup_epochs = "constant", 0
config.run.tp, config.run.output_dir = tp, out
if stages:
    config.run.strategy, config.run.stages = "pipeline", stages
scaletrain.fit(Tokens, data, data, config)
'''


@pytest.mark.slow
def test_two_stages_each_split_over_two_processes_end_where_the_whole_model_does_and_resume_on_one(tmp_path):
    script = tmp_path / "three.py"
    script.write_text(THREE)
    whole = run_python([sys.executable, str(script), str(tmp_path / "whole"), "1", "0", "2"])
    assert whole.returncode == 0, whole.stderr[-3000:]
    split = run_python([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                        str(script), str(tmp_path / "3d"), "2", "2", "1"])  # pp 2 x tp 2, one epoch
    assert split.returncode == 0, split.stderr[-3000:]
    assert "pipeline of 2 stages x 1 replica(s), each stage's layers split over 2 processes (timm's vision " \
           "transformer plan" in split.stdout
    resumed = run_python([sys.executable, str(script), str(tmp_path / "3d"), "1", "0", "2"])  # on one process
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-3000:]
    for a, b in zip(_rows(tmp_path / "whole"), _rows(tmp_path / "3d"), strict=True):
        assert float(a["train_loss"]) == pytest.approx(float(b["train_loss"]), abs=1e-4)
        assert float(a["val_loss"]) == pytest.approx(float(b["val_loss"]), abs=1e-4)
    assert _close(load_file(str(tmp_path / "whole" / "last.safetensors")),
                  load_file(str(tmp_path / "3d" / "last.safetensors"))) < 1e-4


@pytest.mark.slow
def test_a_stalled_process_is_named_by_its_tensor_parallel_rank(vit_runs):
    tmp, data, common, *_ = vit_runs
    proc = train_cli(data, tmp / "stall", *common, "--epochs", "1", "--nproc", "2", "--tp", "2",
                     "--stall-timeout", "5", env={"SCALETRAIN_FAULT": "hang:2:1"}, expect=6)
    assert "rank 1 stalled in" in proc.stderr and "tensor-parallel rank 2 of 2" in proc.stderr.splitlines()[-1]


MINE = '''
import json, os, sys
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
import scaletrain


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))
        self.head_dim = dim // heads

    def forward(self, x):
        b, n, _ = x.shape  # -1: the heads this process holds
        q, k, v = (f(x).view(b, n, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, -1))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Net(nn.Module):
    tp_plan = {"blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
               "blocks.*.attn.out": "rowwise", "blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise",
               "blocks.*.norm1": "sequence", "blocks.*.norm2": "sequence"}

    def __init__(self, dim=32, heads=4, depth=2, classes=3):
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(depth)))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, x):
        return self.head(self.norm(self.blocks(self.embed(x))).mean(1))


def llama():
    from transformers import LlamaConfig, LlamaForSequenceClassification

    return LlamaForSequenceClassification(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_labels=3, pad_token_id=0))


out, tp, which = sys.argv[1], int(sys.argv[2]), sys.argv[3]
g = torch.Generator().manual_seed(0)
if which == "mine":
    x = torch.randn(96, 6, 8, generator=g)
    data = TensorDataset(x, (x[:, 0, 0] > 0).long() + (x[:, 1, 0] > 0).long())
else:
    x = torch.randint(1, 64, (96, 12), generator=g)
    data = TensorDataset(x, x[:, 0] % 3)
config = scaletrain.TrainConfig()
config.optim.epochs, config.optim.batch_size, config.run.log_with = 2, 16, "none"
config.optim.optimizer, config.optim.lr, config.optim.clip_grad_norm = "adamw", 1e-3, 0.5
config.run.tp, config.run.output_dir = tp, out
made = []
make = Net if which == "mine" else llama
scaletrain.fit(lambda: made.append(make()) or made[-1], data, data, config,
               output_key=None if which == "mine" else "logits")
model = made[0]  # the one trained (the others: its constructor replayed for each process's part)
local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
with open(f"{out}-rank{os.environ.get('RANK', 0)}.json", "w") as f:
    json.dump({"local": local}, f)
'''


@pytest.mark.slow
@pytest.mark.parametrize("which", ["mine", "llama"])
def test_a_users_transformer_with_its_plan_and_a_transformers_model_end_where_the_whole_model_does(tmp_path, which):
    script = tmp_path / "script.py"
    script.write_text(MINE)
    one = run_python([sys.executable, str(script), str(tmp_path / "one"), "1", which])
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_python([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                      str(script), str(tmp_path / "two"), "2", which])
    assert two.returncode == 0, two.stderr[-3000:]
    source = "the model's tp_plan, 16 layers: 8 colwise, 4 rowwise, 4 sequence" if which == "mine" else \
        "the Transformers model's _tp_plan, 15 layers: 1 embedding rowwise, 10 colwise, 4 rowwise"
    assert source in two.stdout
    for a, b in zip(_rows(tmp_path / "one"), _rows(tmp_path / "two"), strict=True):
        assert float(a["train_loss"]) == pytest.approx(float(b["train_loss"]), abs=1e-4)
    assert _close(load_file(str(tmp_path / "one" / "last.safetensors")),
                  load_file(str(tmp_path / "two" / "last.safetensors"))) < 1e-4
    held = [json.loads((tmp_path / f"two-rank{r}.json").read_text())["local"] for r in (0, 1)]
    whole = json.loads((tmp_path / "one-rank0.json").read_text())["local"]
    if which == "mine":  # per block: q, k, v, out, fc1, fc2 weights split and q, k, v, fc1 biases; the rest whole
        split = 2 * (4 * 32 * 32 + 2 * 32 * 128 + 3 * 32 + 128)
        assert held == [whole - split // 2] * 2
    else:
        assert max(held) < 0.6 * whole


# -- refusals ---------------------------------------------------------------------------------------------------
class Tiny(nn.Module):
    def __init__(self, plan=None, tied=False):
        super().__init__()
        self.fc, self.norm, self.out = nn.Linear(8, 6), nn.LayerNorm(6), nn.Linear(6, 8)
        if tied:
            self.out.weight = nn.Parameter(self.fc.weight.t())
            self.back = nn.Linear(8, 6)
            self.back.weight = self.fc.weight
        if plan is not None:
            self.tp_plan = plan


@pytest.mark.parametrize("model, tp, message", [
    (Tiny(), 2, "--tp 2: no tensor-parallel plan for Tiny: scaletrain splits timm's vision transformers (ViT, "
                "DeiT) and Transformers models by their own _tp_plan; give your model a tp_plan attribute"),
    (Tiny({"fc": "colwise", "head": "rowwise"}), 2, "the model's tp_plan names head, which the model lacks (its "
                                                    "modules include fc, norm, out)"),
    (Tiny({"fc": "columns"}), 2, "the model's tp_plan: fc: style 'columns'; expected one of colwise, rowwise, "
                                 "sequence"),
    (Tiny({"norm": "colwise"}), 2, "--tp: norm is a LayerNorm; colwise splits a Linear or an Embedding"),
    (Tiny({"fc": "colwise", "out": "rowwise"}), 4, "--tp 4: fc has 6 output features, which 4 processes cannot "
                                                   "share (colwise)"),
    (Tiny({}), 2, "the model's tp_plan: expected a non-empty dict"),
    (Tiny({"fc": "colwise"}, tied=True), 2, "--tp 2: fc.weight and back.weight are one tensor (tied weights), which "
                                            "splitting fc would untie"),
], ids=["no-plan", "missing-layer", "style", "not-linear", "features", "empty", "tied"])
def test_a_plan_that_cannot_split_the_model_is_refused_on_one_line(model, tp, message):
    with pytest.raises(UserError) as e:
        plan_for(model, tp)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_head_count_the_processes_cannot_share_is_refused_and_vit_gets_its_plan():
    with pytest.raises(UserError, match=r"^--tp 3: blocks.0.attn has 4 heads, which 3 processes cannot share; "
                                        r"give a --tp that divides 4$"):
        plan_for(_vit(), 3)
    plan = plan_for(_vit(), 2)
    assert plan.styles["blocks.3.attn.qkv"] == "heads" and plan.styles["blocks.3.mlp.fc2"] == "rowwise"
    assert plan.divided["blocks.0.attn"] == ("num_heads", "attn_dim")


@pytest.mark.parametrize("overrides, message", [
    ({"tp": 0}, "--tp must be 1 (off) or a number of processes each layer is split over, got 0"),
    ({"tp": 2, "strategy": "dp"}, "--tp is not available with --strategy dp; use ddp, fsdp or pipeline"),
])
def test_settings_tp_cannot_run_are_refused_before_anything_starts(overrides, message):
    config = TrainConfig()
    for key, value in overrides.items():
        setattr(config.optim if key == "ema_decay" else config.run, key, value)
    with pytest.raises(UserError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        config.validate()


def test_a_process_count_tp_does_not_divide_is_refused_naming_auto():
    config = TrainConfig()
    config.run.tp = 2
    with pytest.raises(UserError, match=r"^--tp 2 needs a multiple of 2 processes \(--nproc x --nnodes\), got 1 "
                                        r"\(--nproc auto: one per GPU, 1 on the CPU\)$"):
        job_shape(config.validate().run)
    config.run.nproc = 3
    with pytest.raises(UserError, match=r"^--tp 2 needs a multiple of 2 processes \(--nproc x --nnodes\), got 3$"):
        job_shape(config.validate().run)


@pytest.mark.slow
def test_a_model_without_a_plan_is_refused_on_one_line_by_the_command(small_npz, tmp_path):
    proc = run_cli("train", "--data", str(small_npz), "--model", "tinycnn", "--epochs", "1", "--nproc", "2", "--tp",
                   "2", "--log-with", "none", "--output-dir", str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "scaletrain: error: --tp 2: no tensor-parallel plan for SmallCNN" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_estimate_memory_counts_one_processs_part_and_names_the_layouts_that_fit():
    from scaletrain.measure.memory import estimate, layouts

    import timm

    whole = timm.create_model("vit_small_patch16_224", img_size=32, num_classes=10)
    split = 0
    for block in whole.blocks:  # fc1 split with its bias; q, k, v, proj and fc2 split, their biases whole
        for layer, bias in ((block.attn.qkv, False), (block.attn.proj, False), (block.mlp.fc1, True),
                            (block.mlp.fc2, False)):
            split += layer.weight.numel() + (layer.bias.numel() if bias else 0)
    total = sum(p.numel() for p in whole.parameters())
    one = estimate("vit_small_patch16_224", image_size=32, nproc=2, tp=2, batch_size=8)
    assert one.parts["parameters"] == 4 * (total - split // 2)
    assert one.parts["activations"] < estimate("vit_small_patch16_224", image_size=32, batch_size=8).parts[
        "activations"]
    found, picked = layouts("vit_small_patch16_224", 4, image_size=32, batch_size=8, device_memory="64GB")
    assert [f.name for f in found] == ["ddp", "fsdp", "tp 2 x ddp 2", "tp 2 x fsdp 2", "tp 4", "pipeline of 4 stages"]
    assert picked.name == "ddp" and found[4].why.startswith("--tp 4: blocks.0.attn has 6 heads")
    squeezed, tight = layouts("vit_small_patch16_224", 4, image_size=32, batch_size=8,
                              device_memory=int(found[2].estimate.total / 0.9) + 1)  # tp 2 x ddp 2 fits, ddp not
    before = squeezed[:[f.name for f in squeezed].index(tight.name)]
    assert tight.fits and before and not any(f.fits for f in before) and "ddp" in [f.name for f in before]
