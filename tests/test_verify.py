"""`scaletrain verify` and `scaletrain.verify`: a user's own transformer (its own tp_plan, dropout inside) proven
the same on ddp, fsdp, tp and pipeline stages; the same model with its attention reshaped by the head count found
different under tp from the first step, the attention module named with the cause, while fsdp stays equal; a layout
the model cannot take reported on one line while the others run; bad input refused before anything runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import run_cli, run_python

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "verify_heads.py"  # the model, clean and with the bug
FLAGS = ["--steps", "2", "--global-batch-size", "16", "--cpu"]


@pytest.mark.slow
def test_a_clean_transformer_is_equal_on_ddp_fsdp_tp_and_stages_with_its_dropout_turned_off_and_said(tmp_path):
    out = tmp_path / "v"
    r = run_cli("verify", "--model", f"{EXAMPLE}:make", "--layouts", "ddp2,fsdp2,tp2,pp2", *FLAGS,
                "--output-dir", str(out), "--json", str(tmp_path / "v.json"), timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((tmp_path / "v.json").read_text())
    assert report["steps"] == 2 and set(report["tolerance"]) >= {"loss", "grad_norm", "weight", "module"}
    assert [x["layout"] for x in report["layouts"]] == ["ddp2", "fsdp2", "tp2", "pp2"]
    for x in report["layouts"]:
        assert x["equal"] and x["error"] is None and x["first_step"] is None and x["first_module"] is None, x
        assert 0 <= x["max_loss_gap"] <= report["tolerance"]["loss"]
    assert report["reference"]["quieted"] == ["blocks.0.drop", "blocks.1.drop"]
    assert "turned off" in r.stdout and "blocks.0.drop" in r.stdout
    assert (out / "verify.png").stat().st_size > 0 and json.loads((out / "verify.json").read_text()) == report
    table = [line.split() for line in r.stdout.splitlines() if line.split()[:1] in (["ddp2"], ["tp2"], ["pp2"])]
    assert len(table) == 3 and all(row[1] == "yes" for row in table)


@pytest.mark.slow
def test_attention_reshaped_by_the_head_count_differs_under_tp_from_step_1_and_is_named(tmp_path):
    r = run_cli("verify", "--model", f"{EXAMPLE}:make_by_count", "--layouts", "fsdp2,tp2,tp3", *FLAGS,
                "--output-dir", str(tmp_path / "v"), "--json", str(tmp_path / "v.json"), timeout=900)
    assert r.returncode == 1, r.stdout + r.stderr
    fsdp, tp, tp3 = json.loads((tmp_path / "v.json").read_text())["layouts"]
    assert fsdp["equal"] and fsdp["error"] is None  # fsdp splits no layer: the count is right there
    assert not tp["equal"] and tp["first_step"] == 1 and tp["first_module"] == "blocks.0.attn", tp
    assert tp["max_loss_gap"] > 1e-4 and tp["module_gap"] > 1e-2
    assert "head count" in tp["cause"] and "blocks.0.attn.q" in tp["cause"]
    # a layout the model cannot take: its error, one line, and the others ran
    assert tp3["error"].startswith("--tp 3: blocks.0.attn.q has 32 output features") and "\n" not in tp3["error"]
    assert "blocks.0.attn" in r.stdout and "NO" in r.stdout


@pytest.mark.parametrize("flags, said", [
    (["--layouts", "tp2xtp2"], "--layouts: 'tp2xtp2' is not a layout"),
    (["--layouts", "ddp2xfsdp2"], "has ddp and fsdp"),
    (["--steps", "0"], "--steps: expected 1 or more"),
])
def test_bad_input_is_refused_by_name_before_anything_runs(flags, said, tmp_path):
    r = run_cli("verify", *flags, "--output-dir", str(tmp_path / "v"), "--cpu")
    assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "v").exists()


@pytest.mark.slow
def test_the_examples_own_script_verifies_through_the_python_api(tmp_path):
    out = tmp_path / "v"
    r = run_python([sys.executable, str(EXAMPLE), "--by-count", "--layouts", "tp2,ddp2", "--steps", "2", "--out",
                    str(out)], timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1] == "different: tp2 at blocks.0.attn", r.stdout
    report = json.loads((out / "verify.json").read_text())
    assert [(x["layout"], x["equal"]) for x in report["layouts"]] == [("tp2", False), ("ddp2", True)]
    for job in ("reference", "tp2", "ddp2"):  # a job's processes end at verify: nothing after it ran there
        assert "different:" not in (out / job / "job.log").read_text()


LATER = '''
import torch
import torch.distributed as dist
from torch import nn


class Rescale(nn.Module):  # scales by the process count from its second training step on: a layout's bug
    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        world = dist.get_world_size() if dist.is_initialized() else 1
        out = x * world if self.steps >= 1 else x
        if self.training:
            self.steps += 1
        return out


def make(num_classes, in_chans):
    return nn.Sequential(nn.Flatten(), nn.Linear(in_chans * 28 * 28, 16), Rescale(), nn.ReLU(),
                         nn.Linear(16, num_classes))
'''


@pytest.mark.slow
def test_a_difference_from_the_second_step_is_captured_again_before_that_step_and_named(tmp_path):
    (tmp_path / "later.py").write_text(LATER)
    r = run_cli("verify", "--model", f"{tmp_path / 'later.py'}:make", "--layouts", "ddp2", *FLAGS, "--output-dir",
                str(tmp_path / "v"), "--json", str(tmp_path / "v.json"), timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr
    [ddp] = json.loads((tmp_path / "v.json").read_text())["layouts"]
    assert ddp["gaps"][0]["within"] and not ddp["gaps"][1]["within"]
    assert ddp["first_step"] == 2 and ddp["first_module"] == "2", ddp  # Sequential's third module: "2"
    assert (tmp_path / "v" / "ddp2-2" / "probe-2-stage0.safetensors").exists()


@pytest.mark.slow
def test_a_batchnorm_differs_on_ddp_and_is_named_with_its_cause(tmp_path):
    """smallcnn's BatchNorm normalises each replica's half of the batch under ddp: not a rounding, and said so."""
    r = run_cli("verify", "--model", "smallcnn", "--layouts", "ddp2", "--steps", "1", "--global-batch-size", "32",
                "--cpu", "--output-dir", str(tmp_path / "v"), "--json", str(tmp_path / "v.json"), timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr
    [ddp] = json.loads((tmp_path / "v.json").read_text())["layouts"]
    assert not ddp["equal"] and ddp["first_step"] == 1 and ddp["first_module"] == "features.1", ddp
    assert "BatchNorm" in ddp["cause"] and "--sync-bn" in ddp["cause"] and "--sync-bn" in r.stdout


def test_devices_with_no_layout_that_fits_is_refused_naming_estimate_memory(tmp_path):
    r = run_cli("verify", "--model", "smallcnn", "--devices", "2", "--device-memory", "1KB", "--cpu",
                "--output-dir", str(tmp_path / "v"), timeout=300)
    assert r.returncode == 2 and "--devices 2: no layout fits --device-memory" in r.stderr, r.stdout + r.stderr
    assert "scaletrain estimate-memory --model smallcnn --devices 2" in r.stderr and "Traceback" not in r.stderr
    assert "tp 2 left out: --tp 2: no tensor-parallel plan for SmallCNN" in r.stdout  # each left out, and why
    assert not (tmp_path / "v").exists()
