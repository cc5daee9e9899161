"""Sharded data parallelism (--strategy fsdp) on 2 real gloo processes: it trains to the weights DDP and one
process reach, its sharded checkpoints resume on 2 processes and on 1, and its weights serve predict."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from helpers import run_cli, train_cli

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


def test_fsdp_trains_to_the_weights_of_ddp_and_of_one_process(runs):
    summary = json.loads((runs / "fsdp" / "summary.json").read_text())
    assert summary["strategy"] == "fsdp" and summary["world_size"] == 2 and summary["batch_size_per_device"] == 16
    # Sharding changes where the sums happen, not what they are: on this CPU the weights come out equal to DDP's.
    assert _gap(runs / "fsdp", runs / "ddp") < 1e-6
    assert _gap(runs / "fsdp", runs / "one") < 1e-4
    # Recomputing activations in the backward pass gives the same gradients, and BatchNorm statistics are
    # updated once per step, not again by the recomputation.
    assert _gap(runs / "blocks-ac", runs / "blocks") < 1e-6


def test_each_process_holds_half_of_the_parameters_and_optimizer_state(runs):
    shards = json.loads((runs / "fsdp" / "summary.json").read_text())["bytes_per_device"]
    whole = json.loads((runs / "ddp" / "summary.json").read_text())["bytes_per_device"]
    # tinycnn's tensors have even first dimensions except the 10-class head, whose 10 rows split 5 + 5.
    assert shards["parameters"] * 2 == whole["parameters"]
    assert shards["optimizer_state"] * 2 == whole["optimizer_state"] > 0


def test_estimate_memory_gives_the_bytes_each_fsdp_process_held(runs):
    from scaletrain.memory import estimate

    held = json.loads((runs / "fsdp" / "summary.json").read_text())["bytes_per_device"]
    predicted = estimate("tinycnn", strategy="fsdp", nproc=2, optimizer="sgd", batch_size=16).parts
    assert predicted["parameters"] == held["parameters"]
    assert predicted["optimizer_state"] == held["optimizer_state"]


def test_sharded_checkpoint_saved_on_two_resumes_on_two_and_on_one(runs, data384, tmp_path):
    out = tmp_path / "killed"
    fsdp = ["--strategy", "fsdp"]
    _train(data384, out, "--nproc", "2", *fsdp, env={"SCALETRAIN_FAULT": "kill:8"}, expect=1)
    state = sorted((out / "state").iterdir())[-1]
    assert state.name == "step-00000006" and not (out / "summary.json").exists()
    assert sorted(p.name for p in (state / "sharded").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert json.loads((state / "train.json").read_text())["format"] == "sharded"

    import shutil

    shutil.copytree(out, tmp_path / "on-one")
    on_two = _train(data384, out, "--nproc", "2", *fsdp)
    assert "resuming from" in on_two.stdout and "optimizer step 6" in on_two.stdout
    assert _gap(out, runs / "fsdp") == 0.0  # same process count: bit for bit

    on_one = _train(data384, tmp_path / "on-one", *fsdp)
    assert "resuming from" in on_one.stdout and "1 process(es)" in on_one.stdout
    assert _gap(tmp_path / "on-one", runs / "fsdp") < 1e-4
    rows = list(csv.DictReader((tmp_path / "on-one" / "metrics.csv").open()))
    assert [r["epoch"] for r in rows] == ["1"]


def test_resume_needs_the_same_global_batch_and_skips_a_damaged_shard(runs, data384, tmp_path):
    out = tmp_path / "run"
    _train(data384, out, "--nproc", "2", "--strategy", "fsdp", env={"SCALETRAIN_FAULT": "kill:8"}, expect=1)
    before = sorted(p.name for p in (out / "state").iterdir())
    proc = run_cli("train", "--data", str(data384), *[a for a in COMMON if a not in ("--global-batch-size", "32")],
                   "--batch-size", "16", "--strategy", "fsdp", "--output-dir", str(out))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"scaletrain: error: {out}/state/step-00000006: saved with a global batch of 32 (--grad-accum 1), resumed "
        f"with 16 (--grad-accum 1); resume with --global-batch-size 32 --grad-accum 1")
    assert sorted(p.name for p in (out / "state").iterdir()) == before  # nothing lost

    # A damaged shard fails its checksum: the run falls back to the checkpoint before and still ends exactly.
    shard = out / "state" / "step-00000006" / "sharded" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    proc = _train(data384, out, "--nproc", "2", "--strategy", "fsdp")
    assert "__1_0.distcp does not match its checksum" in proc.stdout and "optimizer step 3" in proc.stdout
    assert _gap(out, runs / "fsdp") == 0.0


def test_a_whole_checkpoint_is_not_resumed_under_fsdp(runs, data384, tmp_path):
    out = tmp_path / "run"
    _train(data384, out, "--nproc", "2", env={"SCALETRAIN_FAULT": "kill:8"}, expect=1)
    proc = run_cli("train", "--data", str(data384), *COMMON, "--nproc", "2", "--strategy", "fsdp",
                   "--output-dir", str(out))
    assert proc.returncode == 2
    assert "saved without sharding; resume it with the --strategy it was trained with" in proc.stderr


def test_predict_and_evaluate_from_fsdp_weights_on_any_process_count(runs, data384, tmp_path):
    ckpt = runs / "fsdp"
    outputs = {}
    for name, extra in {"one": [], "fsdp": ["--nproc", "2", "--strategy", "fsdp"]}.items():
        # batch 50 on 101 samples: rank 0 has 51 (two batches), rank 1 has 50 (one), yet both join every gather
        proc = run_cli("evaluate", "--checkpoint", str(ckpt), "--data", str(data384), "--split", "val",
                       "--batch-size", "50", *extra, "--output-dir", str(tmp_path / f"eval-{name}"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        proc = run_cli("predict", "--checkpoint", str(ckpt), "--data", str(data384), "--batch-size", "50", *extra,
                       "--output", str(tmp_path / f"{name}.csv"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        outputs[name] = json.loads((tmp_path / f"eval-{name}" / "metrics.json").read_text())
    assert outputs["one"]["samples"] == outputs["fsdp"]["samples"] == 101
    assert outputs["one"]["confusion_matrix"] == outputs["fsdp"]["confusion_matrix"]
    assert outputs["fsdp"]["loss"] == pytest.approx(outputs["one"]["loss"], rel=1e-6)
    assert (tmp_path / "one.csv").read_text() == (tmp_path / "fsdp.csv").read_text()
    assert (tmp_path / "one.csv").read_text().count("\n") == 385


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
