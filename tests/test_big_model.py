"""Models bigger than one process: built on the meta device, each process materialising only its part with the
whole model's values at the seed (the replayed constructor) or an --init-from file's; weights written tensor by
tensor; replicas equal; dropout drawn differently on each stage; a timm model and the example trained as stages
end where the whole model does."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from helpers import run_cli, run_python
from scaletrain.errors import UserError
from scaletrain.models import build_model
from scaletrain.parallel.materialise import Blueprint, Replayed, WeightsFile, build_on_meta, on_meta
from scaletrain.runfolder import load_weights, save_weights

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


class Odd(nn.Module):
    """What a constructor may do beyond torch's layers: a parameter computed from a tensor (timm's layer scale), a
    tied weight, a non-persistent buffer, a module made and dropped, a random draw outside any layer."""

    def __init__(self):
        super().__init__()
        nn.Linear(3, 3)  # made and dropped: its draws still come before the others'
        self.embed = nn.Linear(8, 16)
        self.gamma = nn.Parameter(0.1 * torch.ones(16))
        self.noise = nn.Parameter(torch.randn(16, 16))
        self.register_buffer("table", torch.arange(16.0).sin(), persistent=False)
        self.head = nn.Linear(16, 8)
        self.head.weight = nn.Parameter(self.embed.weight.t().contiguous())  # replaced after it was drawn
        self.tail = nn.Linear(16, 16)
        self.tail.weight = self.noise  # tied

    def forward(self, x):
        return self.head(self.tail(self.embed(x) * self.gamma + self.table))


@pytest.mark.parametrize("make", [lambda: build_model("smallcnn", 1, 10), lambda: build_model("convnext_atto", 3, 5),
                                  lambda: build_model("swin_tiny_patch4_window7_224", 3, 5), Odd],
                         ids=["smallcnn", "convnext_atto", "swin", "odd"])
def test_a_part_rebuilt_on_its_own_holds_the_whole_models_values_at_the_seed(make):
    torch.manual_seed(7)
    reference = make()
    whole = {**dict(reference.named_parameters(remove_duplicate=False)), **dict(reference.named_buffers())}
    torch.manual_seed(7)
    meta = build_on_meta(make)
    assert on_meta(meta) and all(t.is_meta for t in meta.parameters())
    names = sorted(whole)
    half = set(names[:len(names) // 2])  # Odd's: embed.*, gamma, head.bias
    torch.randn(100)  # the process's generator moved on: the replay starts from the blueprint's state
    replayed = Replayed(Blueprint.of(meta), half.__contains__)
    for name in half:
        assert torch.equal(replayed.get(name), whole[name]), name
    assert not any(replayed.has(n) for n in set(names) - half if not _tied_to(reference, n, half))


def test_a_tensor_computed_from_one_another_process_holds_is_refused_on_one_line():
    meta = build_on_meta(Odd)  # head.weight is made from embed.weight's values
    with pytest.raises(UserError, match="its constructor computes head.weight from the values of tensors this "
                                        "process does not hold"):
        Replayed(Blueprint.of(meta), lambda n: n.startswith("head."))
    kept = Replayed(Blueprint.of(meta), lambda n: n.startswith(("head.", "embed.")))  # both in one part: right
    torch.manual_seed(0)
    assert kept.has("head.weight")


def _tied_to(model: nn.Module, name: str, kept: set[str]) -> bool:
    tensors = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    return any(tensors[k] is tensors[name] for k in kept)


def test_the_replay_holds_only_the_kept_tensors_and_one_scratch_buffer():
    def make():
        return nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])

    meta = build_on_meta(make)
    replayed = Replayed(Blueprint.of(meta), lambda n: n.startswith(("0.", "1.")))
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in replayed.state.values()}
    layer = (512 * 512 + 512) * 4
    assert sum(storages.values()) == 2 * layer + 512 * 512 * 4  # two layers kept, one scratch as large as a weight


def test_an_init_from_file_that_is_not_the_models_is_refused_on_one_line(tmp_path):
    model = build_on_meta(lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    path = tmp_path / "w.safetensors"
    save_file({"0.weight": torch.zeros(4, 4), "0.bias": torch.zeros(4), "1.weight": torch.zeros(2, 4)}, str(path))
    with pytest.raises(UserError, match=r"--init-from .*w.safetensors: lacks 1.bias \(1 missing, 0 not in the model\)"):
        WeightsFile(path).check(model)
    save_file({"0.weight": torch.zeros(4, 3), "0.bias": torch.zeros(4), "1.weight": torch.zeros(2, 4),
               "1.bias": torch.zeros(2)}, str(path))
    with pytest.raises(UserError, match=r"0.weight has shape \(4, 3\) in the file, \(4, 4\) in the model"):
        WeightsFile(path).check(model)
    (tmp_path / "bad.safetensors").write_bytes(b"not a file of tensors")
    with pytest.raises(UserError, match="not a readable safetensors file"):
        WeightsFile(tmp_path / "bad.safetensors")


def test_weights_are_written_tensor_by_tensor_as_a_safetensors_file(tmp_path):
    state = {"w": torch.randn(3, 4), "n": torch.arange(5), "h": torch.randn(2, dtype=torch.bfloat16),
             "s": torch.tensor(3.0), "e": torch.zeros(0, 3), "b": torch.tensor([True, False])}
    save_weights(tmp_path / "w.safetensors", state, {"model": "x"})
    back, meta = load_weights(tmp_path / "w.safetensors")
    assert all(torch.equal(back[k], state[k]) for k in state) and meta["model"] == "x"
    assert sorted(load_file(str(tmp_path / "w.safetensors"))) == sorted(state)


def test_fit_takes_a_function_that_returns_the_model(tmp_path):
    from torch.utils.data import TensorDataset

    import scaletrain

    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
    config = scaletrain.TrainConfig()
    config.optim.epochs, config.run.log_with = 1, "none"
    make = lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))  # noqa: E731
    by_function = scaletrain.fit(make, data, data, config).history[0]["train_loss"]
    torch.manual_seed(config.run.seed)  # a function is called after seeding with the run's seed
    by_object = scaletrain.fit(make(), data, data, config).history[0]["train_loss"]
    assert by_function == by_object
    with pytest.raises(UserError, match="model: expected a torch.nn.Module, or a function of no arguments"):
        scaletrain.fit("resnet18", data, data, config)
    with pytest.raises(UserError, match="model: the function returned a dict"):
        scaletrain.fit(lambda: {}, data, data, config)


# -- in processes ------------------------------------------------------------------------------------------------
def _loss(proc) -> float:
    """The first epoch's training loss, from the run folder the example wrote (not its output, which several
    processes share)."""
    import csv

    out = Path(proc.args[proc.args.index("--out") + 1])
    with (out / "metrics.csv").open() as f:
        return float(next(csv.DictReader(f))["train_loss"])


def _big(out: Path, nproc: int, *args: str):
    launcher = [sys.executable] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    proc = run_python([*launcher, str(EXAMPLES / "big_model.py"), "--out", str(out), "--width", "64", "--depth", "4",
                       "--samples", "128", *args])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_the_example_starts_every_layout_from_the_whole_runs_initial_weights(tmp_path):
    whole = _big(tmp_path / "whole", 1, "--save-initial-weights")
    initial = tmp_path / "whole" / "initial.safetensors"
    assert "initial weights written to" in whole.stdout
    stages = _big(tmp_path / "p2", 2, "--stages", "2", "--init-from", str(initial))
    assert "each process materialised only its stage" in stages.stdout
    shards = _big(tmp_path / "f2", 2, "--strategy", "fsdp", "--init-from", str(initial))
    assert "each process materialised only its shards" in shards.stdout
    for proc in (stages, shards):
        assert _loss(proc) == pytest.approx(_loss(whole), abs=1e-6)
    for run in ("p2", "f2"):  # the same weights at the end, written tensor by tensor, loaded into the whole model
        a = load_file(str(tmp_path / run / "last.safetensors"))
        b = load_file(str(tmp_path / "whole" / "last.safetensors"))
        assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    # without --init-from each layout replays the constructor: the whole model's weights at the seed
    replayed = _big(tmp_path / "p2-seed", 2, "--stages", "2", "--save-initial-weights")
    a, b = load_file(str(tmp_path / "p2-seed" / "initial.safetensors")), load_file(str(initial))
    assert all(torch.equal(a[k], b[k]) for k in b)
    assert _loss(replayed) == pytest.approx(_loss(whole), abs=1e-6)


UNSEEDED = '''
import hashlib, os, sys
import torch
from torch import nn
from torch.utils.data import TensorDataset
import scaletrain

torch.manual_seed(int.from_bytes(os.urandom(4), "little"))  # every process draws other initial weights
masks = []


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.drop = nn.Linear(16, 16), nn.Dropout(0.5)
        # the mask alone (dropout of ones): what the process's generator drew, whatever the inputs
        self.drop.register_forward_hook(lambda m, a, out: masks.append((out == 0).flatten()) if m.training else None)

    def forward(self, x):
        return x + torch.relu(self.fc(x)) * self.drop(torch.ones_like(x))


model = nn.Sequential(nn.Linear(8, 16), Block(), Block(), nn.Linear(16, 2))
g = torch.Generator().manual_seed(0)
x = torch.randn(64, 8, generator=g)
data = TensorDataset(x, (x[:, 0] > 0).long())
config = scaletrain.TrainConfig()
config.optim.epochs, config.optim.batch_size, config.run.log_with = 1, 16, "none"
config.run.strategy, config.run.stages, config.run.output_dir = "pipeline", 2, sys.argv[1]
scaletrain.fit(model, data, data, config)
state = model.state_dict()
digest = hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest()
mask = hashlib.sha256(masks[0].numpy().tobytes()).hexdigest()
with open(f"{sys.argv[1]}-rank{os.environ['RANK']}.txt", "w") as f:  # a file each: printed lines may interleave
    f.write(f"{digest} {mask}")
'''


@pytest.mark.slow
def test_an_unseeded_model_object_ends_whole_and_equal_on_every_process_and_stages_draw_other_dropout_masks(tmp_path):
    script = tmp_path / "unseeded.py"
    script.write_text(UNSEEDED)
    proc = run_python([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                       str(script), str(tmp_path / "run")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = {r: tuple((tmp_path / f"run-rank{r}.txt").read_text().split()) for r in range(4)}
    # each stage's replicas start from its first process's tensors, and after fit the model object of every process
    # holds the whole trained model (each stage's part from the processes that trained it), the same everywhere
    assert len({digest for digest, _ in found.values()}) == 1
    assert len({m for _, m in found.values()}) == 4  # every process, every stage, its own dropout draws


@pytest.mark.slow
def test_two_stages_of_convnext_atto_end_where_the_whole_model_does(tmp_path, mnist):
    import numpy as np

    data = tmp_path / "digits.npz"
    images, labels = mnist.images[:, 0].numpy(), mnist.labels.numpy()
    np.savez(data, images=images[:96], labels=labels[:96], val_images=images[100:132], val_labels=labels[100:132])
    common = ["train", "--data", str(data), "--model", "convnext_atto", "--image-size", "32", "--epochs", "1",
              "--batch-size", "16", "--augment", "none", "--no-channels-last", "--log-with", "none"]
    for name, extra in (("whole", ["--nproc", "1"]), ("stages", ["--nproc", "2", "--strategy", "pipeline"])):
        proc = run_cli(*common, *extra, "--output-dir", str(tmp_path / name))
        assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = (load_file(str(tmp_path / n / "last.safetensors")) for n in ("whole", "stages"))
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4



def test_a_stage_that_reads_no_inputs_holds_no_images_and_gets_the_same_labels(mnist):
    from scaletrain.config import DataConfig
    from scaletrain.data.batches import DeviceBatches
    from scaletrain.data.regularise import Regularise
    from scaletrain.data.transforms import default_preprocess

    from scaletrain.data import ImageSet

    data = ImageSet(mnist.images[:96], mnist.labels[:96], mnist.classes, mnist.recipe)
    pre = default_preprocess(data, DataConfig())
    mixing = Regularise(None, 0.0, 0.8, 1.0, 1.0, 0.5, 10)
    common = dict(train=True, rank=0, world=1, seed=3, augment=("crop",), regularise=mixing)
    first = DeviceBatches(data, pre, torch.device("cpu"), 32, **common)
    later = DeviceBatches(data, pre, torch.device("cpu"), 32, reads_inputs=False, **common)
    assert later.images.is_meta and not first.images.is_meta
    for (x, y), (mx, my) in zip(first.epoch(0), later.epoch(0)):
        assert mx.is_meta and mx.shape == x.shape and torch.equal(my, y)  # mixed labels included


@pytest.mark.slow
def test_a_pretrained_file_is_read_tensor_by_tensor_into_fsdp_shards_as_into_the_whole_model(tmp_path, mnist):
    import numpy as np

    data = tmp_path / "digits.npz"
    images, labels = mnist.images[:, 0].numpy(), mnist.labels.numpy()
    np.savez(data, images=images[:64], labels=labels[:64], val_images=images[64:96], val_labels=labels[64:96])
    torch.manual_seed(5)
    donor = build_model("tinycnn", 1, 7)  # another head: its tensors are skipped, the rest loaded
    save_file({k: v.contiguous() for k, v in donor.state_dict().items()}, str(tmp_path / "donor.safetensors"))
    common = ["train", "--data", str(data), "--model", "tinycnn", "--epochs", "1", "--batch-size", "16",
              "--log-with", "none", "--pretrained", str(tmp_path / "donor.safetensors"), "--save-initial-weights"]
    for name, extra in (("whole", ["--nproc", "1"]), ("fsdp", ["--nproc", "2", "--strategy", "fsdp"])):
        proc = run_cli(*common, *extra, "--output-dir", str(tmp_path / name))
        assert proc.returncode == 0, proc.stderr[-3000:]
        skipped = (tmp_path / name / "pretrained_skipped.txt").read_text()
        assert "head.1.weight: shape (7, 32) in file, (10, 32) in model" in skipped
    a, b = (load_file(str(tmp_path / n / "initial.safetensors")) for n in ("whole", "fsdp"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(a["features.0.weight"], donor.state_dict()["features.0.weight"])
