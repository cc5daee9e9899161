"""The user's own data order through `fit` (tests/streams.py): streams (`IterableDataset`) of uneven lengths on one
and two processes without a hang, each validation item counted once, resumed mid-epoch from their state or from
the epoch's start; a sampler's balance kept on any process count and resumed bitwise; and what is refused."""

from __future__ import annotations

import csv
import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler, WeightedRandomSampler

import scaletrain
from scaletrain.data.indices import SamplerOrder
from scaletrain.errors import UserError

sys.path.insert(0, str(Path(__file__).parent))
import streams  # noqa: E402

from helpers import run_python

SCRIPT = str(Path(__file__).with_name("streams.py"))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _run(case: str, out: Path, nproc: int = 1, expect: int | None = 0, **env):
    """tests/streams.py CASE OUT on `nproc` processes; `expect`: its exit code (None: any but 0)."""
    command = (TORCHRUN if nproc == 2 else [sys.executable]) + [SCRIPT, case, str(out)]
    done = run_python(command, timeout=600, env={k: str(v) for k, v in env.items()})
    exited_as_expected = done.returncode == expect if expect is not None else done.returncode != 0
    assert exited_as_expected, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def _history(out: Path) -> list[dict]:
    return json.loads((out / "result.json").read_text())["history"]


def _indices_per_epoch(out: Path, steps_per_epoch: int) -> list[list[int]]:
    seen = streams.seen(out)
    return [[i for batch in seen[e:e + steps_per_epoch] for _, i in batch]
            for e in range(0, len(seen), steps_per_epoch)]


def _same_weights(a: Path, b: Path) -> bool:
    x, y = load_file(a / "run" / "last.safetensors"), load_file(b / "run" / "last.safetensors")
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_a_stream_trains_and_validates_every_item_once_and_says_how_many_samples_each_epoch_had(tmp_path):
    done = _run("uneven", tmp_path)
    history = _history(tmp_path)
    assert [row["train_samples"] for row in history] == [300, 300]
    assert [row["val_samples"] for row in history] == [101, 101]
    assert "on a stream, validating on a stream" in done.stdout and "300 samples" in done.stdout
    with open(tmp_path / "run" / "metrics.csv") as f:
        assert next(csv.reader(f))[:3] == ["epoch", "train_loss", "train_samples"]
    epochs = _indices_per_epoch(tmp_path, 19)  # 300 items in batches of 16
    assert [sorted(e) for e in epochs] == [list(range(300))] * 2


@pytest.mark.slow
def test_uneven_streams_on_two_processes_end_each_epoch_together_when_one_runs_dry(tmp_path):
    _run("uneven", tmp_path, nproc=2)  # rank 0 reads 240 items, rank 1 60: 4 batches each, then rank 1 is dry
    history = _history(tmp_path)
    assert [row["train_samples"] for row in history] == [4 * 16 + 60, 4 * 16 + 60]
    assert [row["val_samples"] for row in history] == [101, 101]  # 80 on rank 0, 21 on rank 1: each once


@pytest.mark.slow
def test_a_plain_stream_is_split_among_two_processes_each_item_read_by_one(tmp_path):
    _run("split", tmp_path, nproc=2)
    history = _history(tmp_path)
    assert [row["train_samples"] for row in history] == [300, 300]
    assert [row["val_samples"] for row in history] == [101, 101]
    epochs = _indices_per_epoch(tmp_path, 10)  # 150 items per rank in batches of 16
    assert [sorted(e) for e in epochs] == [list(range(300))] * 2


def test_a_resumable_stream_killed_mid_epoch_continues_from_its_state_to_the_same_weights(tmp_path):
    _run("stateful", tmp_path / "whole")
    killed = _run("stateful", tmp_path / "again", expect=-9, SCALETRAIN_FAULT="kill:25")  # epoch 2, step 6
    assert not (tmp_path / "again" / "result.json").exists() and "epoch 1/2" in killed.stdout
    resumed = _run("stateful", tmp_path / "again")
    assert "resuming from" in resumed.stdout and "starts again" not in resumed.stdout
    assert _same_weights(tmp_path / "whole", tmp_path / "again")
    assert [r["train_samples"] for r in _history(tmp_path / "again")] == [300, 300]


def test_a_stream_without_state_starts_the_interrupted_epoch_again_and_says_so(tmp_path):
    _run("split", tmp_path, expect=-9, SCALETRAIN_FAULT="kill:25")
    resumed = _run("split", tmp_path)
    assert "the stream has no state_dict(): epoch 2 starts again from its beginning (5 batch(es)" in resumed.stdout
    assert _history(tmp_path)[-1]["train_samples"] == 300


def test_steps_per_epoch_ends_a_streams_epoch_and_plans_the_schedule(tmp_path):
    _run("split", tmp_path, STEPS=3)
    assert [row["train_samples"] for row in _history(tmp_path)] == [48, 48]


@pytest.mark.parametrize("batch,nproc", [(16, 1), pytest.param(8, 2, marks=pytest.mark.slow)])
def test_a_weighted_sampler_balances_a_90_10_set_on_any_process_count(batch, nproc, tmp_path):
    done = _run("sampler", tmp_path, nproc=nproc, BATCH=batch)
    assert "training Sequential on 400 samples" in done.stdout
    seen = streams.seen(tmp_path)
    assert len(seen) == 2 * 25 and all(len(b) == 16 for b in seen)  # 400 samples, a global batch of 16
    minority = sum(label for batch in seen for label, _ in batch) / sum(map(len, seen))
    assert 0.45 <= minority <= 0.55, minority  # 10 % in the data


@pytest.mark.slow
def test_a_sampler_on_two_processes_trains_the_global_batches_of_one_and_resumes_bitwise(tmp_path):
    _run("sampler", tmp_path / "one", BATCH=16)
    _run("sampler", tmp_path / "two", nproc=2, BATCH=8)
    one, two = streams.seen(tmp_path / "one"), streams.seen(tmp_path / "two")
    assert [sorted(b) for b in one] == [sorted(b) for b in two]
    _run("sampler", tmp_path / "again", nproc=2, expect=None, BATCH=8, SCALETRAIN_FAULT="kill:33:1")
    _run("sampler", tmp_path / "again", nproc=2, BATCH=8)
    assert _same_weights(tmp_path / "two", tmp_path / "again")


def test_a_sampler_killed_mid_epoch_resumes_bitwise(tmp_path):
    _run("sampler", tmp_path / "whole")
    _run("sampler", tmp_path / "again", expect=-9, SCALETRAIN_FAULT="kill:31")
    _run("sampler", tmp_path / "again")
    assert _same_weights(tmp_path / "whole", tmp_path / "again")


def _fit(train, **kwargs):
    config = streams.config(Path(""))
    config.run.output_dir = ""
    for k, v in kwargs.pop("optim", {}).items():
        setattr(config.optim, k, v)
    return scaletrain.fit(streams.make_net(), train, None, config, loss_fn=streams.Recorded(), **kwargs)


@pytest.mark.parametrize("train,kwargs,message", [
    (streams.Digits(0, 64), {}, "train_data is an IterableDataset without len(): --scheduler onecycle with "
                                "--warmup-epochs 1 needs the run's length; set steps_per_epoch"),
    (streams.Digits(0, 64), {"sampler": SequentialSampler(range(64))}, "sampler: train_data is an IterableDataset"),
    (streams.Skewed(64), {"sampler": BatchSampler(SequentialSampler(range(64)), 8, False)},
     "sampler: expected a Sampler of dataset indices, got"),
    (streams.Skewed(64), {"sampler": iter(range(64))}, "has no len()"),
    (streams.Skewed(64), {"sampler": range(60, 70)}, "sampler: drew index 69; the training set has indices 0..63"),
    (streams.Skewed(64), {"sampler": [[0, 1]] * 4}, "sampler: yielded a list of 2"),
    (streams.Skewed(64), {"optim": {"steps_per_epoch": 3}}, "--steps-per-epoch 3: only for a stream (an "
                                                            "IterableDataset given to fit); this training set gives 4"),
])
def test_what_cannot_be_drawn_is_refused_on_one_line(train, kwargs, message):
    with pytest.raises(UserError) as e:
        _fit(train, **kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_samplers_epochs_differ_and_a_fixed_generator_is_seeded_per_epoch():
    data = streams.Skewed(64)
    g = torch.Generator().manual_seed(123)
    sampler = WeightedRandomSampler(torch.ones(64), 64, generator=g)
    result = _fit(data, sampler=sampler, optim={"epochs": 2})
    assert len(result.history) == 2 and g.initial_seed() == 123  # the user's generator is given back untouched
    order = SamplerOrder(sampler, 64, seed=0)
    assert not torch.equal(order(0), order(1)) and Counter(order(0).tolist()) != Counter(range(64))


def _scored(out: Path) -> dict:
    return json.loads((out / "scored.json").read_text())


@pytest.mark.parametrize("case", ["split", pytest.param("uneven", marks=pytest.mark.slow)])
@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_predict_and_evaluate_score_each_item_of_a_stream_once_as_a_dataset_would_be(case, nproc, tmp_path):
    _run(case, tmp_path, nproc=nproc, SCORE=1)
    scored = _scored(tmp_path)
    assert scored["samples"] == 101 and scored["rows"] == 101 and scored["npy_rows"] == 101
    assert scored["loss"] == pytest.approx(scored["loss_of_dataset"], rel=1e-5)
    if case == "split":  # dealt out item by item: the outputs come in the stream's order
        assert scored["max_difference_to_dataset"] < 1e-5


def test_an_epoch_trains_on_as_many_samples_as_the_sampler_draws(capsys):
    data = streams.Skewed(64)
    result = _fit(data, sampler=RandomSampler(data, replacement=True, num_samples=32))
    assert result.summary["train_samples"] == 32 and "on 32 samples" in capsys.readouterr().out
