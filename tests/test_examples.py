"""The scripts in examples/ run as users run them, on one process and on two (torchrun, accelerate launch), with
every validation sample counted once, the same predictions from the same weights on any process count, and a run
killed mid-epoch resuming to bitwise the same weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import textwrap

import pytest
import torch
from safetensors.torch import load_file

from helpers import run_python

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TWO = {"torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
       "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                      "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]}
# example: (its own arguments besides --out, validation samples with --quick, epochs with --quick)
CASES = {"kaggle_digits.py": (["--data", "{tmp}/kaggle"], 200, 1), "mnist_onecycle.py": ([], 500, 1),
         "ddp_mnist.py": ([], 500, 1), "flowers.py": (["--data", "{tmp}/flowers", "--weights", "{tmp}/r34.pth"], 20, 1),
         "segment_digits.py": ([], 500, 1), "mnist_steplr.py": ([], 500, 1), "nlp_bert.py": ([], 101, 1),
         "dcgan_digits.py": ([], 0, 1), "simclr_digits.py": ([], 301, 1)}
# detect_boxes.py runs once on 1 and once on 2 processes for the mAP's tests below (the `detected` fixture)


def run_example(name: str, out: Path, *args: str, launcher: str | None = None, env: dict | None = None,
                cwd: Path | None = None, expect: int = 0, wrapper: Path | None = None) -> subprocess.CompletedProcess:
    """`wrapper`: a script the launcher starts instead, given the example's path and arguments."""
    cmd = [*(TWO[launcher] if launcher else [sys.executable]), *([str(wrapper)] if wrapper else []),
           str(EXAMPLES / name), "--quick", "--out", str(out), *args]
    proc = run_python(cmd, timeout=240, env=env, cwd=cwd)
    assert proc.returncode == expect, (proc.stdout + proc.stderr)[-4000:]
    return proc


def _args(name: str, tmp: Path) -> list[str]:
    return [a.format(tmp=tmp) for a in CASES[name][0]]


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_example_trains_on_one_and_on_two_processes_counting_every_validation_sample_once(name, tmp_path):
    """On two processes under torchrun; one example under accelerate launch instead, inside a wrapper that fails
    when gloo threads are left at exit: such threads can abort a finished run's exit (SIGABRT), and the launcher
    then reports the job failed."""
    two = ACCELERATE_LAUNCHED.get(name, "torchrun")
    checked = _exit_check(tmp_path) if two == "accelerate" and Path("/proc/self/task").is_dir() else None
    for processes, launcher, wrapper in ((1, None, None), (2, two, checked)):
        out = tmp_path / f"run-{processes}"
        run_example(name, out, *_args(name, tmp_path), launcher=launcher, wrapper=wrapper)
        summary = json.loads((out / "summary.json").read_text())
        assert (summary["world_size"], summary["val_samples"]) == (processes, CASES[name][1]), name
        lines = (out / "metrics.csv").read_text().count("\n")
        assert (out / "best.safetensors").is_file() and lines == 1 + CASES[name][2]


ACCELERATE_LAUNCHED = {"mnist_onecycle.py": "accelerate"}  # the others run under torchrun
EXIT_CHECK = """
import atexit, os, runpy, sys

def gloo_threads_left():  # registered first, so it runs after every other exit handler
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    if any("gloo" in n for n in names):
        print("gloo threads still running at exit:", names, file=sys.stderr, flush=True)
        os._exit(3)

atexit.register(gloo_threads_left)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _exit_check(tmp: Path) -> Path:
    wrapper = tmp / "exit_check.py"
    wrapper.write_text(EXIT_CHECK)
    return wrapper


RESUMED_MODEL = "test_resnet"


@pytest.fixture(scope="module")
def kaggle(tmp_path_factory):
    """The Kaggle example run once to the end on one process, and the same run killed mid-epoch and resumed."""
    tmp = tmp_path_factory.mktemp("kaggle")
    # timm's smallest ResNet (batch norm, residual blocks, as resnet18 has) instead of the default resnet18: the
    # resume is the same code for either, and the three runs take a third of the time
    args = ["--data", str(tmp / "data"), "--epochs", "2", "--checkpoint-every", "2", "--model", RESUMED_MODEL]
    return tmp, *killed_and_resumed("kaggle_digits.py", tmp, args, "kill:9")


def killed_and_resumed(name: str, tmp: Path, args: list[str], fault: str):
    """The example run to the end into tmp/whole, then into tmp/resumed killed by `fault` and run again:
    (the killed run, the resumed run)."""
    run_example(name, tmp / "whole", *args)
    killed = run_example(name, tmp / "resumed", *args, env={"SCALETRAIN_FAULT": fault}, expect=-9)
    return killed, run_example(name, tmp / "resumed", *args)


def assert_resumed_to_the_same_weights(tmp: Path, killed, resumed) -> None:
    assert "epoch 2/2" not in killed.stdout and "resuming from" in resumed.stdout
    whole, again = load_file(tmp / "whole" / "last.safetensors"), load_file(tmp / "resumed" / "last.safetensors")
    assert whole.keys() == again.keys() and all(torch.equal(whole[k], again[k]) for k in whole)


def test_the_kaggle_example_killed_mid_epoch_resumes_to_the_same_weights_and_submission(kaggle):
    tmp, killed, resumed = kaggle
    assert_resumed_to_the_same_weights(tmp, killed, resumed)
    assert (tmp / "whole" / "submission.csv").read_text() == (tmp / "resumed" / "submission.csv").read_text()


PREDICT = """
import sys
sys.path.insert(0, sys.argv[1])
import pandas as pd, torch
from safetensors.torch import load_file, save_file
import scaletrain
from kaggle_digits import Classifier, DigitRows, pipeline

model = Classifier(sys.argv[5])
model.load_state_dict(load_file(sys.argv[2]))
rows = pd.read_csv(sys.argv[3] + "/test.csv").values[:103]
config = scaletrain.TrainConfig()
config.optim.batch_size = 16
logits = scaletrain.predict(model, DigitRows(rows, transform=pipeline(28, False)), config)
import os
if os.environ.get("RANK", "0") == "0":
    save_file({"logits": logits}, sys.argv[4])
"""


def test_the_same_weights_predict_the_same_logits_on_one_and_two_processes(kaggle, tmp_path):
    tmp = kaggle[0]
    script = tmp_path / "predict.py"
    script.write_text(PREDICT)
    logits = {}
    for processes, launcher in ((1, [sys.executable]), (2, TWO["torchrun"])):
        target = tmp_path / f"logits-{processes}.safetensors"
        proc = run_python([*launcher, script, EXAMPLES, tmp / "whole" / "best.safetensors", tmp / "data", target,
                           RESUMED_MODEL])
        assert proc.returncode == 0, proc.stderr[-3000:]
        logits[processes] = load_file(target)["logits"]
    assert logits[1].shape == (103, 10) and torch.equal(logits[1], logits[2])


def test_the_submission_has_a_label_for_every_test_row(kaggle):
    lines = (kaggle[0] / "whole" / "submission.csv").read_text().splitlines()
    assert lines[0] == "ImageId,Label" and len(lines) == 201
    assert all(0 <= int(line.split(",")[1]) <= 9 for line in lines[1:])


SCORE = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
from safetensors.torch import load_file
import scaletrain
from segment_digits import CLASSES, DigitMasks, Masks, make_net, metrics
from torch import nn

net = make_net(16)
net.load_state_dict(load_file(sys.argv[2]))
val = DigitMasks(8000, 8500)
config = scaletrain.TrainConfig()
values = scaletrain.evaluate(net, val, config, nn.CrossEntropyLoss(), metrics=metrics())
masks = scaletrain.predict(Masks(net), val, config, output=sys.argv[3] + "/masks.npy")
if int(os.environ.get("RANK", "0")) == 0:
    (open(sys.argv[3] + "/values.json", "w")).write(json.dumps(values))
"""


@pytest.fixture(scope="module")
def segmented(tmp_path_factory):
    """The segmentation example run to the end on one process, and the same run killed mid-epoch and resumed."""
    tmp = tmp_path_factory.mktemp("segment")
    return tmp, *killed_and_resumed("segment_digits.py", tmp, ["--epochs", "2", "--checkpoint-every", "5"], "kill:40")


def test_the_segmentation_example_killed_mid_epoch_resumes_to_the_same_weights_and_masks(segmented):
    tmp, killed, resumed = segmented
    assert_resumed_to_the_same_weights(tmp, killed, resumed)
    assert (tmp / "whole" / "masks.npy").read_bytes() == (tmp / "resumed" / "masks.npy").read_bytes()
    header = (tmp / "whole" / "metrics.csv").read_text().splitlines()[0]
    assert header.startswith("epoch,train_loss,val_loss,val_iou,val_pixel_accuracy,val_dice,") and "accuracy," \
        not in header.replace("pixel_accuracy", "")


def test_the_segmentation_examples_weights_score_the_same_on_one_and_two_processes(segmented, tmp_path):
    """The same weights: every metric equal to 1e-5 and every predicted mask the same on 1 and 2 processes."""
    import numpy as np

    script = tmp_path / "score.py"
    script.write_text(SCORE)
    for processes, launcher in ((1, [sys.executable]), (2, TWO["torchrun"])):
        (tmp_path / str(processes)).mkdir()
        proc = run_python([*launcher, script, EXAMPLES, segmented[0] / "whole" / "best.safetensors",
                           tmp_path / str(processes)])
        assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = (json.loads((tmp_path / p / "values.json").read_text()) for p in ("1", "2"))
    assert set(one) == {"loss", "iou", "pixel_accuracy", "dice", "samples"} and one["samples"] == 500
    assert all(two[k] == pytest.approx(one[k], rel=1e-5) for k in one)
    masks = np.load(tmp_path / "1" / "masks.npy")
    assert masks.shape == (500, 28, 28) and masks.dtype == np.uint8
    assert np.array_equal(masks, np.load(tmp_path / "2" / "masks.npy"))


DETECTION = textwrap.dedent('''
    import json, os, sys
    sys.path.insert(0, sys.argv[1])
    import torch
    from safetensors.torch import load_file
    import scaletrain
    from detect_boxes import BoxMAP, Detection, Squares, collate, make_detector

    model = make_detector()
    model.load_state_dict(load_file(sys.argv[2]))
    config = scaletrain.TrainConfig()
    config.optim.batch_size, config.data.num_workers = 4, 0
    values = scaletrain.evaluate(model, Squares(21, seed=1), config, step=Detection(), collate_fn=collate,
                                 metrics={"map": BoxMAP()})
    if os.environ.get("RANK", "0") == "0":
        open(sys.argv[3], "w").write(json.dumps(values))
''')


@pytest.fixture(scope="module")
def detected(tmp_path_factory):
    """The detection example's quick run on 1 process and on 2 (its folders)."""
    tmp = tmp_path_factory.mktemp("detect")
    for processes, launcher in ((1, None), (2, "torchrun")):
        run_example("detect_boxes.py", tmp / f"run-{processes}", launcher=launcher)
    return tmp


def test_the_detection_example_trains_on_one_and_two_processes_each_image_validated_once(detected):
    for processes in (1, 2):
        summary = json.loads((detected / f"run-{processes}" / "summary.json").read_text())
        assert (summary["world_size"], summary["val_samples"], summary["epochs_run"]) == (processes, 21, 2)
        header = (detected / f"run-{processes}" / "metrics.csv").read_text().splitlines()[0]
        assert header.startswith("epoch,train_loss,train_loss_classifier,train_loss_box_reg,") and "val_map" in header


def test_a_detectors_map_is_the_same_on_two_processes_as_on_one_for_the_same_weights(detected, tmp_path):
    """21 images: shards of 11 and 10 (each rank a different number of lists of boxes), no image twice; equal to
    torchmetrics' own mAP in one process, and to what fit's validation reported on 2."""
    out = detected / "run-2"
    script = tmp_path / "score.py"
    script.write_text(DETECTION)
    values = {}
    for processes, launcher in ((1, [sys.executable]), (2, TWO["torchrun"])):
        target = tmp_path / f"values-{processes}.json"
        run = run_python([*launcher, script, EXAMPLES, out / "last.safetensors", target])
        assert run.returncode == 0, run.stderr[-3000:]
        values[processes] = json.loads(target.read_text())
    assert values[1] == values[2] and values[1]["samples"] == 21 and set(values[1]) == {"map", "samples"}

    sys.path.insert(0, str(EXAMPLES))
    from detect_boxes import BoxMAP, Squares, make_detector  # noqa: E402

    model = make_detector()
    model.load_state_dict(load_file(out / "last.safetensors"))
    model.eval()
    metric = BoxMAP()
    with torch.no_grad():
        for image, target in Squares(21, seed=1):
            metric.update(model([image]), [target])
    assert values[1]["map"] == pytest.approx(metric.compute().item(), abs=1e-6) and values[1]["map"] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["final_val_map"] == pytest.approx(values[1]["map"], abs=1e-6)
