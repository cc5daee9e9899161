"""Every layout composes and every pair of layouts resumes: a run's first epoch on one layout and its second on
another ends where the same two epochs on one process do, each second run's own weights file (gathered tensor by
tensor from its parts) checked against the whole run's. A representative subset of benchmarks/layouts.py's matrix,
on a timm ViT with channels_last at its default, under SGD with momentum and a clipping norm that every step
reaches (a norm off by any factor moves the weights); and a user's transformer through the Python API with AdamW:
a stream, evaluate and predict under --tp read the same samples on both processes of a split layer, the model object
holds the trained weights whole after fit, and an optimizer asked for foreach kernels steps split and whole
parameters together."""

from __future__ import annotations

import shutil
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from helpers import run_python, train_cli

pytestmark = pytest.mark.slow  # every test here trains on 2 or 4 processes

VIT = '''
import timm


def make(num_classes, in_chans):
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=4, depth=2, num_heads=4, embed_dim=64,
                             num_classes=num_classes, in_chans=in_chans)
'''
# a constant rate and no warm-up: a 1-epoch run is the first epoch of a 2-epoch one; a global batch of 16 on any
# layout; the gradient norm (above 1 at every step here) clipped to 0.05
TRAINING = ["--image-size", "32", "--global-batch-size", "16", "--augment", "none", "--log-with", "none",
            "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9", "--clip-grad-norm", "0.05", "--scheduler",
            "constant", "--warmup-epochs", "0", "--checkpoint-every", "0"]
LAYOUTS = {"1 process": ["--nproc", "1"], "tp 2": ["--nproc", "2", "--tp", "2"],
           "tp 2 x ddp 2": ["--nproc", "4", "--tp", "2"], "tp 2 x fsdp 2": ["--nproc", "4", "--tp", "2", "--strategy",
                                                                            "fsdp"],
           "2 stages": ["--nproc", "2", "--strategy", "pipeline"], "fsdp 2": ["--nproc", "2", "--strategy", "fsdp"],
           "2 stages x tp 2": ["--nproc", "4", "--strategy", "pipeline", "--stages", "2", "--tp", "2"]}
PAIRS = [("1 process", "tp 2"), ("1 process", "tp 2 x ddp 2"), ("tp 2 x fsdp 2", "2 stages"),
         ("2 stages x tp 2", "fsdp 2")]


@pytest.fixture(scope="module")
def vit(tmp_path_factory, mnist):
    """The ViT trained 2 epochs whole on one process; 1 epoch unclipped; and each pair's second epoch."""
    tmp = tmp_path_factory.mktemp("pairs")
    images, labels = mnist.images[:, 0].numpy(), mnist.labels.numpy()
    data = tmp / "digits.npz"
    np.savez(data, images=images[:64], labels=labels[:64], val_images=images[64:101], val_labels=labels[64:101])
    (tmp / "vit.py").write_text(VIT)
    common = ["--model", str(tmp / "vit.py:make"), *TRAINING]
    train_cli(data, tmp / "whole", *common, "--epochs", "2")
    train_cli(data, tmp / "unclipped", *common, "--clip-grad-norm", "0", "--epochs", "1")
    firsts, said = {}, {}
    for a, b in PAIRS:
        if a not in firsts:
            firsts[a] = tmp / f"first-{a}"
            train_cli(data, firsts[a], *common, *LAYOUTS[a], "--epochs", "1")
        shutil.copytree(firsts[a], tmp / f"{a}-then-{b}")
        said[(a, b)] = train_cli(data, tmp / f"{a}-then-{b}", *common, *LAYOUTS[b], "--epochs", "2").stdout
    return tmp, said


def _losses(run) -> list[float]:
    import csv

    with (run / "metrics.csv").open() as f:
        return [float(r[k]) for r in csv.DictReader(f) for k in ("train_loss", "val_loss")]


def _weight_gap(a, b) -> float:
    wa, wb = load_file(str(a / "last.safetensors")), load_file(str(b / "last.safetensors"))
    assert wa.keys() == wb.keys()
    return max(((wa[k] - wb[k]).abs().max() / wb[k].abs().max().clamp_min(1e-12)).item()
               for k in wb if wb[k].is_floating_point())


def test_every_step_of_these_runs_is_clipped(vit):
    tmp, _ = vit
    first = _losses(tmp / "whole")[:2]
    assert abs(_losses(tmp / "unclipped")[0] - first[0]) > 1e-3  # the clipped steps trained something else


@pytest.mark.parametrize("pair", PAIRS, ids=[f"{a} then {b}" for a, b in PAIRS])
def test_a_run_moved_between_layouts_ends_where_the_whole_run_does(vit, pair):
    tmp, said = vit
    run = tmp / f"{pair[0]}-then-{pair[1]}"
    assert "resuming from" in said[pair] and "epoch 2/2" in said[pair]
    whole = _losses(tmp / "whole")
    for got, expected in zip(_losses(run), whole, strict=True):
        assert got == pytest.approx(expected, rel=1e-4)
    assert _weight_gap(run, tmp / "whole") < 1e-3  # the second layout's own weights file, gathered from its parts


def test_a_vit_is_cut_into_stages_with_its_own_tensors_on_the_first(vit):
    _, said = vit
    line = next(s for s in said[("tp 2 x fsdp 2", "2 stages")].splitlines() if s.startswith("pipeline of 2 stages"))
    assert "stage 0: patch_embed .. blocks.0; stage 1: blocks.1 .. norm" in line


MINE = '''
import json, os, sys
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset
import scaletrain


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))
        self.head_dim = dim // heads

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (f(x).view(b, n, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, -1))


class Net(nn.Module):
    tp_plan = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.out": "rowwise",
               "fc1": "colwise", "fc2": "rowwise"}

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.embed, self.attn, self.norm = nn.Linear(8, dim), Attention(dim, heads), nn.LayerNorm(dim)
        self.fc1, self.fc2, self.head = nn.Linear(dim, 64), nn.Linear(64, dim), nn.Linear(dim, 3)

    def forward(self, x):
        x = self.embed(x)
        x = x + self.attn(x)
        return self.head((x + self.fc2(F.gelu(self.fc1(self.norm(x))))).mean(1))


class Stream(IterableDataset):  # a user's stream, dealt out by scaletrain: no rank of its own
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __iter__(self):
        yield from zip(self.x, self.y)


out, tp = sys.argv[1], int(sys.argv[2])
g = torch.Generator().manual_seed(0)
x = torch.randn(96, 6, 8, generator=g)
y = (x[:, 0, 0] > 0).long() + (x[:, 1, 0] > 0).long()
val = TensorDataset(x[:37], y[:37])
config = scaletrain.TrainConfig()
config.optim.epochs, config.optim.batch_size, config.run.log_with, config.optim.clip_grad_norm = 1, 16, "none", 0.5
config.run.tp, config.run.output_dir = tp, out
torch.manual_seed(1)
model = Net()  # an object: every process starts from the first's tensors
adamw = lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=True)  # foreach asked for: torch's GPU default
result = scaletrain.fit(model, Stream(x, y), val, config, optimizer=adamw)
held = {k: v.clone() for k, v in model.state_dict().items()}
config.run.output_dir = ""
scores = scaletrain.evaluate(model, val, config)
predictions = scaletrain.predict(model, val, config)
if int(os.environ.get("RANK", 0)) == 0:
    torch.save({"held": held, "scores": scores, "predictions": predictions,
                "split": [type(p).__name__ for p in model.parameters()],
                "train_loss": result.history[0]["train_loss"]}, f"{out}.pt")
'''


def _on_one_and_launched(tmp_path, text: str, name: str, nproc: int, tp: int) -> None:
    """The script `text` run on one process into tmp_path/one, then under torchrun on `nproc` processes with --tp
    `tp` into tmp_path/`name`; each must finish."""
    script = tmp_path / "script.py"
    script.write_text(text)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    for launcher, out, arg in (([sys.executable], "one", "1"), (torchrun, name, str(tp))):
        proc = run_python([*launcher, str(script), str(tmp_path / out), arg])
        assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_users_model_under_tp_reads_a_stream_evaluates_predicts_and_ends_whole(tmp_path):
    _on_one_and_launched(tmp_path, MINE, "two", 2, 2)
    a, b = torch.load(tmp_path / "one.pt", weights_only=False), torch.load(tmp_path / "two.pt", weights_only=False)
    # both processes of each split layer read the same items of the stream: the epoch's loss is the whole run's
    assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)
    # the object holds the trained weights whole, those of its weights file
    assert set(b["split"]) == {"Parameter"}
    written = load_file(str(tmp_path / "two" / "last.safetensors"))
    assert all(torch.equal(b["held"][k], written[k]) for k in written)
    assert max((a["held"][k] - b["held"][k]).abs().max().item() for k in written) < 1e-4  # AdamW: rounding, magnified
    for key in ("loss", "accuracy", "samples"):
        assert b["scores"][key] == pytest.approx(a["scores"][key], rel=1e-5), key
    torch.testing.assert_close(b["predictions"], a["predictions"], rtol=1e-5, atol=1e-5)


def test_fsdp_on_one_process_continues_a_whole_checkpoint(tmp_path, small_npz):
    common = ["--model", "tinycnn", "--global-batch-size", "32", "--augment", "none", "--log-with", "none",
              "--scheduler", "constant", "--warmup-epochs", "0", "--checkpoint-every", "0"]
    train_cli(small_npz, tmp_path / "whole", *common, "--epochs", "2")
    train_cli(small_npz, tmp_path / "moved", *common, "--epochs", "1")
    proc = train_cli(small_npz, tmp_path / "moved", *common, "--epochs", "2", "--strategy", "fsdp")
    assert "resuming from" in proc.stdout
    assert _weight_gap(tmp_path / "moved", tmp_path / "whole") == 0.0


def test_a_weight_average_kept_as_parts_moves_between_layouts_with_the_run(vit):
    # --ema-decay under tp (the average kept as each process's parts), continued as 2 stages: its validation and its
    # weights files (gathered tensor by tensor) end as the whole run's
    tmp, _ = vit
    common = ["--model", str(tmp / "vit.py:make"), *TRAINING, "--ema-decay", "0.9"]
    train_cli(tmp / "digits.npz", tmp / "ema-whole", *common, "--epochs", "2")
    train_cli(tmp / "digits.npz", tmp / "ema-moved", *common, *LAYOUTS["tp 2"], "--epochs", "1")
    train_cli(tmp / "digits.npz", tmp / "ema-moved", *common, *LAYOUTS["2 stages"], "--epochs", "2")
    import csv

    rows = [list(csv.DictReader((tmp / f"ema-{r}" / "metrics.csv").open())) for r in ("whole", "moved")]
    for a, b in zip(*rows, strict=True):
        assert float(b["ema_val_loss"]) == pytest.approx(float(a["ema_val_loss"]), rel=1e-4)
    wa, wb = (load_file(str(tmp / f"ema-{r}" / "last_ema.safetensors")) for r in ("whole", "moved"))
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-4
    assert max((wa[k] - load_file(str(tmp / "ema-whole" / "last.safetensors"))[k]).abs().max().item()
               for k in wa) > 1e-3  # an average, not the weights


def test_compile_under_tp_compiles_each_block_and_trains_as_eagerly(vit):
    # regional compilation after the plan and before fsdp: the blocks' split layers traced, no graph breaks
    tmp, _ = vit
    proc = train_cli(tmp / "digits.npz", tmp / "compiled", "--model", str(tmp / "vit.py:make"), *TRAINING,
                     *LAYOUTS["tp 2"], "--compile", "--epochs", "1")
    assert "--compile: its 2 repeated blocks (Block; " in proc.stdout
    assert "graph break" not in proc.stderr.lower() and "Backend compiler exception" not in proc.stderr
    for got, expected in zip(_losses(tmp / "compiled"), _losses(tmp / "whole")[:2]):
        assert got == pytest.approx(expected, rel=1e-3)  # compiled kernels sum in another order


SYNC_BN = '''
import sys, torch
from torch import nn
from torch.utils.data import TensorDataset
import scaletrain


class Net(nn.Module):  # BatchNorm before the split layers: its statistics span the replicas' batches
    tp_plan = {"fc1": "colwise", "fc2": "rowwise"}

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8)
        self.fc1, self.fc2 = nn.Linear(8 * 36, 64), nn.Linear(64, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(torch.relu(self.bn(self.conv(x))).flatten(1))))


g = torch.Generator().manual_seed(0)
x = torch.randn(128, 1, 8, 8, generator=g)
data = TensorDataset(x, (x[:, 0, 0, 0] > 0).long() + (x[:, 0, 1, 1] > 0).long())
config = scaletrain.TrainConfig()
config.optim.epochs, config.optim.global_batch_size, config.run.log_with = 2, 32, "none"
config.optim.optimizer, config.optim.lr = "sgd", 0.05
config.model.sync_bn, config.model.channels_last = True, False
config.run.tp, config.run.output_dir = int(sys.argv[2]), sys.argv[1]
scaletrain.fit(lambda: Net(), data, data, config)
'''


def test_sync_bn_under_tp_spans_the_replicas_batches(tmp_path):
    # tp 2 x ddp 2: BatchNorm's statistics over the 2 replicas (not the 4 processes, whose tensor-parallel pairs see
    # the same batch): the running statistics, and so validation, are the whole batch's
    _on_one_and_launched(tmp_path, SYNC_BN, "four", 4, 2)
    for got, expected in zip(_losses(tmp_path / "four"), _losses(tmp_path / "one"), strict=True):
        assert got == pytest.approx(expected, rel=1e-5)
    a, b = (load_file(str(tmp_path / r / "last.safetensors"))["bn.running_var"] for r in ("one", "four"))
    torch.testing.assert_close(b, a, rtol=1e-6, atol=0)  # counted over the 4 processes, its unbiasing would differ
