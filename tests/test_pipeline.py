"""--strategy pipeline: a user's own stack of blocks (examples/pipeline_blocks.py, the script unchanged) trained
whole on 1 process, as 2 stages on 2 processes (1F1B; GPipe with gradient accumulation), killed mid-epoch and
resumed, as 2 stages x 2 replicas on 4 processes, and continued on 1 process, every run's gradients clipped; the
cuts, the check of the forward and every refusal on their own, without processes."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from helpers import run_cli, run_python
from scaletrain import TrainConfig
from scaletrain.errors import UserError
from scaletrain.parallel.layout import Layout, Stages
from scaletrain.parallel.pipeline import check_data, check_model
from scaletrain.parallel.split import check_chain, model_parts, plan_split, stage_model

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pipeline_blocks.py"
sys.path.insert(0, str(EXAMPLE.parent))
from pipeline_blocks import BlockNet  # noqa: E402


# -- the cuts and the check, in this process ------------------------------------------------------------------
def test_parts_are_the_children_in_order_with_sequentials_opened():
    assert [p.name for p in model_parts(BlockNet(depth=3))] == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]


def test_stages_are_balanced_by_parameters_or_begin_where_named():
    model = BlockNet(depth=4)  # embed 544, each block 4,288, head 132 parameters
    assert plan_split(model, 2).starts == (0, 3)  # embed, blocks.0, blocks.1 | blocks.2, blocks.3, head
    assert plan_split(model, 3).stage_parts(2) == ("blocks.3", "head")
    assert plan_split(model, 2, ("blocks.3",)).starts == (0, 4)
    with pytest.raises(UserError, match=r"--split-at layer3: the model has no such part; its parts in order: embed"):
        plan_split(model, 2, ("layer3",))
    with pytest.raises(UserError, match="in the model's order"):
        plan_split(model, 3, ("blocks.3", "blocks.1"))
    with pytest.raises(UserError, match="--stages 7: the model has 6 part"):
        plan_split(model, 7)


def test_split_at_names_its_stages_on_the_command_line_and_a_container_names_its_first_part():
    from scaletrain.commands.train import job_shape
    from scaletrain.models import build_model

    config = TrainConfig()
    config.run.strategy, config.run.split_at, config.run.nproc = "pipeline", "layer3", 2  # as --split-at gives it
    assert job_shape(config.run) == (2, 1, 1)  # one pipeline of 2 stages (not one per letter of "layer3")
    split = plan_split(build_model("resnet18", 1, 10), 2, ("layer3",))
    assert split.stage_parts(1)[0] == "layer3.0"


def test_a_stage_keeps_only_its_parts_under_their_names_in_the_whole_model():
    model = BlockNet(depth=4)
    whole = {k: v.clone() for k, v in model.state_dict().items()}
    split = plan_split(model, 2)
    stage = stage_model(model, split, [1])
    kept = stage.state_dict()
    assert set(kept) == {k for k in whole if k.startswith(("blocks.2.", "blocks.3.", "head."))}
    assert all(torch.equal(kept[k], whole[k]) for k in kept)
    # the model object is cut down in place: scoring it would be wrong, so predict refuses it on one line
    from torch.utils.data import TensorDataset

    from scaletrain import predict

    with pytest.raises(UserError, match=r"holds only one pipeline stage's parts \(blocks.2 .. head\)"):
        predict(model, TensorDataset(torch.randn(4, 16)))


class Skip(nn.Module):
    """A skip connection across blocks: the input of `b` is added to the output of `c`."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        return self.c(self.b(h) + h)


class Flattens(nn.Module):
    def __init__(self):
        super().__init__()
        self.features, self.head = nn.Conv2d(1, 2, 3), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def test_a_forward_that_is_not_its_parts_in_order_is_refused_naming_the_place():
    with pytest.raises(UserError, match="c is not given b's output alone"):
        check_chain(Skip(), plan_split(Skip(), 2), torch.randn(3, 4))
    model = Flattens()
    with pytest.raises(UserError, match="head is not given features's output alone"):
        check_chain(model, plan_split(model, 2), torch.randn(3, 1, 4, 4))
    model = BlockNet()
    check_chain(model, plan_split(model, 2), torch.randn(3, 16))  # a stack of blocks passes


class _Batches:
    def __init__(self, x):
        self.x = x

    def first_batch(self):
        return self.x, None


def _check(model, batches, step=None, **stages) -> None:
    """The model checks of rank 0 of a 2-process pipeline, run without processes."""
    check_model(model, Layout(2, "pipeline", stages=Stages(**stages)), batches, step)


def test_batchnorm_over_microbatches_tied_weights_and_a_step_are_refused():
    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with pytest.raises(UserError, match="1 is a BatchNorm, whose statistics over 4 micro-batches"):
        _check(bn, _Batches(torch.randn(8, 4)))
    _check(bn, _Batches(torch.randn(8, 4)), microbatches=1)  # one micro-batch: exact
    tied = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    tied[2].weight = tied[0].weight
    with pytest.raises(UserError, match=r"0.weight \(stage 0\) and 2.weight \(stage 1\) are one tensor"):
        _check(tied, _Batches(torch.randn(8, 4)))
    with pytest.raises(UserError, match="a Step of your own"):
        _check(BlockNet(), _Batches(torch.randn(8, 16)), step=object())


def test_microbatches_divide_each_batch_and_are_ones_the_schedule_runs():
    stages = Stages(microbatches=4)
    # 1F1B needs a micro-batch per stage: a batch of 5 has no such cut, so it runs under GPipe's order
    assert [stages.cut(b, 2) for b in (32, 6, 5)] == [(4, "1f1b"), (3, "1f1b"), (1, "gpipe")]
    assert Stages().cut(32, 2) == (4, "1f1b")  # twice the stages by default
    with pytest.raises(UserError, match="with 3 stages needs a multiple of 3 processes"):
        Layout(4, "pipeline", stages=Stages(3)).check()


def test_interleaved_1f1b_gets_micro_batches_in_equal_rounds_and_a_count_it_cannot_run_is_refused():
    # torch runs max(1, M // stages) rounds of equal size: an epoch's last batch of 20 under --microbatches 8 is
    # not cut into 5 (2 rounds do not divide 5) but into 4
    stages = Stages(microbatches=8, schedule="interleaved-1f1b")
    assert [stages.cut(b, 2) for b in (32, 20, 7)] == [(8, "interleaved-1f1b"), (4, "interleaved-1f1b"),
                                                        (1, "interleaved-1f1b")]
    with pytest.raises(UserError, match=r"5 micro-batches over 2 stages make 2 rounds, which do not divide them"):
        Layout(2, "pipeline", stages=Stages(2, microbatches=5, schedule="interleaved-1f1b")).check()
    config = TrainConfig()
    config.optim.batch_size = 40
    config.run.strategy, config.run.stages, config.run.microbatches = "pipeline", 2, 5
    config.run.schedule = "interleaved-1f1b"
    with pytest.raises(UserError, match="--schedule interleaved-1f1b runs --microbatches in max"):
        config.validate()


def test_a_stream_is_refused_for_training_and_for_validation():
    from torch.utils.data import IterableDataset, TensorDataset

    class Stream(IterableDataset):
        def __iter__(self):
            yield from ()

    pairs = TensorDataset(torch.randn(4, 16), torch.zeros(4, dtype=torch.long))
    layout = Layout(2, "pipeline")
    check_data(layout, pairs, pairs)
    with pytest.raises(UserError, match="val_data is an IterableDataset"):
        check_data(layout, pairs, Stream())
    with pytest.raises(UserError, match="train_data is an IterableDataset"):
        check_data(layout, Stream(), None)


@pytest.mark.parametrize("flags, message", [
    ({"stages": 2}, "--stages is for --strategy pipeline"),
    ({"shard_stages": True}, "--shard-stages is for --strategy pipeline"),
    ({"strategy": "pipeline", "microbatches": 3}, "--batch-size 32 cannot be cut into --microbatches 3"),
    ({"strategy": "pipeline", "stages": 4, "microbatches": 2},
     r"1f1b needs at least as many --microbatches as stages \(4\)"),
    ({"strategy": "pipeline", "stages": 3, "split_at": ("blocks.2",)}, "begins 2 stages, --stages says 3"),
])
def test_settings_a_pipeline_cannot_run_are_refused_by_name(flags, message):
    config = TrainConfig()
    config.optim.batch_size = 32
    for key, value in flags.items():
        setattr(config.run, key, value)
    with pytest.raises(UserError, match=message):
        config.validate()


def test_the_cli_refuses_a_layout_before_any_process_starts(tmp_path):
    out = tmp_path / "run"
    proc = run_cli("train", "--strategy", "pipeline", "--stages", "3", "--nproc", "2", "--epochs", "1",
                   "--output-dir", str(out))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == ("scaletrain: error: --strategy pipeline with 3 stages needs a "
                                                    "multiple of 3 processes (--nproc x --nnodes), got 2")
    assert not out.exists()


def test_the_memory_estimate_counts_each_stage_and_the_micro_batches_it_holds():
    from scaletrain.measure.memory import estimate

    whole = estimate("tinycnn", batch_size=64)
    gpipe, one_f = (estimate("tinycnn", batch_size=64, strategy="pipeline", stages=2, microbatches=8, schedule=s)
                    for s in ("gpipe", "1f1b"))
    assert sum(st["bytes"]["parameters"] for st in gpipe.stages) == whole.parts["parameters"]
    assert [st["micro_batches_held"] for st in gpipe.stages] == [8, 8]
    assert [st["micro_batches_held"] for st in one_f.stages] == [2, 1]  # 1F1B: one per stage from it to the last
    first = [e.stages[0]["bytes"]["activations"] for e in (gpipe, one_f)]
    assert first[1] == pytest.approx(first[0] * 2 / 8, rel=1e-3)
    assert gpipe.total == max(st["bytes"]["total"] for st in gpipe.stages)  # the verdict is the largest stage's
    # interleaved 1F1B: process 1 of 2 holds stages 1 and 3 of 4, and the micro-batches of its warm-up
    inter = estimate("tinycnn", batch_size=64, strategy="pipeline", stages=2, microbatches=8,
                     schedule="interleaved-1f1b")
    from scaletrain.models import build_model

    split = plan_split(build_model("tinycnn", 1, 10), 4)
    ends = [[split.stage_parts(c)[0], split.stage_parts(c)[-1]] for c in range(4)]
    assert [st["chunks"] for st in inter.stages] == [[ends[0], ends[2]], [ends[1], ends[3]]]
    assert [st["micro_batches_held"] for st in inter.stages] == [5, 3]  # rounds of 2: 2 + 2 + 1, 2 + 0 + 1
    assert sum(st["bytes"]["parameters"] for st in inter.stages) == whole.parts["parameters"]


# -- the example trained, in processes ------------------------------------------------------------------------
CLIP = ("--clip-grad-norm", "0.2")  # below the gradients' norm at every step: each is clipped


def _run(out: Path, nproc: int, *args: str, env: dict | None = None, expect: int = 0) -> subprocess.CompletedProcess:
    launcher = [sys.executable, EXAMPLE] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), EXAMPLE]
    proc = run_python([*launcher, "--out", out, *args], env=env)
    assert proc.returncode == expect, proc.stderr[-3000:]
    return proc


def _losses(run: Path) -> list[float]:
    import csv

    with (run / "metrics.csv").open() as f:
        return [float(row["train_loss"]) for row in csv.DictReader(f)]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "last.safetensors"))


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    """The model trained whole on one process: 3 epochs of 512 samples, batches of 32."""
    out = tmp_path_factory.mktemp("pipeline") / "whole"
    _run(out, 1, "--epochs", "3", *CLIP)
    return out


@pytest.mark.slow
def test_two_stages_train_as_the_whole_model_and_resume_bitwise_after_a_kill(whole, tmp_path):
    done, killed = tmp_path / "done", tmp_path / "killed"
    args = ("--stages", "2", "--epochs", "2", "--checkpoint-every", "4", *CLIP)
    _run(done, 2, *args)
    assert _losses(done) == pytest.approx(_losses(whole)[:2], rel=1e-4)
    whole_model = BlockNet()
    whole_model.load_state_dict(_weights(done))  # last.safetensors loads into the unsplit model
    # SIGKILL of the last stage after batch 22 (epoch 2, batch 6; the newest checkpoint is step 20), then the same
    # command again: it continues from step 20 and ends on the uninterrupted run's weights, bit for bit
    proc = _run(killed, 2, *args, env={"SCALETRAIN_FAULT": "kill:22:1"}, expect=1)
    assert "SIGKILL" in proc.stderr or f"exitcode  : {-signal.SIGKILL}" in proc.stderr
    proc = _run(killed, 2, *args)
    assert "resuming from" in proc.stdout and "optimizer step 20" in proc.stdout
    a, b = _weights(done), _weights(killed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _losses(killed) == _losses(done)
    # the 2-stage run continued on one process, the model whole: its third epoch as the whole run's
    shutil.copytree(done, tmp_path / "continued")
    proc = _run(tmp_path / "continued", 1, "--epochs", "3", *CLIP)
    assert "saved on 1 device(s) by 2 process(es), continuing on 1 device(s) by 1 process(es)" in proc.stdout
    assert _losses(tmp_path / "continued") == pytest.approx(_losses(whole), rel=1e-4)
    _close(_weights(tmp_path / "continued"), _weights(whole))


@pytest.mark.slow
def test_gpipe_with_accumulation_and_two_replicas_of_two_stages_train_as_the_whole_model(whole, tmp_path):
    # GPipe, 2 micro-batches, batches of 16 accumulated twice: the global batch of 32 the whole run took
    _run(tmp_path / "gpipe", 2, "--stages", "2", "--schedule", "gpipe", "--microbatches", "2", "--batch-size", "16",
         "--grad-accum", "2", *CLIP)
    assert _losses(tmp_path / "gpipe") == pytest.approx(_losses(whole), rel=1e-4)
    _close(_weights(tmp_path / "gpipe"), _weights(whole))
    # 4 processes: 2 replicas of 2 stages under interleaved 1F1B (each process holds 2 of 4 stages), 16 per replica
    proc = _run(tmp_path / "replicas", 4, "--stages", "2", "--schedule", "interleaved-1f1b", "--batch-size", "16",
                *CLIP)
    assert "pipeline of 2 stages x 2 replica(s), schedule interleaved-1f1b" in proc.stdout
    assert _losses(tmp_path / "replicas") == pytest.approx(_losses(whole), rel=1e-4)
    _close(_weights(tmp_path / "replicas"), _weights(whole))
    summary = json.loads((tmp_path / "replicas" / "summary.json").read_text())
    assert summary["best_val_accuracy"] == pytest.approx(json.loads((whole / "summary.json").read_text())
                                                         ["best_val_accuracy"])


@pytest.mark.slow
def test_two_stages_each_sharded_over_two_replicas_with_activation_checkpointing_train_as_the_whole_model(whole,
                                                                                                      tmp_path):
    # 4 processes: fsdp inside each of 2 stages (torch's fully_shard over the stage's replicas), each block's
    # activations recomputed in the backward; 16 per replica, the whole run's global batch of 32
    proc = _run(tmp_path / "sharded", 4, "--stages", "2", "--shard-stages", "--activation-checkpointing",
                "--batch-size", "16", *CLIP)
    assert "pipeline of 2 stages x 2 replica(s), each stage sharded over its replicas" in proc.stdout
    assert _losses(tmp_path / "sharded") == pytest.approx(_losses(whole), rel=1e-4)
    _close(_weights(tmp_path / "sharded"), _weights(whole))
    summary = json.loads((tmp_path / "sharded" / "summary.json").read_text())
    whole_bytes = json.loads((whole / "summary.json").read_text())["bytes_per_device"]
    assert summary["bytes_per_device"]["parameters"] < 0.3 * whole_bytes["parameters"]  # a quarter, and rounding


class ReadsValues(nn.Module):
    """A forward that reads a value (which the meta device has none of) between well-formed parts."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        if float(x.abs().max()) > 1e6:  # a value read: cannot run on the meta device
            x = x.clamp(-1e6, 1e6)
        return self.b(self.a(x))


def test_a_forward_that_reads_values_is_checked_on_the_real_batch_or_refused_when_built_on_the_meta_device():
    model = ReadsValues()
    check_chain(model, plan_split(model, 2), torch.randn(3, 4))  # a model object: checked on the batch
    from scaletrain.parallel.materialise import build_on_meta

    meta = build_on_meta(ReadsValues)
    with pytest.raises(UserError, match="the model's forward cannot run on the meta device"):
        check_chain(meta, plan_split(meta, 2), torch.randn(3, 4))
