"""predict and evaluate: exact across process counts; checkpoints and pretrained weights in and out."""

from __future__ import annotations

import csv
import gzip
import json
import os
import pickle

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import write_npz
from helpers import run_cli
from scaletrain.cli import main
from scaletrain.inference.checkpoint import load_checkpoint
from scaletrain.runfolder import load_weights, save_weights

HEADER = ",".join(f"pixel{i}" for i in range(784))
# Digits the model below never trained on (it trains on 1000..3000 and validates on 3000..3200).
FIRST, COUNT = 600, 40


@pytest.fixture(scope="module")
def trained(tmp_path_factory, mnist):
    """A tinycnn that tells digits apart (>= 90 % on digits it never saw), so that equal predictions mean
    something: a model that answers "9" to everything would agree with itself on any input."""
    root = tmp_path_factory.mktemp("trained")
    data = write_npz(root / "digits.npz", mnist, 2000, 200, offset=1000)
    run = root / "run"
    assert main(["train", "--data", str(data), "--model", "tinycnn", "--epochs", "2", "--batch-size", "32",
                 "--log-every", "1000", "--output-dir", str(run)]) == 0
    accuracy = json.loads((run / "summary.json").read_text())["best_val_accuracy"]
    assert accuracy >= 0.9, f"the fixture model reached only {accuracy:.3f}"
    return run


def _npz(tmp_path, mnist, n, first=FIRST):
    path = tmp_path / f"set{n}.npz"
    np.savez(path, images=mnist.images[first:first + n, 0].numpy(), labels=mnist.labels[first:first + n].numpy())
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


def _scores(trained, data, out):
    """Labels and logits predict writes for `data`, in input order (one process)."""
    rows = _predict(trained, data, out, 1, "--logits")
    assert rows[0][2:] == [f"logit_{c}" for c in range(10)]
    return [r[1] for r in rows[1:]], torch.tensor([[float(v) for v in r[2:]] for r in rows[1:]])


def _evaluate(trained, data, out, nproc):
    args = ["evaluate", "--checkpoint", str(trained), "--data", str(data), "--output-dir", str(out),
            "--batch-size", "8", "--nproc", str(nproc)]
    if nproc == 1:
        assert main(args) == 0
    else:
        proc = run_cli(*args)
        assert proc.returncode == 0, proc.stderr
    return json.loads((out / "metrics.json").read_text())


def _kaggle_folder(folder, mnist, first, n):
    """A Kaggle digit-recognizer folder: test.csv of n digits from `first` on, and its sample_submission.csv."""
    folder.mkdir()
    pixels = mnist.images[first:first + n, 0].flatten(1).tolist()
    (folder / "test.csv").write_text(HEADER + "\n" + "\n".join(",".join(map(str, r)) for r in pixels) + "\n")
    (folder / "sample_submission.csv").write_text("ImageId,Label\n" + "".join(f"{i},0\n" for i in range(1, n + 1)))
    return folder


# -- the same answers on 1, 2 and 3 processes ------------------------------------------------------------------
# 1 input on 2 processes: a rank with nothing to score; 19 (prime) on 2 and 3: uneven shards, and on 2 processes
# two batches of 8 each.
@pytest.fixture(scope="module", params=[(1, (1, 2)), (19, (1, 2, 3))], ids=["1-input", "19-inputs"])
def on_1_2_3_processes(request, trained, tmp_path_factory, mnist):
    """predict and evaluate of the same n inputs on each of the given process counts."""
    n, counts = request.param
    tmp = tmp_path_factory.mktemp(f"nproc-{n}")
    data = _npz(tmp, mnist, n)
    rows = {p: _predict(trained, data, tmp / f"pred{p}.csv", p) for p in counts}
    reports = {p: _evaluate(trained, data, tmp / f"eval{p}", p) for p in counts}
    return n, rows, reports


@pytest.mark.slow
def test_predict_writes_one_row_per_input_in_input_order(on_1_2_3_processes):
    n, rows, _ = on_1_2_3_processes
    assert rows[1][0] == ["index", "label"]
    assert [r[0] for r in rows[1][1:]] == [str(i) for i in range(n)]


@pytest.mark.slow
def test_predictions_are_identical_on_1_2_and_3_processes(on_1_2_3_processes):
    _, rows, _ = on_1_2_3_processes
    assert len(rows) >= 2 and all(rows[p] == rows[1] for p in rows)


@pytest.mark.slow
def test_evaluate_scores_every_input_once_on_any_process_count(on_1_2_3_processes):
    n, _, reports = on_1_2_3_processes
    assert [(reports[p]["samples"], reports[p]["world_size"]) for p in reports] == [(n, p) for p in reports]
    assert [sum(map(sum, reports[p]["confusion_matrix"])) for p in reports] == [n] * len(reports)


@pytest.mark.slow
def test_evaluate_on_more_processes_reports_the_accuracy_confusion_and_loss_of_one(on_1_2_3_processes):
    _, _, reports = on_1_2_3_processes
    more = [p for p in reports if p > 1]
    assert more
    assert [reports[p]["accuracy"] for p in more] == [reports[1]["accuracy"]] * len(more)
    assert [reports[p]["confusion_matrix"] for p in more] == [reports[1]["confusion_matrix"]] * len(more)
    assert [reports[p]["loss"] for p in more] == pytest.approx([reports[1]["loss"]] * len(more), rel=1e-5)


@pytest.mark.slow
def test_evaluated_accuracy_is_the_share_of_correct_predictions(on_1_2_3_processes, mnist):
    n, rows, reports = on_1_2_3_processes
    predicted = [int(r[1]) for r in rows[1][1:]]
    truth = mnist.labels[FIRST:FIRST + n].tolist()
    assert reports[1]["accuracy"] == sum(a == b for a, b in zip(predicted, truth)) / n


# -- a Kaggle submission ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def submission(trained, tmp_path_factory, mnist):
    """A submission for a 43-digit test.csv, written by 2 processes with the top 2 labels, probabilities, logits."""
    tmp = tmp_path_factory.mktemp("kaggle")
    folder = _kaggle_folder(tmp / "digit-recognizer", mnist, 700, 43)
    return _predict(trained, folder, tmp / "submission.csv", 2, "--top-k", "2", "--probabilities", "--logits")


def _columns(rows, first, last):
    return torch.tensor([[float(v) for v in r[first:last]] for r in rows[1:]])


@pytest.mark.slow
def test_submission_header_names_the_top_labels_probabilities_and_logits(submission):
    assert submission[0] == (["ImageId", "Label", "Label_2"] + [f"p_{c}" for c in range(10)]
                             + [f"logit_{c}" for c in range(10)])


@pytest.mark.slow
def test_submission_numbers_image_ids_from_1_as_kaggle_does(submission):
    assert [r[0] for r in submission[1:]] == [str(i) for i in range(1, 44)]


@pytest.mark.slow
def test_submission_probabilities_are_the_softmax_of_its_logits(submission):
    probabilities, logits = _columns(submission, 3, 13), _columns(submission, 13, 23)
    assert torch.allclose(probabilities.sum(1), torch.ones(43), atol=1e-4)
    assert torch.allclose(logits.softmax(1), probabilities, atol=1e-5)


@pytest.mark.slow
def test_submission_labels_are_the_two_largest_logits(submission):
    top2 = _columns(submission, 13, 23).topk(2, dim=1).indices
    assert [[int(r[1]), int(r[2])] for r in submission[1:]] == top2.tolist()
    assert len({r[1] for r in submission[1:]}) >= 5, "the model gives (almost) one answer to every digit"


@pytest.mark.slow
def test_submission_accuracy_agrees_with_evaluate_on_the_labelled_images(submission, trained, tmp_path, mnist):
    labels = mnist.labels[700:743].tolist()
    npz = tmp_path / "labelled.npz"
    np.savez(npz, images=mnist.images[700:743, 0].numpy(), labels=np.array(labels))
    report = _evaluate(trained, npz, tmp_path / "eval", 1)
    assert sum(int(r[1]) == y for r, y in zip(submission[1:], labels)) / 43 == report["accuracy"] >= 0.8


def test_another_csv_in_a_kaggle_folder_is_numbered_on_its_own(trained, tmp_path, mnist):
    """sample_submission.csv describes test.csv only: train.csv beside it is predicted with its own row ids."""
    folder = _kaggle_folder(tmp_path / "digit-recognizer", mnist, 700, 43)
    images, labels = mnist.images[700:705, 0].flatten(1).tolist(), mnist.labels[700:705].tolist()
    (folder / "train.csv").write_text("label," + HEADER + "\n" + "".join(
        f"{y}," + ",".join(map(str, r)) + "\n" for r, y in zip(images, labels)))
    rows = _predict(trained, folder / "train.csv", tmp_path / "train_pred.csv", 1)
    assert [r[0] for r in rows[1:]] == ["1", "2", "3", "4", "5"]


def test_a_sample_submission_with_other_ids_is_refused_before_writing(trained, tmp_path, mnist, capsys):
    folder = _kaggle_folder(tmp_path / "digit-recognizer", mnist, 700, 43)
    (folder / "sample_submission.csv").write_text("ImageId,Label\n1,0\n2,0\n")
    out = tmp_path / "other.csv"
    assert main(["predict", "--checkpoint", str(trained), "--data", str(folder), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "2 ImageIds do not match the 43 rows of test.csv" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


# -- evaluate's files ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def evaluation(trained, tmp_path_factory, small_npz):
    out = tmp_path_factory.mktemp("evaluate") / "ev"
    return out, _evaluate(trained, small_npz, out, 1)


def test_evaluate_counts_every_sample_in_a_10_by_10_confusion_matrix(evaluation):
    _, report = evaluation
    assert report["samples"] == 501 and len(report["confusion_matrix"]) == 10
    assert [len(row) for row in report["confusion_matrix"]] == [10] * 10
    assert sum(map(sum, report["confusion_matrix"])) == 501


def test_evaluated_accuracy_is_the_diagonal_share_of_the_confusion_matrix(evaluation):
    _, report = evaluation
    matrix = report["confusion_matrix"]
    assert report["accuracy"] == sum(matrix[i][i] for i in range(10)) / 501 >= 0.9


def test_confusion_matrix_csv_holds_the_json_matrix_under_class_headers(evaluation):
    out, report = evaluation
    matrix = list(csv.reader((out / "confusion_matrix.csv").open()))
    assert matrix[0][1:] == [str(c) for c in range(10)]
    assert [r[0] for r in matrix[1:]] == [str(c) for c in range(10)]
    assert [[int(v) for v in r[1:]] for r in matrix[1:]] == report["confusion_matrix"]


def test_evaluate_draws_the_confusion_matrix_as_a_png(evaluation):
    out, _ = evaluation
    assert (out / "confusion_matrix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- weights in and out ----------------------------------------------------------------------------------------
def test_best_weights_carry_the_model_name_and_classes(trained):
    ckpt = load_checkpoint(str(trained))
    weights, meta = load_weights(trained / "best.safetensors")
    assert meta["model"] == "tinycnn" and meta["classes"] == [str(i) for i in range(10)]
    assert weights.keys() == ckpt.model.state_dict().keys()
    assert all(torch.equal(ckpt.model.state_dict()[k], v) for k, v in weights.items())


def test_weights_saved_again_load_back_unchanged(trained, tmp_path):
    ckpt = load_checkpoint(str(trained))
    weights, meta = load_weights(trained / "best.safetensors")
    out = tmp_path / "roundtrip.safetensors"
    save_weights(out, ckpt.model.state_dict(), meta)
    again = load_checkpoint(str(out))
    assert again.classes == ckpt.classes and again.model_name == "tinycnn"
    assert all(torch.equal(again.model.state_dict()[k], v) for k, v in weights.items())


@pytest.fixture(scope="module")
def finetuned(trained, tmp_path_factory, mnist):
    """The trained 10-class weights, saved as a pickled torch file with DDP's `module.` prefix, fine-tuned with a
    frozen backbone on the digits 0, 1 and 2 only."""
    tmp = tmp_path_factory.mktemp("finetune")
    three = tmp / "three.npz"
    keep = (mnist.labels < 3).nonzero().flatten()[:150]
    np.savez(three, images=mnist.images[keep, 0].numpy(), labels=mnist.labels[keep].numpy())
    torch_file = tmp / "weights.pt"
    torch.save({"state_dict": {f"module.{k}": v for k, v in load_file(trained / "best.safetensors").items()}},
               torch_file)
    run = tmp / "ft"
    assert main(["train", "--data", str(three), "--model", "tinycnn", "--epochs", "1", "--pretrained",
                 str(torch_file), "--freeze", "backbone", "--output-dir", str(run)]) == 0
    return run


def test_pretrained_tensors_of_another_shape_are_skipped_and_listed(finetuned):
    skipped = (finetuned / "pretrained_skipped.txt").read_text().splitlines()
    assert sorted(skipped) == ["head.1.bias: shape (10,) in file, (3,) in model",
                               "head.1.weight: shape (10, 32) in file, (3, 32) in model"]


def test_a_frozen_backbone_keeps_the_pretrained_weights(finetuned, trained):
    """Every tensor of the backbone (convolutions, BatchNorm affine weights and running statistics) is left as
    loaded: its BatchNorm layers normalise by the loaded statistics and do not update them."""
    from scaletrain.models import build_model

    before, after = load_file(trained / "best.safetensors"), load_file(finetuned / "last.safetensors")
    backbone = [k for k in build_model("tinycnn", 1, 3).state_dict() if k.startswith("features.")]
    assert len(backbone) == 18 and any(k.endswith("running_var") for k in backbone)
    assert [k for k in backbone if not torch.equal(after[k], before[k])] == [], "frozen backbone moved"


def test_the_new_head_has_one_row_per_new_class(finetuned):
    after = load_file(finetuned / "last.safetensors")
    assert after["head.1.weight"].shape == (3, 32) and after["head.1.bias"].shape == (3,)


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


# -- the same digits in other formats --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def original(trained, tmp_path_factory, mnist):
    """Labels and logits of 40 unseen 28 x 28 grey digits, read from an .npz file."""
    tmp = tmp_path_factory.mktemp("original")
    return _scores(trained, _npz(tmp, mnist, COUNT), tmp / "original.csv")


def test_the_original_predictions_are_right_and_varied(original, mnist):
    """The yardstick for the conversions below discriminates: mostly right, and not one answer for all."""
    labels, _ = original
    truth = [str(y) for y in mnist.labels[FIRST:FIRST + COUNT].tolist()]
    assert sum(a == b for a, b in zip(labels, truth)) >= 0.85 * COUNT
    assert len(set(labels)) >= 8


def _assert_same_scores(converted, original, atol=1e-4):
    labels, logits = converted
    assert labels == original[0]
    torch.testing.assert_close(logits, original[1], rtol=0, atol=atol)


def test_a_folder_of_png_files_gets_the_logits_of_the_original_images(trained, original, tmp_path, mnist):
    from PIL import Image

    folder = tmp_path / "inbox"
    folder.mkdir()
    for i in range(COUNT):  # no class subfolders: just images to label
        Image.fromarray(mnist.images[FIRST + i, 0].numpy()).save(folder / f"digit{i:02d}.png")
    _assert_same_scores(_scores(trained, folder, tmp_path / "labels.csv"), original)


def test_predict_on_a_plain_folder_names_each_row_by_its_file(trained, tmp_path, mnist):
    from PIL import Image

    folder = tmp_path / "inbox"
    (folder / "more").mkdir(parents=True)
    for i, name in enumerate(["b.png", "a.png", "more/c.png"]):
        Image.fromarray(mnist.images[FIRST + i, 0].numpy()).save(folder / name)
    rows = _predict(trained, folder, tmp_path / "labels.csv", 1)
    assert rows[0] == ["path", "label"]
    assert [r[0] for r in rows[1:]] == ["a.png", "b.png", "more/c.png"]


def test_a_kaggle_test_csv_gets_the_logits_of_the_original_images(trained, original, tmp_path, mnist):
    folder = _kaggle_folder(tmp_path / "digit-recognizer", mnist, FIRST, COUNT)
    _assert_same_scores(_scores(trained, folder, tmp_path / "submission.csv"), original)


def test_an_idx_folder_gets_the_logits_of_the_original_images(trained, original, tmp_path, mnist):
    folder = tmp_path / "idx"
    folder.mkdir()
    for kind, magic, arr in (("images-idx3", 2051, mnist.images[FIRST:FIRST + COUNT, 0].numpy()),
                             ("labels-idx1", 2049, mnist.labels[FIRST:FIRST + COUNT].numpy().astype(np.uint8))):
        header = np.array([magic, *arr.shape], dtype=">u4").tobytes()
        (folder / f"t10k-{kind}-ubyte.gz").write_bytes(gzip.compress(header + arr.tobytes()))
    _assert_same_scores(_scores(trained, folder, tmp_path / "idx.csv"), original)


def _rgb(mnist, scale):
    """The digits as RGB (three equal channels), each pixel repeated scale x scale times."""
    grey = mnist.images[FIRST:FIRST + COUNT, 0]
    big = grey.repeat_interleave(scale, 1).repeat_interleave(scale, 2)
    return np.repeat(big.numpy()[..., None], 3, axis=-1)


def test_rgb_copies_of_grey_digits_get_the_logits_of_the_originals(trained, original, tmp_path, mnist):
    path = tmp_path / "rgb28.npz"
    np.savez(path, images=_rgb(mnist, 1))
    _assert_same_scores(_scores(trained, path, tmp_path / "rgb.csv"), original)


def test_digits_at_twice_the_size_in_rgb_are_resized_to_the_labels_of_the_originals(trained, original, tmp_path,
                                                                                      mnist):
    """56 x 56 RGB is resized back to the model's 28 x 28 grey: not bit for bit, but to the same answers."""
    path = tmp_path / "rgb56.npz"
    np.savez(path, images=_rgb(mnist, 2))
    labels, logits = _scores(trained, path, tmp_path / "rgb56.csv")
    assert sum(a == b for a, b in zip(labels, original[0])) >= COUNT - 2
    # The resized logits stay near the originals: far nearer than the logits of two different digits are.
    assert (logits - original[1]).abs().mean() < 0.25 * (original[1] - original[1].roll(1, 0)).abs().mean()
