"""`scaletrain prepare` and the paths that read without holding the dataset: every way of reading the same photos
(decoded in memory, streamed from the files, prepared shards held or streamed) trains to the same
bits, resumes mid-epoch to the same bits, and every damaged or missing piece is refused on one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.torch import load_file

from scaletrain.cli import main
from helpers import train_cli
from test_folder_cache import _photo

COMMON = ["--model", "tinycnn", "--image-size", "32", "--epochs", "2", "--batch-size", "8", "--num-workers", "1"]


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """40 colour JPEGs of 96 x 72 px, train/ and val/ with three classes."""
    root = tmp_path_factory.mktemp("photos") / "photos"
    for i in range(40):
        folder = root / ("val" if i % 5 == 0 else "train") / f"class_{i % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        _photo(i).save(folder / f"{i:03d}.jpg", quality=90)
    return root


@pytest.fixture(scope="module")
def prepared(photos, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "ds"
    assert main(["prepare", "--data", str(photos), "--image-size", "32", "--output", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def reference(photos, tmp_path_factory):
    """Trained from the folder, decoded in memory."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert main(["train", "--data", str(photos), *COMMON, "--output-dir", str(out)]) == 0
    return load_file(str(out / "last.safetensors"))


def _same(out, reference) -> bool:
    got = load_file(str(out / "last.safetensors"))
    return got.keys() == reference.keys() and all(got[k].equal(reference[k]) for k in got)


def test_prepare_writes_checksummed_shards_of_the_photo_recipe(prepared):
    manifest = json.loads((prepared / "prepared.json").read_text())
    assert manifest["recipe"] == "photo" and manifest["size"] == 36 and manifest["channels"] == 3
    assert manifest["splits"]["train"]["count"] == 32 and manifest["splits"]["val"]["count"] == 8
    shard = manifest["splits"]["train"]["shards"][0]
    assert np.load(prepared / shard["file"]).shape == (32, 3, 36, 36) and len(shard["sha256"]) == 64


@pytest.mark.parametrize("source, on_device", [("folder", "no"), ("prepared", "yes"), ("prepared", "no")])
def test_every_way_of_reading_trains_to_the_same_bits(photos, prepared, reference, tmp_path, source, on_device):
    data = photos if source == "folder" else prepared
    out = tmp_path / "run"
    assert main(["train", "--data", str(data), *COMMON, "--data-on-device", on_device, "--output-dir",
                 str(out)]) == 0
    assert _same(out, reference)


def test_evaluate_on_a_prepared_split_gives_the_validation_figures(prepared, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--data", str(prepared), *COMMON, "--output-dir", str(out)]) == 0
    val_loss = float(capsys.readouterr().out.rsplit("val_loss ", 1)[1].split()[0])
    assert main(["evaluate", "--checkpoint", str(out / "last.safetensors"), "--data", str(prepared), "--split",
                 "val"]) == 0
    assert f"loss {val_loss:.4f}" in capsys.readouterr().out


STREAMED = [*COMMON, "--data-on-device", "no"]


@pytest.fixture(scope="module")
def streamed_reference(prepared, tmp_path_factory):
    """An uninterrupted streamed run, in a fresh process as the resumed ones (same threads, same bits)."""
    out = tmp_path_factory.mktemp("streamed") / "run"
    train_cli(prepared, out, *STREAMED)
    return load_file(str(out / "last.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["term:2", "term:3"])  # mid-epoch; at the epoch's last batch (step 4 of 4)
def test_a_streamed_prepared_run_stopped_mid_epoch_resumes_to_the_same_bits(prepared, streamed_reference, tmp_path,
                                                                            fault):
    args = STREAMED
    out = tmp_path / "run"
    stopped = train_cli(prepared, out, *args, env={"SCALETRAIN_FAULT": fault}, expect=75)
    assert "run the same command again to resume" in stopped.stderr
    resumed = train_cli(prepared, out, *args)
    assert "resuming from" in resumed.stdout and "could not write" not in resumed.stderr
    assert _same(out, streamed_reference)


# -- refused on one line ---------------------------------------------------------------------------------------
def _refused(capsys, *argv: str) -> str:
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_a_damaged_shard_is_refused_by_name(prepared, tmp_path, capsys):
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in prepared.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    shard = copy / "train-00000.npy"
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 0xFF
    shard.write_bytes(bytes(raw))
    err = _refused(capsys, "train", "--data", str(copy), *COMMON, "--output-dir", str(tmp_path / "run"))
    assert "train-00000.npy: damaged shard" in err
    assert not (tmp_path / "run").exists()


def test_a_shard_verified_once_is_not_hashed_again_until_it_changes(prepared, tmp_path, monkeypatch):
    from scaletrain.data.sources import prepared as module

    copy = tmp_path / "copy"
    copy.mkdir()
    for f in prepared.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    hashed = []
    real = module.sha256_file
    monkeypatch.setattr(module, "sha256_file", lambda path: hashed.append(path.name) or real(path))
    for _ in range(2):
        module.open_prepared(str(copy), str(tmp_path / "cache"))
    assert sorted(hashed) == sorted(p.name for p in copy.glob("*.npy"))  # each once, by the first open
    shard = copy / "val-00000.npy"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(module.UserError, match="val-00000.npy: damaged shard"):
        module.open_prepared(str(copy), str(tmp_path / "cache"))


def test_shards_without_their_manifest_are_named_as_an_unfinished_prepare(prepared, tmp_path, capsys):
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "train-00000.npy").write_bytes((prepared / "train-00000.npy").read_bytes())
    err = _refused(capsys, "train", "--data", str(copy), *COMMON, "--output-dir", str(tmp_path / "run"))
    assert "no prepared.json" in err


def test_prepare_leaves_an_existing_folder_alone(photos, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    err = _refused(capsys, "prepare", "--data", str(photos), "--output", str(tmp_path / "out"))
    assert "not an empty folder" in err and (tmp_path / "out" / "keep.txt").read_text() == "mine"


@pytest.mark.slow
def test_two_processes_read_the_prepared_shards_and_validate_every_sample_once(prepared, tmp_path, capsys):
    out = tmp_path / "run"
    proc = train_cli(prepared, out, *COMMON, "--nproc", "2", "--data-on-device", "no")
    val_loss = float(proc.stdout.rsplit("val_loss ", 1)[1].split()[0])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["val_samples"] == 8
    assert not (out / ".job").exists()  # the launcher's job folder is gone
    assert main(["evaluate", "--checkpoint", str(out / "last.safetensors"), "--data", str(prepared), "--split",
                 "val"]) == 0
    assert f"loss {val_loss:.4f}" in capsys.readouterr().out
