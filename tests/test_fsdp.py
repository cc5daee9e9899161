"""Sharded data parallelism (--strategy fsdp) on 2 real gloo processes: it trains to the weights DDP and one
process reach, its sharded checkpoints resume on 2 processes and on 1, and its weights serve predict."""

from __future__ import annotations

import csv
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from helpers import run_cli, train_cli

pytestmark = pytest.mark.slow  # every test here trains on 2 processes

# 384 samples = 12 global batches of 32 (2 x 16 or 1 x 32); no augmentation, whose draws differ per rank; SyncBN,
# so that BatchNorm sees the same global batch on any process count; a small rate, so that rounding differences
# stay rounding differences.
COMMON = ["--model", "tinycnn", "--epochs", "1", "--global-batch-size", "32", "--augment", "none", "--lr", "0.01",
          "--sync-bn", "--no-channels-last", "--checkpoint-every", "3", "--log-every", "2"]


@pytest.fixture(scope="module")
def data384(tmp_path_factory, mnist):
    path = tmp_path_factory.mktemp("fsdp") / "s384.npz"
    images, labels = mnist.images[:, 0].numpy(), mnist.labels.numpy()
    np.savez(path, images=images[:384], labels=labels[:384], val_images=images[400:501],
             val_labels=labels[400:501])
    return path


def _train(data, out, *extra, env=None, expect=0):
    return train_cli(data, out, *COMMON, *extra, env=env, expect=expect)


def _gap(a, b) -> float:
    wa, wb = load_file(a / "last.safetensors"), load_file(b / "last.safetensors")
    assert wa.keys() == wb.keys()
    return max((wa[k].double() - wb[k].double()).abs().max().item() for k in wa)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data384):
    root = tmp_path_factory.mktemp("fsdp-runs")
    fsdp = ["--nproc", "2", "--strategy", "fsdp"]
    blocks = ["--model", "test_efficientnet"]  # a timm model of BatchNorm blocks, small enough for this test
    settings = {"fsdp": fsdp, "ddp": ["--nproc", "2"], "one": [], "blocks": [*fsdp, *blocks],
                "blocks-ac": [*fsdp, *blocks, "--activation-checkpointing"]}
    for name, extra in settings.items():
        _train(data384, root / name, *extra)
    return root


def test_fsdp_summary_names_the_strategy_processes_and_per_device_batch(runs):
    summary = json.loads((runs / "fsdp" / "summary.json").read_text())
    assert (summary["strategy"], summary["world_size"], summary["batch_size_per_device"]) == ("fsdp", 2, 16)


def test_fsdp_trains_to_the_weights_of_ddp(runs):
    # Sharding changes where the sums happen, not what they are: on this CPU the weights come out equal to DDP's.
    assert _gap(runs / "fsdp", runs / "ddp") < 1e-6


def test_fsdp_on_two_trains_to_the_weights_of_one_process(runs):
    assert _gap(runs / "fsdp", runs / "one") < 1e-4


def test_activation_checkpointing_under_fsdp_leaves_the_weights_unchanged(runs):
    """Recomputing activations in the backward pass gives the same gradients, and BatchNorm statistics are
    updated once per step, not again by the recomputation."""
    assert _gap(runs / "blocks-ac", runs / "blocks") < 1e-6


def test_each_process_holds_half_of_the_parameters_and_optimizer_state(runs):
    shards = json.loads((runs / "fsdp" / "summary.json").read_text())["bytes_per_device"]
    whole = json.loads((runs / "ddp" / "summary.json").read_text())["bytes_per_device"]
    # tinycnn's tensors have even first dimensions except the 10-class head, whose 10 rows split 5 + 5.
    assert shards["parameters"] * 2 == whole["parameters"]
    assert shards["optimizer_state"] * 2 == whole["optimizer_state"] > 0


def test_estimate_memory_gives_the_bytes_each_fsdp_process_held(runs):
    from scaletrain.measure.memory import estimate

    held = json.loads((runs / "fsdp" / "summary.json").read_text())["bytes_per_device"]
    predicted = estimate("tinycnn", strategy="fsdp", nproc=2, optimizer="sgd", batch_size=16).parts
    assert predicted["parameters"] == held["parameters"]
    assert predicted["optimizer_state"] == held["optimizer_state"]


FSDP2 = ["--nproc", "2", "--strategy", "fsdp"]


@pytest.fixture(scope="module")
def killed(tmp_path_factory, data384):
    """An fsdp run on 2 processes SIGKILLed at micro-batch 8, after its checkpoints at steps 3 and 6; tests
    resume or damage copies of it."""
    out = tmp_path_factory.mktemp("fsdp-killed") / "run"
    _train(data384, out, *FSDP2, env={"SCALETRAIN_FAULT": "kill:8"}, expect=1)
    return out


def _copy(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def test_a_killed_fsdp_run_leaves_one_shard_per_rank_and_no_summary(killed):
    state = sorted((killed / "state").iterdir())[-1]
    assert state.name == "step-00000006" and not (killed / "summary.json").exists()
    assert sorted(p.name for p in (state / "sharded").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert json.loads((state / "train.json").read_text())["format"] == "sharded"


def test_a_sharded_checkpoint_resumes_on_two_bit_for_bit(killed, runs, data384, tmp_path):
    out = _copy(killed, tmp_path)
    proc = _train(data384, out, *FSDP2)
    assert "resuming from" in proc.stdout and "optimizer step 6" in proc.stdout
    assert _gap(out, runs / "fsdp") == 0.0


def test_a_sharded_checkpoint_saved_on_two_resumes_on_one(killed, runs, data384, tmp_path):
    out = _copy(killed, tmp_path)
    proc = _train(data384, out, "--strategy", "fsdp")
    assert "resuming from" in proc.stdout and "1 process(es)" in proc.stdout
    assert _gap(out, runs / "fsdp") < 1e-4
    assert [r["epoch"] for r in csv.DictReader((out / "metrics.csv").open())] == ["1"]


def test_resume_with_another_global_batch_is_refused_and_keeps_every_checkpoint(killed, data384, tmp_path):
    out = _copy(killed, tmp_path)
    before = sorted(p.name for p in (out / "state").iterdir())
    proc = run_cli("train", "--data", str(data384), *[a for a in COMMON if a not in ("--global-batch-size", "32")],
                   "--batch-size", "8", *FSDP2, "--output-dir", str(out))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"scaletrain: error: {out}/state/step-00000006: saved with a global batch of 32 (--grad-accum 1), resumed "
        f"with 16 (--grad-accum 1); resume with --global-batch-size 32 --grad-accum 1")
    assert sorted(p.name for p in (out / "state").iterdir()) == before


def test_a_damaged_shard_falls_back_to_the_checkpoint_before_and_still_ends_exactly(killed, runs, data384,
                                                                                    tmp_path):
    out = _copy(killed, tmp_path)
    shard = out / "state" / "step-00000006" / "sharded" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    proc = _train(data384, out, *FSDP2)
    assert "__1_0.distcp does not match its checksum" in proc.stdout and "optimizer step 3" in proc.stdout
    assert _gap(out, runs / "fsdp") == 0.0


def test_a_ddp_checkpoint_continues_under_fsdp_each_process_reading_its_rows(runs, data384, tmp_path):
    # outgrowing ddp: its whole checkpoint (model.safetensors, optimizer.safetensors) read by fsdp's processes, each
    # its own rows of each tensor, and the run ends where the uninterrupted one does
    out = tmp_path / "run"
    _train(data384, out, "--nproc", "2", env={"SCALETRAIN_FAULT": "kill:8"}, expect=1)
    proc = _train(data384, out, "--nproc", "2", "--strategy", "fsdp")
    assert "resuming from" in proc.stdout and "optimizer step 6" in proc.stdout
    assert _gap(out, runs / "ddp") < 1e-6


@pytest.fixture(scope="module")
def served(runs, data384, tmp_path_factory):
    """evaluate (the 101 validation digits) and predict (the 384 training digits) from the fsdp weights, on one
    process and on 2 under fsdp."""
    tmp = tmp_path_factory.mktemp("fsdp-serve")
    reports, predictions = {}, {}
    for name, extra in {"one": [], "fsdp": FSDP2}.items():
        # batch 50 on 101 samples: rank 0 has 51 (two batches), rank 1 has 50 (one), yet both join every gather
        proc = run_cli("evaluate", "--checkpoint", str(runs / "fsdp"), "--data", str(data384), "--split", "val",
                       "--batch-size", "50", *extra, "--output-dir", str(tmp / f"eval-{name}"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        proc = run_cli("predict", "--checkpoint", str(runs / "fsdp"), "--data", str(data384), "--batch-size", "50",
                       *extra, "--output", str(tmp / f"{name}.csv"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        reports[name] = json.loads((tmp / f"eval-{name}" / "metrics.json").read_text())
        predictions[name] = (tmp / f"{name}.csv").read_text()
    return reports, predictions


def test_evaluate_under_fsdp_counts_and_classifies_like_one_process(served):
    reports, _ = served
    assert reports["one"]["samples"] == reports["fsdp"]["samples"] == 101
    assert reports["fsdp"]["confusion_matrix"] == reports["one"]["confusion_matrix"]
    assert reports["fsdp"]["loss"] == pytest.approx(reports["one"]["loss"], rel=1e-6)


def test_predict_under_fsdp_writes_the_file_one_process_writes(served):
    _, predictions = served
    assert predictions["one"].count("\n") == 1 + 384
    assert predictions["fsdp"] == predictions["one"]


def test_bf16_fsdp_on_a_model_without_batchnorm(tmp_path, mnist):
    """Blocks without BatchNorm gather bf16 parameters; the run trains and its weights stay fp32."""
    path = tmp_path / "d.npz"
    images, labels = mnist.images[:, 0].numpy(), mnist.labels.numpy()
    np.savez(path, images=images[:64], labels=labels[:64], val_images=images[64:96], val_labels=labels[64:96])
    proc = run_cli("train", "--data", str(path), "--model", "test_vit", "--image-size", "32", "--epochs", "1",
                   "--batch-size", "16", "--nproc", "2", "--strategy", "fsdp", "--mixed-precision", "bf16",
                   "--activation-checkpointing", "--output-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "activation checkpointing over 6 blocks" in proc.stdout
    weights = load_file(tmp_path / "run" / "last.safetensors")
    assert {w.dtype for w in weights.values() if w.is_floating_point()} == {torch.float32}
    assert all(torch.isfinite(w).all() for w in weights.values() if w.is_floating_point())


def test_at_the_default_settings_fsdp_is_ddp_without_channels_last(tmp_path, data384):
    """fsdp shards contiguous parameters, so its convolutions run on contiguous weights: with channels_last off,
    ddp computes the same and ends on the same weights, augmentation, BatchNorm per process and the default rate
    included (at the defaults ddp's channels_last kernels round otherwise, and training magnifies it)."""
    common = ["--model", "tinycnn", "--epochs", "1", "--global-batch-size", "32", "--nproc", "2",
              "--no-channels-last", "--log-every", "4"]
    for name in ("ddp", "fsdp"):
        train_cli(data384, tmp_path / name, *common, "--strategy", name)
    assert _gap(tmp_path / "ddp", tmp_path / "fsdp") == 0
