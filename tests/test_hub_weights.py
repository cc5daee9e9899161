"""`--pretrained timm`: timm's pretrained weights through the Hugging Face hub's cache, here with no network at all
(HF_HUB_OFFLINE=1 and weights planted in a cache laid out as the hub lays it out)."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file, save_file

from scaletrain.runfolder import load_weights

from helpers import run_cli, train_cli

MODEL = "test_resnet"  # timm's tiny test model, whose default pretrained tag is r160_in1k
COMMON = ["--model", MODEL, "--image-size", "32", "--epochs", "1", "--batch-size", "32", "--pretrained", "timm"]


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A Hugging Face cache holding weights for timm/test_resnet.r160_in1k (random, seeded: ours to recognise)."""
    import timm
    import torch

    torch.manual_seed(7)
    source = timm.create_model(f"{MODEL}.r160_in1k", pretrained=False)
    cache = tmp_path_factory.mktemp("hf") / "hub"
    repo = cache / f"models--timm--{MODEL}.r160_in1k"
    snapshot = repo / "snapshots" / ("0123456789abcdef" * 3)[:40]
    snapshot.mkdir(parents=True)
    weights = {k: v.contiguous() for k, v in source.state_dict().items()}
    save_file(weights, str(snapshot / "model.safetensors"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    return cache, weights


def _env(cache) -> dict:
    return {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(cache.parent)}


@pytest.mark.slow
def test_training_starts_from_the_weights_in_the_cache_offline(hub_cache, small_npz, tmp_path):
    cache, planted = hub_cache
    out = tmp_path / "run"
    train_cli(small_npz, out, *COMMON, "--channels", "3", "--freeze", "backbone", env=_env(cache))
    trained = load_file(str(out / "last.safetensors"))
    convs = [k for k in planted if k.endswith("conv1.weight") and k.startswith("layer")]
    assert convs and all(trained[k].equal(planted[k]) for k in convs)  # frozen backbone: as planted
    assert trained["fc.weight"].shape[0] == 10  # the head made for the data's ten classes
    pre = load_weights(out / "last.safetensors")[1]["preprocess"]
    assert pre["mean"] == [0.5, 0.5, 0.5] and pre["std"] == [0.5, 0.5, 0.5]  # as timm's weights expect


def test_weights_missing_from_the_cache_offline_are_one_line_naming_model_and_cache(small_npz, tmp_path):
    empty = tmp_path / "empty" / "hub"
    empty.mkdir(parents=True)
    proc = train_cli(small_npz, tmp_path / "run", *COMMON, env=_env(empty), expect=2)
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert MODEL in err and str(empty) in err and "HF_HUB_OFFLINE" in err
    assert not (tmp_path / "run").exists()


def test_scaletrains_own_models_have_no_hub_weights(small_npz, tmp_path):
    proc = train_cli(small_npz, tmp_path / "run", "--model", "tinycnn", "--pretrained", "timm", expect=2)
    assert "scaletrain's own model" in proc.stderr


def test_a_timm_model_of_a_fixed_input_size_is_built_for_the_runs_size_and_rebuilt_so_for_predict(small_npz,
                                                                                                  tmp_path):
    """timm's ViT family fixes its input size (position embeddings); --image-size 32 builds test_vit (160 px by
    default) for 32 px, where it used to stop at the first batch with timm's assertion; predict rebuilds it so."""
    run = tmp_path / "run"
    train_cli(small_npz, run, "--model", "test_vit", "--image-size", "32", "--epochs", "1", "--batch-size", "64")
    proc = run_cli("predict", "--checkpoint", str(run), "--data", str(small_npz), "--output", str(tmp_path / "p.csv"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len((tmp_path / "p.csv").read_text().splitlines()) > 100
