"""predict and evaluate: exact across process counts; checkpoints and pretrained weights in and out."""

from __future__ import annotations

import csv
import json
import os
import pickle

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from helpers import run_cli
from scaletrain.cli import main
from scaletrain.inference import load_checkpoint
from scaletrain.runfolder import load_weights, save_weights

HEADER = ",".join(f"pixel{i}" for i in range(784))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, small_npz):
    run = tmp_path_factory.mktemp("trained") / "run"
    assert main(["train", "--data", str(small_npz), "--model", "tinycnn", "--epochs", "2", "--batch-size", "32",
                 "--output-dir", str(run)]) == 0
    return run


def _npz(tmp_path, mnist, n):
    path = tmp_path / f"set{n}.npz"
    np.savez(path, images=mnist.images[600:600 + n, 0].numpy(), labels=mnist.labels[600:600 + n].numpy())
    return path


def _predict(trained, data, out, nproc, *extra):
    args = ["predict", "--checkpoint", str(trained), "--data", str(data), "--output", str(out), "--batch-size", "8",
            "--nproc", str(nproc), *extra]
    if nproc == 1:
        assert main(args) == 0
    else:
        proc = run_cli(*args)
        assert proc.returncode == 0, proc.stderr
    return list(csv.reader(out.open()))


def _evaluate(trained, data, out, nproc):
    args = ["evaluate", "--checkpoint", str(trained), "--data", str(data), "--output-dir", str(out),
            "--batch-size", "8", "--nproc", str(nproc)]
    if nproc == 1:
        assert main(args) == 0
    else:
        proc = run_cli(*args)
        assert proc.returncode == 0, proc.stderr
    return json.loads((out / "metrics.json").read_text())


# 1 input: ranks with nothing to score; 19 (prime): uneven shards, and on 2 processes two batches of 8 each.
@pytest.mark.parametrize("n", [1, 19])
def test_predictions_and_accuracy_identical_on_1_2_3_processes(trained, tmp_path, mnist, n):
    data = _npz(tmp_path, mnist, n)
    rows = {p: _predict(trained, data, tmp_path / f"pred{p}.csv", p) for p in (1, 2, 3)}
    reports = {p: _evaluate(trained, data, tmp_path / f"eval{p}", p) for p in (1, 2, 3)}
    assert rows[1][0] == ["index", "label"] and [r[0] for r in rows[1][1:]] == [str(i) for i in range(n)]
    assert rows[1] == rows[2] == rows[3]
    for p in (2, 3):
        assert reports[p]["samples"] == n and reports[p]["world_size"] == p
        assert reports[p]["accuracy"] == reports[1]["accuracy"]
        assert reports[p]["confusion_matrix"] == reports[1]["confusion_matrix"]
        assert reports[p]["loss"] == pytest.approx(reports[1]["loss"], rel=1e-5)
    predicted = [int(r[1]) for r in rows[1][1:]]
    truth = mnist.labels[600:600 + n].tolist()
    assert reports[1]["accuracy"] == sum(a == b for a, b in zip(predicted, truth)) / n


def test_kaggle_submission_rows_ids_and_known_labels(trained, tmp_path, mnist):
    folder = tmp_path / "digit-recognizer"
    folder.mkdir()
    images, labels = mnist.images[700:743, 0].flatten(1).tolist(), mnist.labels[700:743].tolist()
    (folder / "test.csv").write_text(HEADER + "\n" + "\n".join(",".join(map(str, r)) for r in images) + "\n")
    (folder / "sample_submission.csv").write_text("ImageId,Label\n" + "".join(f"{i},0\n" for i in range(1, 44)))
    rows = _predict(trained, folder, tmp_path / "submission.csv", 2, "--top-k", "2", "--probabilities", "--logits")
    assert rows[0][:3] == ["ImageId", "Label", "Label_2"] and len(rows[0]) == 23
    assert rows[0][13:] == [f"logit_{c}" for c in range(10)]
    assert [r[0] for r in rows[1:]] == [str(i) for i in range(1, 44)]
    assert all(abs(sum(float(p) for p in r[3:13]) - 1) < 1e-4 for r in rows[1:])
    logits = torch.tensor([[float(v) for v in r[13:]] for r in rows[1:]])
    assert logits.argmax(1).tolist() == [int(r[1]) for r in rows[1:]]
    probabilities = torch.tensor([[float(p) for p in r[3:13]] for r in rows[1:]])
    assert torch.allclose(logits.softmax(1), probabilities, atol=1e-5)
    # The same images with their labels, evaluated: the submission's accuracy against the known labels agrees.
    npz = tmp_path / "labelled.npz"
    np.savez(npz, images=mnist.images[700:743, 0].numpy(), labels=np.array(labels))
    report = _evaluate(trained, npz, tmp_path / "eval", 1)
    assert sum(int(r[1]) == y for r, y in zip(rows[1:], labels)) / 43 == report["accuracy"]
    (folder / "train.csv").write_text("label," + HEADER + "\n" + "".join(
        f"{y}," + ",".join(map(str, r)) + "\n" for r, y in zip(images[:5], labels[:5])))
    other = _predict(trained, folder / "train.csv", tmp_path / "train_pred.csv", 1)
    assert [r[0] for r in other[1:]] == ["1", "2", "3", "4", "5"], "test.csv's sample_submission was applied"
    (folder / "sample_submission.csv").write_text("ImageId,Label\n1,0\n2,0\n")
    proc = run_cli("predict", "--checkpoint", str(trained), "--data", str(folder), "--output",
                   str(tmp_path / "other.csv"))
    assert proc.returncode == 2 and "ImageIds do not match" in proc.stderr
    assert not (tmp_path / "other.csv").exists()


def test_evaluate_writes_matrix_csv_png_and_json(trained, tmp_path, small_npz):
    report = _evaluate(trained, small_npz, tmp_path / "ev", 1)
    assert report["samples"] == 501 and len(report["confusion_matrix"]) == 10
    assert sum(map(sum, report["confusion_matrix"])) == 501
    assert (tmp_path / "ev" / "confusion_matrix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    matrix = list(csv.reader((tmp_path / "ev" / "confusion_matrix.csv").open()))
    assert len(matrix) == 11 and [int(v) for v in matrix[1][1:]] == report["confusion_matrix"][0]


def test_weights_round_trip(trained, small_npz, mnist):
    ckpt = load_checkpoint(str(trained))
    weights, meta = load_weights(trained / "best.safetensors")
    assert meta["model"] == "tinycnn" and meta["classes"] == [str(i) for i in range(10)]
    assert all(torch.equal(ckpt.model.state_dict()[k], v) for k, v in weights.items())
    out = trained.parent / "roundtrip.safetensors"
    save_weights(out, ckpt.model.state_dict(), meta)
    again = load_checkpoint(str(out))
    assert all(torch.equal(again.model.state_dict()[k], v) for k, v in weights.items())


def test_pretrained_with_a_mismatched_head_and_frozen_backbone(trained, tmp_path, mnist):
    three = tmp_path / "three.npz"
    keep = (mnist.labels < 3).nonzero().flatten()[:150]
    np.savez(three, images=mnist.images[keep, 0].numpy(), labels=mnist.labels[keep].numpy())
    torch_file = tmp_path / "weights.pt"
    torch.save({"state_dict": {f"module.{k}": v for k, v in load_file(trained / "best.safetensors").items()}},
               torch_file)
    run = tmp_path / "ft"
    assert main(["train", "--data", str(three), "--model", "tinycnn", "--epochs", "1", "--pretrained",
                 str(torch_file), "--freeze", "backbone", "--output-dir", str(run)]) == 0
    skipped = (run / "pretrained_skipped.txt").read_text().splitlines()
    assert sorted(skipped) == ["head.1.bias: shape (10,) in file, (3,) in model",
                               "head.1.weight: shape (10, 32) in file, (3, 32) in model"]
    before, after = load_file(trained / "best.safetensors"), load_file(run / "last.safetensors")
    assert torch.equal(after["features.0.weight"], before["features.0.weight"]), "frozen backbone moved"
    assert after["head.1.weight"].shape == (3, 32)


def test_crafted_pickle_is_refused_without_running_it(tmp_path, capsys):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = tmp_path / "evil.pt"
    evil.write_bytes(pickle.dumps({"state_dict": Exploit()}))
    code = main(["train", "--pretrained", str(evil), "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "refused or unreadable torch file" in err and len(err.strip().splitlines()) == 1
    assert not marker.exists()


@pytest.mark.parametrize("case", ["missing", "corrupt", "architecture", "empty", "unwritable", "not_ours"])
def test_bad_checkpoint_input_and_output(trained, tmp_path, mnist, capsys, case):
    ckpt, data, out = str(trained), str(_npz(tmp_path, mnist, 5)), tmp_path / "out.csv"
    expected = {"missing": "no such file or folder", "corrupt": "not a readable safetensors file",
                "architecture": "weights do not fit model 'smallcnn'", "empty": "holds no images",
                "unwritable": "does not exist", "not_ours": "not a scaletrain checkpoint"}[case]
    if case == "missing":
        ckpt = str(tmp_path / "nothing")
    elif case == "corrupt":
        ckpt = str(tmp_path / "cut.safetensors")
        (tmp_path / "cut.safetensors").write_bytes((trained / "best.safetensors").read_bytes()[:500])
    elif case in ("architecture", "not_ours"):
        weights, meta = load_weights(trained / "best.safetensors")
        meta = {**meta, "model": "smallcnn"} if case == "architecture" else {}
        ckpt = str(tmp_path / "other.safetensors")
        save_weights(tmp_path / "other.safetensors", weights, meta)
    elif case == "empty":
        data = str(tmp_path / "empty.npz")
        np.savez(data, images=np.zeros((0, 28, 28), np.uint8))
    elif case == "unwritable":
        out = tmp_path / "no" / "such" / "dir" / "out.csv"
    code = main(["predict", "--checkpoint", ckpt, "--data", data, "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_images_of_another_size_and_channels_are_converted(trained, tmp_path, mnist):
    rgb = np.repeat(mnist.images[600:607, 0].numpy()[..., None], 3, axis=-1)
    big = torch.nn.functional.interpolate(torch.from_numpy(rgb).permute(0, 3, 1, 2).float(), size=(40, 40))
    path = tmp_path / "rgb40.npz"
    np.savez(path, images=big.round().clamp(0, 255).byte().permute(0, 2, 3, 1).numpy())
    rows = _predict(trained, path, tmp_path / "p.csv", 1)
    assert len(rows) == 8


def test_predict_on_a_plain_folder_of_images(trained, tmp_path, mnist):
    from PIL import Image

    folder = tmp_path / "inbox"
    folder.mkdir()
    for i in range(3):  # no class subfolders: just images to label
        Image.fromarray(mnist.images[600 + i, 0].numpy()).save(folder / f"digit{i}.png")
    rows = _predict(trained, folder, tmp_path / "labels.csv", 1)
    assert rows[0] == ["path", "label"] and [r[0] for r in rows[1:]] == ["digit0.png", "digit1.png", "digit2.png"]
    assert all(r[1] in [str(c) for c in range(10)] for r in rows[1:])
