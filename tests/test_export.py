"""export: ONNX and TorchScript files that predict what `scaletrain predict` predicts, with their preprocessing."""

from __future__ import annotations

import csv
import io
import json
import os
import sys

import numpy as np
import pytest
import torch

from conftest import write_npz
from scaletrain.inference import export as export_module
from scaletrain.cli import main
from scaletrain.models import build_model
from scaletrain.runfolder import load_weights, save_weights

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit:FutureWarning")  # TorchScript is what is asked for here
FIRST, COUNT = 600, 40  # digits the run below never saw (it trains on 1000..2000, validates on 2000..2200)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, mnist):
    root = tmp_path_factory.mktemp("export")
    data = write_npz(root / "digits.npz", mnist, 1000, 200, offset=1000)
    run = root / "run"
    assert main(["train", "--data", str(data), "--model", "tinycnn", "--epochs", "2", "--batch-size", "32",
                 "--log-every", "1000", "--output-dir", str(run)]) == 0
    return run


@pytest.fixture(scope="module")
def unseen(trained, mnist):
    """COUNT digits as an unlabelled .npz (what predict reads), and the same images as an array."""
    images = mnist.images[FIRST:FIRST + COUNT, 0].numpy()
    path = trained.parent / "unseen.npz"
    np.savez(path, images=images)
    return path, images


def _export(run, fmt, out, *extra):
    return main(["export", "--checkpoint", str(run), "--format", fmt, "--output", str(out), *extra])


def _predicted(trained, data, out):
    """Labels and logits `scaletrain predict` gives for `data`."""
    assert main(["predict", "--checkpoint", str(trained), "--data", str(data), "--output", str(out),
                 "--batch-size", "8", "--logits"]) == 0
    rows = list(csv.reader(out.open()))[1:]
    return [r[1] for r in rows], torch.tensor([[float(v) for v in r[2:]] for r in rows])


def _inputs(images: np.ndarray, meta: dict) -> np.ndarray:
    """What a server does with the recorded preprocessing (the digits here are already the input size)."""
    pre = meta["preprocess"]
    assert images.shape[1:] == (pre["image_size"], pre["image_size"])
    x = images[:, None].astype(np.float32) / 255
    mean, std = (np.array(pre[k], dtype=np.float32).reshape(1, -1, 1, 1) for k in ("mean", "std"))
    return (x - mean) / std


def test_onnx_predicts_what_predict_predicts_at_any_batch_size(trained, unseen, tmp_path, capsys):
    import onnxruntime

    data, images = unseen
    out = tmp_path / "model.onnx"
    assert _export(trained, "onnx", out, "--data", str(data)) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"wrote {out} (onnx") and "max abs logit difference" in line
    assert f"argmax agrees on {COUNT}/{COUNT} images" in line

    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    meta = json.loads(session.get_modelmeta().custom_metadata_map["scaletrain"])
    assert [(i.name, i.shape) for i in session.get_inputs()] == [("input", ["batch", 1, 28, 28])]
    x = _inputs(images, meta)
    logits = np.concatenate([session.run(None, {"input": x[:1]})[0], session.run(None, {"input": x[1:6]})[0],
                             session.run(None, {"input": x[6:]})[0]])
    labels, expected = _predicted(trained, data, tmp_path / "p.csv")
    assert [meta["classes"][i] for i in logits.argmax(1)] == labels
    assert torch.allclose(torch.from_numpy(logits), expected, atol=1e-4)
    assert len(set(labels)) >= 5  # a model that tells digits apart, so equal labels mean something


def test_onnx_records_preprocessing_and_classes(trained, tmp_path, capsys):
    import onnx

    out = tmp_path / "model.onnx"
    assert _export(trained, "onnx", out, "--check-samples", "20", "--batch-size", "8") == 0  # the run's own data
    assert "argmax agrees on 20/20 images, batches of 1, 4, 8" in capsys.readouterr().out
    props = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    meta = json.loads(props["scaletrain"])
    _, saved = load_weights(trained / "best.safetensors")
    assert meta["classes"] == saved["classes"] == [str(d) for d in range(10)]
    pre = meta["preprocess"]
    assert {k: pre[k] for k in saved["preprocess"]} == saved["preprocess"]
    assert (pre["channels"], pre["image_size"], pre["recipe"]) == (1, 28, "digits")
    assert meta["input"] == {"name": "input", "dtype": "float32", "layout": "NCHW", "shape": ["batch", 1, 28, 28]}
    assert meta["model"] == "tinycnn" and meta["checkpoint"].endswith("best.safetensors")


def test_torchscript_round_trip(trained, unseen, tmp_path, capsys):
    data, images = unseen
    out = tmp_path / "model.pt"
    assert _export(trained / "last.safetensors", "torchscript", out, "--data", str(data)) == 0
    assert "last.safetensors" in capsys.readouterr().out
    extra = {"scaletrain.json": ""}
    module = torch.jit.load(str(out), _extra_files=extra)
    meta = json.loads(extra["scaletrain.json"])
    x = torch.from_numpy(_inputs(images, meta))
    with torch.no_grad():
        logits = torch.cat([module(x[:1]), module(x[1:6]), module(x[6:])])
    labels, expected = _predicted(trained, data, tmp_path / "p.csv")
    assert [meta["classes"][i] for i in logits.argmax(1)] == labels
    assert torch.allclose(logits, expected, atol=1e-4)


def _refused(capsys, args, folder):
    before = sorted(os.listdir(folder))
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("scaletrain: error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert sorted(os.listdir(folder)) == before  # no export, no temporary file left
    return err


def test_bad_inputs_are_one_line_and_write_nothing(trained, tmp_path, capsys):
    out = tmp_path / "m.onnx"
    assert "--format" in _refused(capsys, ["export", "--checkpoint", str(trained), "--format", "tflite",
                                           "--output", str(out)], tmp_path)
    assert "--checkpoint" in _refused(capsys, ["export", "--checkpoint", str(tmp_path / "nope"), "--format",
                                               "onnx", "--output", str(out)], tmp_path)
    (tmp_path / "file").write_text("")
    assert "--output" in _refused(capsys, ["export", "--checkpoint", str(trained), "--format", "torchscript",
                                           "--output", str(tmp_path / "file" / "m.pt")], tmp_path)
    # a run whose data is gone: the check asks for images instead of exporting unchecked
    weights, meta = load_weights(trained / "best.safetensors")
    meta["config"]["data"]["data"] = str(tmp_path / "moved.npz")
    save_weights(tmp_path / "moved.safetensors", weights, meta)
    assert "give --data" in _refused(capsys, ["export", "--checkpoint", str(tmp_path / "moved.safetensors"),
                                              "--format", "torchscript", "--output", str(out)], tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_read_only_output_folder_is_refused(trained, tmp_path, capsys):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        assert "cannot write there" in _refused(capsys, ["export", "--checkpoint", str(trained), "--format",
                                                         "torchscript", "--output", str(folder / "m.pt")], folder)
    finally:
        folder.chmod(0o700)


def test_an_export_that_disagrees_is_not_written(trained, tmp_path, capsys, monkeypatch):
    out = tmp_path / "model.pt"
    out.write_text("the previous export")
    to_bytes, runner = export_module.EXPORTERS["torchscript"]

    def off_by_a_little(data):
        run = runner(data)
        return lambda x: run(x) + 1e-2

    monkeypatch.setitem(export_module.EXPORTERS, "torchscript", (to_bytes, off_by_a_little))
    err = _refused(capsys, ["export", "--checkpoint", str(trained), "--format", "torchscript", "--output", str(out),
                            "--check-samples", "10"], tmp_path)
    assert "does not match PyTorch" in err and "max abs logit difference 0.01" in err
    assert out.read_text() == "the previous export"


def test_missing_onnxruntime_names_the_extra(trained, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime now raises ImportError
    err = _refused(capsys, ["export", "--checkpoint", str(trained), "--format", "onnx", "--output",
                            str(tmp_path / "m.onnx")], tmp_path)
    assert err == ("scaletrain: error: --format onnx needs onnx, onnxscript and onnxruntime: "
                   "pip install 'scaletrain[export]'\n")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_a_timm_model_exports(tmp_path, capsys, fmt):
    """resnet10t on 32x32 RGB: a checkpoint made directly (training it would add nothing the export reads)."""
    torch.manual_seed(0)
    model = build_model("resnet10t", 3, 5).train()
    with torch.no_grad():  # running statistics that are not the identity, as a trained model has
        model(torch.randn(16, 3, 32, 32) * 2 + 1)
    pre = {"channels": 3, "image_size": 32, "mean": [0.5, 0.4, 0.3], "std": [0.2, 0.25, 0.3], "recipe": "digits"}
    save_weights(tmp_path / "best.safetensors", model.state_dict(),
                 {"model": "resnet10t", "classes": list("abcde"), "preprocess": pre})
    data = tmp_path / "rgb.npz"
    np.savez(data, images=np.random.default_rng(0).integers(0, 256, (10, 32, 32, 3), dtype=np.uint8))
    out = tmp_path / f"model.{fmt}"
    assert _export(tmp_path, fmt, out, "--data", str(data), "--batch-size", "4") == 0
    assert "argmax agrees on 10/10 images, batches of 1, 2, 4" in capsys.readouterr().out
    assert out.stat().st_size > 1_000_000
    if fmt == "torchscript":
        extra = {"scaletrain.json": ""}
        torch.jit.load(io.BytesIO(out.read_bytes()), _extra_files=extra)
        assert json.loads(extra["scaletrain.json"])["input"]["shape"] == ["batch", 3, 32, 32]
