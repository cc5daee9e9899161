"""`scaletrain estimate-memory`: per-device bytes against real tensors, activations against real steps, the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from scaletrain.cli import main
from scaletrain.config import TrainConfig
from scaletrain.parallel import apply_activation_checkpointing
from scaletrain.training.optim import make_optimizer
from scaletrain.measure.memory import estimate, fsdp_gather_bytes, measure_activation_bytes, parse_memory, state_bytes
from scaletrain.models import build_model, freeze_backbone

from helpers import run_cli


def _real_state(model: nn.Module, optimizer_name: str) -> dict[str, int]:
    """Bytes of the tensors one real training step leaves behind: weights, buffers, gradients, optimizer state."""
    optimizer = make_optimizer(model, TrainConfig.from_dict({"optim": {"optimizer": optimizer_name}}).optim)
    images, labels = torch.randn(4, 1, 28, 28), torch.tensor([0, 1, 2, 3])
    nn.functional.cross_entropy(model(images), labels).backward()
    optimizer.step()
    return {
        "parameters": sum(p.nbytes for p in model.parameters()),
        "buffers": sum(b.nbytes for b in model.buffers()),
        "gradients": sum(p.grad.nbytes for p in model.parameters() if p.grad is not None),
        # the scalar `step` counters of Adam stay on the CPU even when training on a GPU
        "optimizer_state": sum(t.nbytes for state in optimizer.state.values() for key, t in state.items()
                               if torch.is_tensor(t) and key != "step"),
    }


@pytest.mark.parametrize("optimizer_name", ["sgd", "adamw"])
@pytest.mark.parametrize("frozen", [False, True], ids=["all-trained", "frozen-backbone"])
def test_state_bytes_equal_a_real_step(optimizer_name, frozen):
    torch.manual_seed(0)
    model = build_model("smallcnn", 1, 10)
    if frozen:
        freeze_backbone(model)
    predicted = state_bytes(model, "ddp", 1, optimizer_name)
    assert predicted == _real_state(model, optimizer_name)
    assert predicted["optimizer_state"] == predicted["gradients"] * (1 if optimizer_name == "sgd" else 2)


def _two_linears():
    return nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 1))


def test_fsdp_holds_rank_0s_shard_of_each_parameter():
    # 2 processes; rank 0 holds ceil(rows / 2) rows of each parameter:
    # weight 5x3 -> 3 rows x 3 = 9, bias 5 -> 3, weight 1x5 -> 1 row x 5 = 5, bias 1 -> 1: 18 elements, 72 bytes;
    # adamw keeps two moments of each.
    assert state_bytes(_two_linears(), "fsdp", 2, "adamw") == {"parameters": 72, "buffers": 0, "gradients": 72,
                                                               "optimizer_state": 144}


def test_ddp_keeps_every_parameter_on_every_device():
    # all 15 + 5 + 5 + 1 = 26 elements, 104 bytes; sgd's momentum one copy of them
    assert state_bytes(_two_linears(), "ddp", 2, "sgd") == {"parameters": 104, "buffers": 0, "gradients": 104,
                                                            "optimizer_state": 104}


def test_fsdp_shards_as_torch_does():
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    model = build_model("smallcnn", 1, 10)
    predicted = state_bytes(model, "fsdp", 3)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=3)
    try:
        fully_shard(model)
        assert predicted["parameters"] == sum(p.to_local().nbytes for p in model.parameters())
    finally:
        dist.destroy_process_group()


class _BlocksAndHead(nn.Module):
    """Two units (a Linear and a BatchNorm) and a root holding the head."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4))
        self.head = nn.Linear(4, 3)


# units: Linear(2, 4) 12 elements, BatchNorm1d(4) 8; root: head 15. Largest gradients: 12 x 4 bytes = 48.
@pytest.mark.parametrize("precision, expected", [
    ("no", 60 + 2 * 48 + 48),  # fp32: root 60 + 2 x 48 (Linear) + 48
    ("bf16", 60 + 2 * 32 + 48),  # Linear 24 bytes, BatchNorm kept fp32 32 (the largest); the root holds BatchNorm
])
def test_fsdp_gathered_bytes_by_hand(precision, expected):
    assert fsdp_gather_bytes(_BlocksAndHead(), precision) == expected


def test_parameter_gradients_are_not_activations():
    # a 16 MB weight gradient, activations of a few kB
    model = nn.Sequential(nn.Flatten(), nn.Linear(2000, 2000, bias=False))
    assert measure_activation_bytes(model, 1, 1, (1, 2000)) < 100_000


def test_saved_activations_and_their_gradients_are_counted():
    # the 4 x 100000 hidden layer (1.6 MB) is kept for the backward pass, where its gradient (1.6 MB) joins it
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 100_000), nn.Linear(100_000, 2))
    assert 3_200_000 <= measure_activation_bytes(model, 4, 1, (1, 4)) < 3_210_000


def _estimated_and_measured(name: str, image_size: int, precision: str, checkpointing: bool = False,
                            batch: int = 64):
    """Activations at `batch` scaled from the small batches, and measured in a real step at that batch."""
    channels = 1 if name == "smallcnn" else 3
    estimated = estimate(name, image_size=image_size, batch_size=batch, mixed_precision=precision,
                         activation_checkpointing=checkpointing).parts["activations"]
    model = build_model(name, channels, 10)
    if checkpointing:
        apply_activation_checkpointing(model)
    return estimated, measure_activation_bytes(model, batch, channels, image_size, precision)


@pytest.fixture(scope="module")
def resnet18_bf16():
    # 32 px, batch 32: bf16 convolutions on a CPU without bf16 kernels take torch's slow path (27x fp32's time)
    return _estimated_and_measured("resnet18", 32, "bf16", batch=32)


def test_smallcnn_activations_scaled_from_small_batches_match_a_real_step():
    estimated, measured = _estimated_and_measured("smallcnn", 28, "no")
    assert abs(estimated / measured - 1) <= 0.2, (estimated, measured)


@pytest.mark.slow
def test_resnet18_bf16_activations_scaled_from_small_batches_match_a_real_step(resnet18_bf16):
    estimated, measured = resnet18_bf16
    assert abs(estimated / measured - 1) <= 0.2, (estimated, measured)


@pytest.mark.slow
def test_activation_checkpointing_estimate_matches_and_saves_memory(resnet18_bf16):
    estimated, measured = _estimated_and_measured("resnet18", 32, "bf16", checkpointing=True, batch=32)
    assert abs(estimated / measured - 1) <= 0.2, (estimated, measured)
    assert estimated < 0.8 * resnet18_bf16[0], (estimated, resnet18_bf16)


def test_largest_batch_is_the_last_that_fits():
    est = estimate("tinycnn", device_memory="200MB")
    largest = est.largest_batch_size
    assert largest > 1
    assert estimate("tinycnn", batch_size=largest, device_memory="200MB").fits
    assert not estimate("tinycnn", batch_size=largest + 1, device_memory="200MB").fits


@pytest.mark.parametrize("text, expected", [("80GB", 80 * 10 ** 9), ("80G", 80 * 10 ** 9), ("141GiB", 141 * 2 ** 30),
                                            ("16000MB", 16 * 10 ** 9), ("123456", 123456), ("1.5 gib", 3 * 2 ** 29)])
def test_device_memory_forms(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.slow
def test_cli_fits_with_table_and_largest_batch():
    r = run_cli("estimate-memory", "--model", "smallcnn", "--batch-size", "256", "--device-memory", "80GB")
    assert r.returncode == 0, r.stderr
    for row in ("| parameters", "| buffers", "| gradients", "| optimizer state", "| activations", "| **total**"):
        assert row in r.stdout, r.stdout
    assert "measured at batches 2 and 4 on the CPU" in r.stdout
    assert "fits: uses" in r.stdout and "largest batch per device that fits: " in r.stdout, r.stdout


@pytest.mark.slow
def test_cli_does_not_fit():
    r = run_cli("estimate-memory", "--model", "smallcnn", "--device-memory", "1MB")
    assert r.returncode == 0, r.stderr
    assert "does not fit" in r.stdout and "not even batch 1" in r.stdout, r.stdout


@pytest.fixture(scope="module")
def fsdp_json():
    """`estimate-memory --json` for smallcnn under fsdp on 2 processes with adam, against a 1 MB device."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["estimate-memory", "--model", "smallcnn", "--strategy", "fsdp", "--nproc", "2", "--optimizer",
                     "adam", "--device-memory", "1MB", "--json"])
    assert code == 0
    return json.loads(out.getvalue())


def test_cli_json_says_nothing_fits_in_1mb(fsdp_json):
    assert fsdp_json["fits"] is False and fsdp_json["largest_batch_size"] == 0


def test_cli_json_total_is_the_sum_of_its_parts(fsdp_json):
    parts = {k: v for k, v in fsdp_json["bytes"].items() if k != "total"}
    assert len(parts) >= 5 and all(v >= 0 for v in parts.values())
    assert fsdp_json["bytes"]["total"] == sum(parts.values())


def test_cli_json_counts_two_adam_moments_per_gradient(fsdp_json):
    assert fsdp_json["bytes"]["optimizer_state"] == 2 * fsdp_json["bytes"]["gradients"] > 0


def test_cli_json_under_fsdp_counts_the_gathered_parameters(fsdp_json):
    expected = fsdp_gather_bytes(build_model("smallcnn", 1, 10), "no")
    assert fsdp_json["bytes"]["gathered_parameters"] == expected > 0


@pytest.mark.parametrize("argv, expected", [
    (["--model", "smallcnn", "--device-memory", "lots"], "--device-memory: expected a positive size like 80GB"),
    (["--model", "nosuchnet"], "unknown model 'nosuchnet'"),
])
def test_cli_bad_input_is_one_line(argv, expected):
    r = run_cli("estimate-memory", *argv)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and expected in lines[0], r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("precision, checkpointing", [("no", False), ("bf16", True)])
def test_tracked_bytes_agree_with_the_c_allocator(precision, checkpointing):
    """What the tracker counts is what the allocator itself handed out: both sampled after every op of a real
    resnet18 step (gradients included on both sides), peaks within 2 %."""
    import gc

    from scaletrain.measure.memory import AllocatorPeak, StorageTracker, c_allocator_bytes

    in_use = c_allocator_bytes()
    if in_use is None:
        pytest.skip("needs glibc 2.33+ (mallinfo2) to read the allocator")

    torch.manual_seed(0)
    model = build_model("resnet18", 3, 10)
    if checkpointing:
        apply_activation_checkpointing(model)
    # fp32 at batch 64 of 64 px; bf16 smaller, as its convolutions take torch's slow path on a CPU without bf16
    size, batch = (64, 64) if precision == "no" else (32, 16)
    images, labels = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))

    def step():
        for p in model.parameters():
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "no"):
            loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()

    step()  # warm-up: kernels' caches are made once, not per step
    model.zero_grad(set_to_none=True)
    gc.collect()
    before, sampler = in_use(), AllocatorPeak(in_use)
    with sampler:
        step()
    model.zero_grad(set_to_none=True)
    gc.collect()
    tracker = StorageTracker([images, labels, *model.parameters(), *model.buffers()])
    with tracker:
        step()
    tracked, allocated = max(tracker.timeline()), sampler.peak - before
    assert abs(tracked / allocated - 1) <= 0.02, (tracked, allocated)
