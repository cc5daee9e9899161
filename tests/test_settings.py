"""Settings resolved once: the caller's config is never changed, the resolved settings are read-only and typed,
they read back from what the run folder records, and a flag's type comes from the setting's declared type."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import yaml

import scaletrain
from scaletrain.cli import build_parser
from scaletrain.config import (DataConfig, OptimConfig, RunConfig, Settings, TrainConfig, read_config_file, resolve,
                               setting_type, trajectory_changes)
from scaletrain.errors import UserError


def _config(out, **optim) -> TrainConfig:
    cfg = TrainConfig()
    cfg.run.output_dir, cfg.data.num_workers = str(out), 0
    for key, value in {"epochs": 1, "batch_size": 32, **optim}.items():
        setattr(cfg.optim, key, value)
    return cfg


def test_fit_changes_nothing_in_the_callers_config_and_records_what_it_resolved(tmp_path, mnist):
    cfg = _config(tmp_path / "run")
    cfg.data.crop_scale = "0.5,1"  # the flag's text is accepted as well as (0.5, 1.0)
    before = copy.deepcopy(cfg)
    train, val = mnist.subset(torch.arange(96)), mnist.subset(torch.arange(96, 128))
    scaletrain.fit(scaletrain.build_model("tinycnn", 1, 10), train, val, cfg)
    assert cfg == before and cfg.optim.lr is None and cfg.data.augment == "auto" and cfg.data.recipe == "auto"
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["optim"]["lr"] == 0.05 and saved["data"]["recipe"] == "digits" and saved["data"]["augment"] == "crop"
    assert saved["data"]["crop_scale"] == "0.5,1.0" and saved["plan"]["global_batch"] == 32


def test_the_same_config_trains_again_after_a_run(tmp_path, mnist):
    """Nothing a run resolved stays behind in the config: a second run with it resolves afresh."""
    cfg = _config(tmp_path / "a")
    train, val = mnist.subset(torch.arange(64)), mnist.subset(torch.arange(64, 96))
    scaletrain.fit(scaletrain.build_model("tinycnn", 1, 10), train, val, cfg)
    cfg.run.output_dir, cfg.optim.optimizer = str(tmp_path / "b"), "adam"
    scaletrain.fit(scaletrain.build_model("tinycnn", 1, 10), train, val, cfg)
    assert yaml.safe_load((tmp_path / "b" / "config.yaml").read_text())["optim"]["lr"] == 2e-3  # adam's default


def test_resolved_settings_are_read_only_and_a_users_config_is_not():
    cfg = TrainConfig()
    cfg.optim.epochs = 5  # as the API examples do
    settings = resolve(cfg, cfg.plan(1))
    with pytest.raises(dataclasses.FrozenInstanceError, match="OptimConfig.lr: resolved settings are read-only"):
        settings.optim.lr = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.plan = settings.plan  # type: ignore[misc]
    assert settings.optim.epochs == 5 and settings.optim.lr == 0.05 and cfg.optim.lr is None


def test_structured_settings_are_typed_once_resolved():
    cfg = TrainConfig()
    cfg.data.crop_ratio, cfg.data.randaugment, cfg.run.nproc, cfg.run.log_with = "0.5,2", "2,9", "2", "none"
    settings = resolve(cfg, cfg.plan(2), recipe="photo")
    d, r = settings.data, settings.run
    assert (d.crop_scale, d.crop_ratio, d.randaugment, d.augment) == ((0.08, 1.0), (0.5, 2.0), (2, 9), ("rrc", "hflip"))
    assert (r.nproc, r.log_with) == (2, "none")
    assert resolve(TrainConfig(data=DataConfig(randaugment="trivial")), cfg.plan(1)).data.randaugment == (1, -1)


def test_resolved_settings_read_back_equal_from_what_the_run_folder_records():
    cfg = TrainConfig(data=DataConfig(augment="crop, hflip", randaugment="trivial", crop_scale=(0.25, 1)),
                      run=RunConfig(nproc=2, log_with=("tensorboard",)))
    settings = resolve(cfg, cfg.plan(2), recipe="photo")
    recorded = settings.to_dict()
    assert recorded["data"]["augment"] == "crop,hflip" and recorded["data"]["randaugment"] == "trivial"
    assert recorded["run"]["nproc"] == "2" and recorded["run"]["log_with"] == "tensorboard"
    assert Settings.from_dict(recorded, settings.plan.to_dict()) == settings


def test_a_setting_recorded_in_other_words_is_no_change_on_resume():
    saved, new = TrainConfig().to_dict(), TrainConfig().to_dict()
    saved["data"].update(augment="crop, hflip", crop_scale="0.08, 1")
    new["data"].update(augment="crop,hflip")
    assert trajectory_changes(saved, new) == []
    new["data"]["crop_scale"] = "0.5,1.0"
    assert trajectory_changes(saved, new) == ["crop_scale: saved '0.08, 1', now '0.5,1.0'"]


@pytest.mark.parametrize("field, value, message", [
    ("crop_scale", "0.5", "--crop-scale must be two numbers 'low,high', got '0.5'"),
    ("crop_scale", (0.9, 0.1), "--crop-scale must be two fractions 0 < low <= high <= 1, got 0.9,0.1"),
    ("randaugment", (2, 11), "--randaugment must be 'N,M'"),
    ("augment", ("crop", "spin"), "--augment: unknown augmentation 'spin'"),
])
def test_a_bad_structured_value_from_the_api_is_refused_by_flag(field, value, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(data=DataConfig(**{field: value})).validate()


def test_a_config_file_may_give_a_range_as_a_list(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("crop-scale: [0.5, 1.0]\nnproc: 2\n")
    values = read_config_file(str(path))
    assert values["data"]["crop_scale"] == (0.5, 1.0) and values["run"]["nproc"] == 2
    path.write_text("crop-scale: [0.5]\n")
    with pytest.raises(UserError, match=r"run.yaml: crop-scale: --crop-scale must be two numbers"):
        read_config_file(str(path))


def test_every_flag_takes_the_type_its_setting_declares():
    train = build_parser().commands["train"]
    types = {a.dest.split(".", 1)[1]: a.type for a in train._actions if "." in (a.dest or "")}
    for section in (DataConfig, OptimConfig, RunConfig):
        for f in dataclasses.fields(section):
            declared = setting_type(section, f)
            assert types[f.name] in ((declared,) if declared is not bool else (None,)), f.name
    assert types["lr"] is float and types["warmup_epochs"] is float and types["crop_scale"] is str


def test_a_setting_of_a_type_no_flag_can_take_is_refused_when_declared():
    @dataclasses.dataclass
    class Odd:
        sizes: list[int] = dataclasses.field(default_factory=list, metadata={"help": "x"})

    with pytest.raises(TypeError, match="Odd.sizes: a setting is a bool, int, float or str"):
        setting_type(Odd, dataclasses.fields(Odd)[0])


@pytest.mark.parametrize("recipe, augment", [("digits", ("crop",)), ("photo", ("rrc", "hflip"))])
def test_a_recipe_given_still_fills_in_the_augmentations_of_auto(recipe, augment):
    cfg = TrainConfig(data=DataConfig(recipe=recipe))
    settings = resolve(cfg, cfg.plan(1))  # the launcher's, before the data is read
    assert settings.data.augment == "auto"
    assert settings.with_recipe(recipe).data.augment == augment
    assert resolve(cfg, cfg.plan(1), recipe).data.augment == augment


def test_an_empty_value_in_a_settings_file_is_one_line_naming_the_key(tmp_path):
    path = tmp_path / "run.yaml"
    for key in ("augment", "log-with"):
        path.write_text(f"{key}:\n")
        with pytest.raises(UserError, match=f"run.yaml: {key}: --{key}: .*got nothing"):
            read_config_file(str(path))


def test_numpy_numbers_in_a_range_survive_to_dict_and_back():
    import numpy as np

    cfg = TrainConfig(data=DataConfig(crop_scale=(np.float64(0.1), 1.0)))
    assert cfg.to_dict()["data"]["crop_scale"] == "0.1,1.0"
    assert TrainConfig.from_dict(cfg.to_dict()).validate() is not None
    with pytest.raises(UserError, match="--randaugment must be 'N,M'"):
        TrainConfig(data=DataConfig(randaugment=(2.7, 9))).validate()


@pytest.mark.parametrize("saved, now, expected", [
    ((2, 128, 1), (1, 128, 1), (128, 2)),   # 2 devices -> 1: each device's batch kept, 2 micro-batches accumulated
    ((1, 128, 1), (2, 128, 1), (64, 1)),    # 1 -> 2: the batch split
    ((2, 16, 2), (1, 16, 2), (16, 4)),      # with accumulation
    ((4, 32, 1), (3, 32, 1), (None, None)),  # 128 over 3 devices: refused
    ((2, 64, 1), (2, 32, 1), (32, 1)),      # same device count: the plan as given (resume then compares it)
])
def test_a_plan_continuing_on_another_device_count_keeps_the_global_batch(saved, now, expected):
    cfg = _config("")
    cfg.optim.batch_size, cfg.optim.grad_accum = saved[1], saved[2]
    before = cfg.plan(saved[0])
    cfg.optim.batch_size, cfg.optim.grad_accum = now[1], now[2]
    if expected[0] is None:
        with pytest.raises(UserError, match="saved with a global batch of 128 on 4 device"):
            cfg.plan(now[0]).continuing(before, "CKPT")
        return
    plan = cfg.plan(now[0]).continuing(before, "CKPT")
    assert (plan.batch_per_device, plan.grad_accum) == expected
    if saved[0] != now[0]:
        assert (plan.global_batch, plan.lr) == (before.global_batch, before.lr)


# -- who takes the whole settings ------------------------------------------------------------------------------
# entry points (verify's: the Python API and a command's job), and what resolves, records or trains from the whole
# config (verify's: the job's config, and its recorder, which trains through fit)
MOST_TAKING_THE_WHOLE = 16


def _takers_of_the_whole(path: str, text: str) -> list[tuple[str, str | None]]:
    """('path:line name', its docstring on one line) of every function in `text` with a parameter annotated
    Settings or TrainConfig, or an unannotated one called settings, cfg or config."""
    import ast

    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                annotation = ast.unparse(a.annotation) if a.annotation else ""
                if "Settings" in annotation or "TrainConfig" in annotation or \
                        (not annotation and a.arg in ("settings", "cfg", "config")):
                    doc = ast.get_docstring(node)
                    found.append((f"{path}:{node.lineno} {node.name}", doc and " ".join(doc.split())))
                    break
    return found


def test_few_functions_take_the_whole_settings_and_each_says_why():
    """Each part reads the section(s) it concerns (data, model, optim, run, the plan); the few that take the whole
    settings or config say why in their docstring ('the whole settings: ...', 'the whole config: ...')."""
    from pathlib import Path

    root = Path(scaletrain.__file__).parent
    takers = [t for f in sorted(root.rglob("*.py"))
              for t in _takers_of_the_whole(str(f.relative_to(root.parent)), f.read_text())]
    names = "\n".join(name for name, _ in takers)
    assert len(takers) <= MOST_TAKING_THE_WHOLE, \
        f"{len(takers)} functions take the whole settings (at most {MOST_TAKING_THE_WHOLE}):\n{names}"
    unexplained = [name for name, doc in takers if not doc or not ("whole settings" in doc or "whole config" in doc)]
    assert not unexplained, "these take the whole settings without saying why in their docstring (\"the whole " \
                            "settings: ...\" or \"the whole config: ...\"):\n" + "\n".join(unexplained)


def test_what_counts_as_taking_the_whole_settings():
    text = '''
def a(s: Settings): """the whole settings: it records them"""
def b(config: "TrainConfig | None" = None): pass
def c(cfg): pass
def d(o: OptimConfig, plan, *, settings: Settings): pass
def e(d: DataConfig, recorded: dict, r: RunConfig): pass
def f(config: dict): pass
'''
    assert [(name.split()[1], doc) for name, doc in _takers_of_the_whole("x.py", text)] == \
        [("a", "the whole settings: it records them"), ("b", None), ("c", None), ("d", None)]


@pytest.mark.parametrize("statement, message", [
    ("config.optim.epocs = 5", "config.optim.epocs: no such setting; did you mean config.optim.epochs (--epochs)?"),
    ("config.run.stratgy = 'fsdp'",
     "config.run.stratgy: no such setting; did you mean config.run.strategy (--strategy)?"),
    ("config.run.epochs = 5", "config.run.epochs: no such setting; epochs is config.optim.epochs (--epochs)"),
    ("config.epochs = 5", "config.epochs: no such setting; epochs is config.optim.epochs (--epochs)"),
    ("config.optimm = None", "config.optimm: no such section (data, model, optim, run); did you mean config.optim?"),
    ("config.run.context_parallel = 2", "config.run.context_parallel: no such setting; `scaletrain config FILE` "
                                        "writes every setting"),
])
def test_a_setting_that_does_not_exist_is_refused_when_set_in_python(statement, message):
    """Set in a script, a misspelled setting was kept beside the real ones and ignored: the run trained the
    default epochs on the default strategy without a word."""
    config = TrainConfig()
    with pytest.raises(UserError) as refused:
        exec(statement, {"config": config})
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)
    assert isinstance(refused.value, AttributeError)  # what an object without such an attribute raises
    assert config.to_dict() == TrainConfig().to_dict()  # nothing changed
