"""Batch regularisation: RandAugment's operations agree with PIL's, each image draws its own; random erasing,
mixup and cutmix do what timm's do; the weight average follows its formula, is validated and saved each epoch,
and a run using all of it resumes bit for bit."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from PIL import Image, ImageEnhance, ImageOps
from safetensors.torch import load_file

import scaletrain
from scaletrain.cli import main
from scaletrain.training.ema import WeightAverage
from scaletrain.data.transforms import Preprocess, to_model_input
from scaletrain.data.regularise import OPS, Regularise, apply_ops, mix, randaugment, random_erasing

from helpers import train_cli


def _photo(seed: int = 0, size: int = 24) -> np.ndarray:
    """A colour image with smooth areas and edges (uint8 H x W x 3)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size]
    base = np.stack([x * 7 + 20, y * 5 + 40, (x + y) * 3 + 10], -1).astype(float)
    return np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)


def _ours(image: np.ndarray, name: str, level: float, sign: float = 1.0) -> np.ndarray:
    x = torch.from_numpy(image).permute(2, 0, 1)[None].float() / 255
    out = apply_ops(x, torch.tensor([OPS.index(name)]), torch.tensor([level]), torch.tensor([sign]),
                    torch.full((1, 3, 1, 1), 0.5))
    return out[0].permute(1, 2, 0).numpy() * 255


PIL_OPS = {  # (operation, level, sign) -> what PIL gives
    ("brightness", 0.6, 1): lambda im: ImageEnhance.Brightness(im).enhance(1.54),
    ("brightness", 0.6, -1): lambda im: ImageEnhance.Brightness(im).enhance(0.46),
    ("color", 0.9, 1): lambda im: ImageEnhance.Color(im).enhance(1.81),
    ("contrast", 0.5, -1): lambda im: ImageEnhance.Contrast(im).enhance(0.55),
    ("sharpness", 1.0, 1): lambda im: ImageEnhance.Sharpness(im).enhance(1.9),
    ("posterize", 0.5, 1): lambda im: ImageOps.posterize(im, 6),
    ("solarize", 0.5, 1): lambda im: ImageOps.solarize(im, 128),
    ("autocontrast", 0.0, 1): ImageOps.autocontrast,
    ("equalize", 0.0, 1): ImageOps.equalize,
}


@pytest.mark.parametrize("case", list(PIL_OPS), ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}")
def test_each_colour_operation_matches_pil(case):
    image = _photo()
    expected = np.asarray(PIL_OPS[case](Image.fromarray(image)), dtype=float)
    # PIL rounds its grey image and its blends to whole levels: at most 2 levels apart
    assert np.abs(_ours(image, *case) - expected).max() <= 2.0


def test_a_translation_moves_the_image_and_fills_what_it_uncovers():
    image = _photo(size=20)
    out = _ours(image, "translate_x", 1.0, 1.0)  # 45 % of 20 px: 9 px
    assert np.allclose(out[:, :11], image[:, 9:].astype(float), atol=1e-3)
    assert np.allclose(out[:, 11:], 127.5, atol=1e-3)
    assert np.allclose(_ours(image, "rotate", 0.0), image, atol=1e-3)


def test_every_image_draws_its_own_operations_and_the_same_seed_draws_the_same():
    x = torch.from_numpy(_photo()).permute(2, 0, 1)[None].float().div(255).repeat(64, 1, 1, 1)
    fill = torch.full((1, 3, 1, 1), 0.5)
    a = randaugment(x, 2, 9, torch.Generator().manual_seed(3), fill)
    b = randaugment(x, 2, 9, torch.Generator().manual_seed(3), fill)
    assert torch.equal(a, b)
    assert len({tuple(img.flatten()[:200].tolist()) for img in a}) > 30  # one image, many different results
    assert a.min() >= 0 and a.max() <= 1
    trivial = randaugment(x, 1, -1, torch.Generator().manual_seed(3), fill)
    assert not torch.equal(trivial, a)


def test_random_erasing_puts_one_rectangle_of_noise_in_each_chosen_image():
    x = torch.zeros(200, 3, 32, 32)
    out = random_erasing(x, 0.5, torch.Generator().manual_seed(0))
    changed = (out != 0).any(1)  # N x H x W
    erased = changed.flatten(1).any(1)
    assert 60 < erased.sum() < 140  # about half
    for mask in changed[erased]:
        rows, cols = mask.any(1).nonzero().flatten(), mask.any(0).nonzero().flatten()
        box = mask[rows.min():rows.max() + 1, cols.min():cols.max() + 1]
        assert box.float().mean() > 0.99  # one filled rectangle
        assert 0.015 <= box.numel() / (32 * 32) <= 0.36  # 2 % to 1/3, sides rounded to whole pixels
    assert torch.equal(random_erasing(x, 0.0, torch.Generator().manual_seed(0)), x)


def test_mixup_blends_images_and_targets_by_the_same_weight():
    x, y = torch.rand(8, 1, 6, 6), torch.arange(8) % 4
    reg = Regularise(mixup=0.8, num_classes=4)
    mixed, targets = mix(x, y, reg, np.random.default_rng(0))
    lam = targets[0, y[0]].item() if y[0] != y[-1] else None
    assert torch.allclose(targets.sum(1), torch.ones(8))
    assert lam is not None and torch.allclose(mixed, lam * x + (1 - lam) * x.flip(0), atol=1e-6)


def test_cutmix_pastes_a_box_whose_area_sets_the_targets():
    x, y = torch.zeros(4, 1, 20, 20), torch.tensor([0, 1, 2, 3])
    x[3] = 1.0  # the last image, reversed onto the first
    reg = Regularise(cutmix=1.0, num_classes=4)
    for seed in range(5):
        mixed, targets = mix(x, y, reg, np.random.default_rng(seed))
        pasted = mixed[0].mean().item()
        assert targets[0, 3].item() == pytest.approx(pasted, abs=1e-6)
        assert targets[0, 0].item() == pytest.approx(1 - pasted, abs=1e-6)


def test_mix_prob_zero_leaves_the_batch_and_its_labels_alone():
    x, y = torch.rand(4, 1, 5, 5), torch.arange(4)
    out, labels = mix(x, y, Regularise(mixup=1.0, mix_prob=0.0, num_classes=4), np.random.default_rng(0))
    assert out is x and labels is y


def test_the_recipe_off_gives_the_plain_input():
    x = torch.randint(0, 256, (4, 1, 28, 28), dtype=torch.uint8)
    pre = Preprocess(1, 28, [0.1], [0.3])
    plain = to_model_input(x, pre, False)
    assert torch.equal(to_model_input(x, pre, False, (), None, None), plain)


def test_the_weight_average_follows_its_formula():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    ema = WeightAverage(model, 0.9)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model.train()(torch.randn(5, 3))  # moves the running statistics, counts a batch
    ema.update()
    now, avg = model.state_dict(), ema.state_dict()
    for k in start:
        if start[k].is_floating_point():
            assert torch.allclose(avg[k], 0.9 * start[k] + 0.1 * now[k])
        else:
            assert torch.equal(avg[k], now[k])


@pytest.mark.parametrize("flags, message", [
    (["--randaugment", "2"], "--randaugment must be 'N,M'"),
    (["--randaugment", "2,11"], "--randaugment must be 'N,M'"),
    (["--random-erasing", "1.5"], "--random-erasing must be a probability"),
    (["--mixup", "-1"], "--mixup must be a Beta alpha"),
    (["--ema-decay", "1"], "--ema-decay must be in [0, 1)"),
])
def test_bad_values_are_refused_by_flag(flags, message, capsys, tmp_path):
    assert main(["train", *flags, "--output-dir", str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "never").exists()


ALL = ["--model", "tinycnn", "--batch-size", "16", "--randaugment", "2,9", "--random-erasing", "0.25",
       "--mixup", "0.8", "--cutmix", "1.0", "--label-smoothing", "0.1", "--ema-decay", "0.9"]


@pytest.fixture(scope="module")
def regularised(tmp_path_factory, small_npz):
    """A 2-epoch run with every regulariser and the weight average; and the same run killed mid-epoch 2, then
    resumed by the same command."""
    root = tmp_path_factory.mktemp("regularised")
    train_cli(small_npz, root / "whole", *ALL, "--epochs", "2")
    train_cli(small_npz, root / "resumed", *ALL, "--epochs", "2", "--checkpoint-every", "5",
              env={"SCALETRAIN_FAULT": "kill:33"}, expect=-9)
    train_cli(small_npz, root / "resumed", *ALL, "--epochs", "2", "--checkpoint-every", "5")
    return root


@pytest.mark.slow
def test_a_regularised_run_resumes_bitwise_weights_and_average(regularised):
    for name in ("last.safetensors", "last_ema.safetensors", "best_ema.safetensors"):
        a, b = load_file(regularised / "whole" / name), load_file(regularised / "resumed" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


@pytest.mark.slow
def test_the_average_is_validated_each_epoch_and_its_best_weights_evaluate_as_logged(regularised, small_npz,
                                                                                    tmp_path):
    run = regularised / "whole"
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    assert len(rows) == 2 and all(0 <= float(r["ema_val_accuracy"]) <= 1 for r in rows)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["best_ema_val_accuracy"] == max(float(r["ema_val_accuracy"]) for r in rows)
    out = tmp_path / "eval"
    assert main(["evaluate", "--checkpoint", str(run / "best_ema.safetensors"), "--data", str(small_npz),
                 "--split", "val", "--output-dir", str(out)]) == 0
    evaluated = json.loads((out / "metrics.json").read_text())
    assert evaluated["accuracy"] == pytest.approx(summary["best_ema_val_accuracy"], abs=1e-9)


def test_fit_refuses_regularisers_for_a_dataset_of_ready_tensors():
    data = torch.utils.data.TensorDataset(torch.rand(8, 1, 8, 8), torch.arange(8) % 2)
    cfg = scaletrain.TrainConfig()
    cfg.data.mixup, cfg.optim.epochs, cfg.run.output_dir = 0.5, 1, ""
    with pytest.raises(ValueError, match="--mixup"):
        scaletrain.fit(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 2)), data, data, cfg)
