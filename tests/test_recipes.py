"""The photo recipe: photos kept with room for the crop, a RandomResizedCrop per sample for training and timm's
center crop for evaluation, chosen by the images; digits keep the digit recipe."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from scaletrain.config import DataConfig
from scaletrain.data import load_image_sets
from scaletrain.errors import UserError
from scaletrain.cli import main
from scaletrain.data.transforms import Preprocess, center_crop, random_resized_crop, to_model_input
from scaletrain.data.images import read_image, stored_side
from test_folder_cache import _photo


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_the_whole_image_at_its_own_size_comes_back_unchanged():
    x = torch.rand(3, 3, 20, 20)
    assert torch.allclose(random_resized_crop(x, 20, (1.0, 1.0), (1.0, 1.0), _gen()), x, atol=1e-6)


def test_each_sample_gets_its_own_box_and_a_seed_gives_the_same_boxes():
    x = torch.rand(1, 3, 40, 40).expand(8, -1, -1, -1).contiguous()
    a = random_resized_crop(x, 16, (0.08, 1.0), (3 / 4, 4 / 3), _gen(1))
    assert a.shape == (8, 3, 16, 16)
    assert len({tuple(s.flatten()[:20].tolist()) for s in a}) == 8  # the same image, eight crops
    assert torch.equal(a, random_resized_crop(x, 16, (0.08, 1.0), (3 / 4, 4 / 3), _gen(1)))
    assert not torch.equal(a, random_resized_crop(x, 16, (0.08, 1.0), (3 / 4, 4 / 3), _gen(2)))


def test_a_crop_stays_inside_the_image_and_covers_the_asked_share_of_it():
    # A bright frame around a dark image: a crop inside the image never sees the frame.
    x = torch.zeros(256, 1, 50, 50)
    x[..., :1, :] = x[..., -1:, :] = x[..., :, :1] = x[..., :, -1:] = 1
    out = random_resized_crop(x[:, :, 1:-1, 1:-1].contiguous(), 12, (0.2, 0.5), (0.75, 1.3333), _gen())
    assert out.max() == 0


def test_evaluation_takes_the_central_crop_pct_as_timm_does():
    x = torch.rand(2, 3, 73, 73)
    assert torch.equal(center_crop(x, 64, 0.875), x[..., 4:68, 4:68])  # 73 * 0.875 = 64, offset round(4.5) = 4
    assert stored_side(224, 0.875) == 256 and stored_side(64, 0.875) == 73


def test_a_photo_is_stored_at_its_shorter_side_keeping_the_aspect_ratio(tmp_path):
    img = np.zeros((60, 120, 3), np.uint8)
    img[:, :30] = 255  # the left quarter white: outside the central square
    img[:, 30:90] = 100
    Image.fromarray(img).save(tmp_path / "wide.png")
    photo, why = read_image(tmp_path / "wide.png", 3, 30, "photo")
    inner = photo[:, :, 1:-1]  # (the filter at the square's edges reaches one pixel over, as a resize then crop does)
    assert why is None and photo.shape == (3, 30, 30) and inner.min() == inner.max() == 100  # central square only
    digits, _ = read_image(tmp_path / "wide.png", 3, 30, "digits")
    assert digits.max() == 255  # the whole image, squashed


def test_training_batches_of_photos_are_cropped_and_evaluation_batches_centered():
    pre = Preprocess(3, 16, [0.5] * 3, [0.25] * 3, "photo")
    x = torch.randint(0, 256, (4, 3, 18, 18), dtype=torch.uint8)
    train = to_model_input(x, pre, False, ("rrc", "hflip"), _gen())
    evaluation = to_model_input(x, pre, False)
    assert train.shape == evaluation.shape == (4, 3, 16, 16)
    expected = (x[..., 1:17, 1:17].float() / 255 - 0.5) / 0.25  # 18 * 0.875 = 15.75 -> 16, offset 1
    assert torch.allclose(evaluation, expected, atol=1e-5)


def test_colour_photos_get_the_photo_recipe_and_digits_the_digit_recipe(tmp_path, mnist):
    photos, digits = tmp_path / "photos", tmp_path / "digits"
    for i in range(12):
        (photos / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        (digits / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        _photo(i).save(photos / f"c{i % 2}" / f"{i}.jpg")
        Image.fromarray(mnist.images[i, 0].numpy()).save(digits / f"c{i % 2}" / f"{i}.png")
    cfg = dict(image_size=32, cache_dir=str(tmp_path / "cache"), val_fraction=0.25)
    assert load_image_sets(DataConfig(data=str(photos), **cfg))[0].recipe == "photo"
    assert load_image_sets(DataConfig(data=str(digits), **cfg))[0].recipe == "digits"
    assert load_image_sets(DataConfig(data=str(photos), recipe="digits", **cfg))[0].recipe == "digits"
    arrays = tmp_path / "rgb.npz"
    np.savez(arrays, images=np.zeros((10, 3, 64, 64), np.uint8), labels=np.arange(10) % 2)
    assert load_image_sets(DataConfig(data=str(arrays), **cfg))[0].recipe == "photo"
    assert load_image_sets("default")[0].recipe == "digits"


def test_a_run_folder_records_the_recipe_it_resolved_to(tmp_path, small_npz):
    out = tmp_path / "run"
    assert main(["train", "--data", str(small_npz), "--model", "tinycnn", "--epochs", "1", "--output-dir",
                 str(out)]) == 0
    text = (out / "config.yaml").read_text()
    assert "recipe: digits" in text and "augment: crop" in text


@pytest.mark.parametrize("flag, value, expected", [
    ("--crop-pct", "0", "--crop-pct must be in (0, 1]"),
    ("--crop-scale", "0.5", "--crop-scale must be two numbers"),
    ("--crop-scale", "0.9,0.1", "--crop-scale must be two fractions"),
    ("--crop-ratio", "0,1", "--crop-ratio must be two positive numbers"),
    ("--recipe", "poster", "argument --recipe: invalid choice"),
])
def test_bad_recipe_settings_are_refused_by_flag(flag, value, expected, capsys, tmp_path):
    code = main(["train", flag, value, "--output-dir", str(tmp_path / "never")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and expected in err and len(err.splitlines()) == 1
    assert not (tmp_path / "never").exists()


def test_user_error_type_is_the_one_raised_for_bad_ranges():
    from scaletrain.config import parse_range

    with pytest.raises(UserError):
        parse_range("--crop-scale", "a,b")


def _jpeg_folder(tmp_path, n: int = 12):
    root = tmp_path / "photos"
    for i in range(n):
        (root / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        _photo(i, 120, 90).save(root / f"c{i % 2}" / f"{i}.jpg", quality=90)
    _photo(n, 120, 90).save(root / "c0" / f"{n}.png")  # not a JPEG: decoded by the worker, as before
    return root


def test_jpegs_decoded_on_the_device_give_the_workers_batches_within_the_decoders_rounding(tmp_path):
    """--decode device through the training's own path (workers read bytes, one batched decode, the stored size,
    the same random crops and flips): torchvision's batched CPU decoder stands in for nvJPEG. Each batch is the
    workers' batch of the same images and crops, within what two JPEG decoders and resamplers differ by."""
    from scaletrain.data.batches import LoaderBatches

    root = _jpeg_folder(tmp_path)
    files, _ = load_image_sets(DataConfig(data=str(root), image_size=32, data_on_device="no", val_fraction=0.2,
                                          cache_dir=str(tmp_path / "cache")))
    assert files.recipe == "photo" and any(p.endswith(".png") for p in files.paths)
    pre = Preprocess(3, 32, [0.5] * 3, [0.25] * 3, "photo")
    common = dict(train=True, rank=0, world=1, seed=3, channels_last=True, augment=("rrc", "hflip"), pre=pre)
    batches = {how: LoaderBatches(files, torch.device("cpu"), 4, num_workers=w, decode_on_device=how == "device",
                                  **common) for how, w in (("device", 2), ("workers", 0))}
    for epoch in (0, 1):
        pairs = list(zip(batches["device"].epoch(epoch), batches["workers"].epoch(epoch)))
        assert len(pairs) == len(batches["device"]) == 3
        for (xd, yd), (xw, yw) in pairs:
            assert torch.equal(yd, yw) and xd.shape == xw.shape == (len(yw), 3, 32, 32) and xd.isfinite().all()
            assert (xd - xw).abs().mean() * 0.25 * 255 < 4  # in pixel levels: close, not the same bits
    other = LoaderBatches(files, torch.device("cpu"), 4, num_workers=0, decode_on_device=True,
                          **{**common, "seed": 4})
    assert (next(other.epoch(0))[0] - pairs[0][0][0]).abs().mean() * 0.25 * 255 > 8  # other crops: far apart
    for b in (*batches.values(), other):
        b.close()


def test_a_jpeg_the_device_decoder_refuses_is_named_on_one_line(tmp_path, capsys, monkeypatch):
    from scaletrain.data import types

    monkeypatch.setattr(types, "WHOLE_SET_BYTES", 0)  # a large folder: its check reads headers, not pixels
    monkeypatch.setattr(types, "STATS_SAMPLES", 1)  # and decodes one image for the statistics
    root = _jpeg_folder(tmp_path)
    bad = sorted(root.rglob("*.jpg"))[-1]
    data = bytearray(bad.read_bytes())
    table = data.find(b"\xff\xc4")
    data[table + 5:table + 25] = b"\xff" * 20  # header and end marker intact: only decoding finds it bad
    bad.write_bytes(data)
    code = main(["train", "--data", str(root), "--model", "tinycnn", "--image-size", "32", "--epochs", "1",
                 "--data-on-device", "no", "--decode", "device", "--num-workers", "1", "--batch-size", "4",
                 "--cache-dir", str(tmp_path / "cache"), "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    assert f"{bad}: cannot decode image on cpu (Bogus Huffman table definition)" in err


def test_a_folders_first_pass_decoded_on_the_device_is_kept_as_that_decoder_made_it(tmp_path, monkeypatch):
    """A folder's first run with --decode device: the first pass's batches are decoded on the device, the set
    held as they were, and the next passes (from memory) give the same batches bit for bit as a run from the
    kept pixels."""
    from scaletrain.data.batches import DeviceBatches, FillingBatches
    from scaletrain.data.types import ImageFiles, ImageSet

    from scaletrain.data import types

    monkeypatch.setattr(types, "WHOLE_SET_BYTES", 0)  # counts as large: the check does not decode it
    files, _ = load_image_sets(DataConfig(data=str(_jpeg_folder(tmp_path, 40)), image_size=32, val_fraction=0.2,
                                          cache_dir=str(tmp_path / "cache")))
    assert isinstance(files, ImageFiles) and files.wanted_in_memory
    pre = Preprocess(3, 32, [0.5] * 3, [0.25] * 3, "photo")
    common = dict(train=True, rank=0, world=1, seed=0, channels_last=False, augment=("rrc", "hflip"))
    filling = FillingBatches(files, pre, torch.device("cpu"), 16, num_workers=1, decode_on_device=True, **common)
    first = list(filling.epoch(0))
    assert filling.memory is not None
    memory = DeviceBatches(ImageSet(filling.pixels.clone(), torch.as_tensor(files.labels), files.classes, "photo"),
                           pre, torch.device("cpu"), 16, **common)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, memory.epoch(0)))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(filling.epoch(1), memory.epoch(1)))


@pytest.mark.slow
def test_training_with_jpegs_decoded_on_the_device_is_repeatable(tmp_path):
    root = tmp_path / "photos"
    for i in range(30):
        (root / f"c{i % 3}").mkdir(parents=True, exist_ok=True)
        _photo(i).save(root / f"c{i % 3}" / f"{i}.jpg", quality=90)
    runs = []
    for k in range(2):
        out = tmp_path / f"run{k}"
        assert main(["train", "--data", str(root), "--model", "tinycnn", "--image-size", "32", "--epochs", "1",
                     "--batch-size", "8", "--data-on-device", "no", "--decode", "device", "--num-workers", "1",
                     "--cache-dir", str(tmp_path / "cache"), "--output-dir", str(out)]) == 0
        runs.append(load_file(str(out / "last.safetensors")))
        assert "decode: device" in (out / "config.yaml").read_text()
    assert all(runs[0][k].equal(runs[1][k]) for k in runs[0])
