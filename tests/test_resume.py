"""Exact resumption after failures, with real processes: SIGKILL (with restarts), SIGTERM, a stalled rank,
and damaged checkpoints. The yardstick is always the same run without interruption, compared bit for bit."""

from __future__ import annotations

import csv
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
import scaletrain
from scaletrain.config import resolve
from safetensors.torch import load_file

from helpers import digit_pngs, run_cli, start_python, train_cli

# 400 samples in batches of 16: 25 micro-batches per epoch on one process, 13 on each of two.
# Every fault below fires within these 2 epochs, and the resumed runs carry on across the epoch boundary.
BASE = ["--model", "tinycnn", "--epochs", "2", "--batch-size", "16", "--checkpoint-every", "2", "--log-every", "1"]
SETTINGS = {"1": [], "1-accum": ["--grad-accum", "3"], "2": ["--nproc", "2"],
            "2-accum": ["--nproc", "2", "--grad-accum", "2"]}


def _train(data, out, *extra, env=None, expect=0):
    return train_cli(data, out, *BASE, *extra, env=env, expect=expect)


def _same_weights(a, b) -> bool:
    wa, wb = load_file(a / "last.safetensors"), load_file(b / "last.safetensors")
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _states(out) -> list[str]:
    return sorted(p.name for p in (out / "state").iterdir())


def _copy(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


@pytest.fixture(scope="module")
def references(tmp_path_factory, small_npz):
    """Uninterrupted runs for each setting the tests interrupt."""
    root = tmp_path_factory.mktemp("reference")
    for name, extra in SETTINGS.items():
        _train(small_npz, root / name, *extra)
    return root


@pytest.fixture(scope="module")
def killed(tmp_path_factory, small_npz):
    """killed(setting, batch): a run SIGKILLed at that micro-batch, made once; tests resume or damage copies."""
    root = tmp_path_factory.mktemp("killed")
    made = {}

    def make(setting, batch):
        if (setting, batch) not in made:
            out = root / f"{setting}-{batch}"
            # On 2 processes the launcher reports the killed worker with exit code 1.
            _train(small_npz, out, *SETTINGS[setting], env={"SCALETRAIN_FAULT": f"kill:{batch}"},
                   expect=1 if setting.startswith("2") else -9)
            made[setting, batch] = out
        return made[setting, batch]

    return make


# -- SIGKILL, then the same command --------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[
    ("1", 7),          # mid-epoch
    ("1", 25),         # the last batch of an epoch, before its end-of-epoch checkpoint
    ("1-accum", 8),    # inside a gradient-accumulation group of 3
    ("2-accum", 9),    # two processes, inside an accumulation group
], ids=["mid-epoch", "last-batch-of-epoch", "inside-accumulation", "2-processes-inside-accumulation"])
def resumed(request, killed, small_npz, tmp_path_factory):
    """(setting, the killed run as it was left, the resumed copy, the resuming process)."""
    setting, batch = request.param
    left = killed(setting, batch)
    out = _copy(left, tmp_path_factory.mktemp("resumed"))
    return setting, left, out, _train(small_npz, out, *SETTINGS[setting])


@pytest.mark.slow
def test_a_killed_run_leaves_a_checkpoint_and_no_summary(resumed):
    _, left, _, _ = resumed
    assert not (left / "summary.json").exists()
    assert _states(left) and all(name.startswith("step-") for name in _states(left)), "killed before any checkpoint"


@pytest.mark.slow
def test_the_same_command_resumes_from_the_newest_checkpoint(resumed):
    _, left, out, proc = resumed
    assert f"resuming from {out / 'state' / _states(left)[-1]}" in proc.stdout


@pytest.mark.slow
def test_a_killed_and_resumed_run_ends_bitwise_equal_to_an_uninterrupted_one(resumed, references):
    setting, _, out, _ = resumed
    assert _same_weights(out, references / setting)


@pytest.mark.slow
def test_a_resumed_run_logs_each_epoch_once(resumed):
    _, _, out, _ = resumed
    assert [r["epoch"] for r in csv.DictReader((out / "metrics.csv").open())] == ["1", "2"]


# -- resumed on another process count -----------------------------------------------------------------------------
MLP = """
from torch import nn


def make(num_classes, in_chans=1):
    return nn.Sequential(nn.Flatten(), nn.Linear(in_chans * 28 * 28, 32), nn.ReLU(), nn.Linear(32, num_classes))
"""


@pytest.fixture(scope="module")
def moved(tmp_path_factory, small_npz):
    """A global batch of 32 without augmentation or BatchNorm (nothing but float sums tells process counts apart):
    uninterrupted on 1 process; and killed on 1 process mid-epoch 1, resumed on 2 (16 per device) and killed
    mid-epoch 2, resumed on 1 with --batch-size 16 (2 accumulated) to the end."""
    tmp = tmp_path_factory.mktemp("moved")
    (tmp / "mlp.py").write_text(MLP)
    args = ["--model", f"{tmp / 'mlp.py'}:make", "--augment", "none", "--epochs", "2", "--checkpoint-every", "2"]
    train_cli(small_npz, tmp / "reference", *args, "--batch-size", "32")
    out = tmp / "run"
    train_cli(small_npz, out, *args, "--batch-size", "32", env={"SCALETRAIN_FAULT": "kill:7"}, expect=-9)
    on_2 = train_cli(small_npz, out, *args, "--batch-size", "16", "--nproc", "2", env={"SCALETRAIN_FAULT": "kill:20"},
                     expect=1)
    on_1 = train_cli(small_npz, out, *args, "--batch-size", "16")
    return tmp / "reference", out, on_2, on_1


@pytest.mark.slow
def test_a_run_moved_between_1_and_2_processes_says_so_and_keeps_the_global_batch(moved):
    _, out, on_2, on_1 = moved
    assert (f"resuming from {out / 'state' / 'step-00000006'}: epoch 1, batch 6, optimizer step 6; saved on 1 "
            f"device(s) by 1 process(es), continuing on 2 device(s) by 2 process(es): the global batch stays 32 (16 "
            f"per device x 1 accumulated), each step's samples as before") in on_2.stdout
    assert (f"resuming from {out / 'state' / 'step-00000018'}: epoch 2, batch 10, optimizer step 18; saved on 2 "
            f"device(s) by 2 process(es), continuing on 1 device(s) by 1 process(es): the global batch stays 32 (16 "
            f"per device x 2 accumulated)") in on_1.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["global_batch_size"], summary["grad_accum"]) == (32, 2)
    assert [json.loads(line)["world_size"] for line in (out / "resumes.jsonl").read_text().splitlines()] == [2, 1]


@pytest.mark.slow
def test_a_run_moved_between_1_and_2_processes_continues_the_loss_curve_within_float_noise(moved):
    reference, out, _, _ = moved
    rows = [list(csv.DictReader((run / "metrics.csv").open())) for run in (reference, out)]
    assert [r["epoch"] for r in rows[1]] == ["1", "2"]
    for a, b in zip(*rows):
        for key in ("train_loss", "val_loss", "val_accuracy"):
            assert float(b[key]) == pytest.approx(float(a[key]), rel=1e-5, abs=1e-6), key
    assert sorted(p.name for p in (out / "state").iterdir())[-1] == "step-00000026"  # 13 steps per epoch, as before
    wa, wb = load_file(reference / "last.safetensors"), load_file(out / "last.safetensors")
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-4


# -- restarts by the launcher ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def restarted(tmp_path_factory, small_npz):
    """A 2-process run with --max-restarts 1 whose rank 1 is SIGKILLed once, at batch 17."""
    tmp = tmp_path_factory.mktemp("restarted")
    out = tmp / "run"
    proc = _train(small_npz, out, *SETTINGS["2"], "--max-restarts", "1",
                  env={"SCALETRAIN_FAULT": "kill:17:1", "SCALETRAIN_FAULT_ONCE": str(tmp / "fired")})
    return tmp, out, proc


@pytest.mark.slow
def test_sigkill_under_max_restarts_restarts_the_job_and_resumes(restarted):
    tmp, _, proc = restarted
    assert (tmp / "fired").exists(), "the fault never fired"
    assert proc.stdout.count("resuming from") == 1


@pytest.mark.slow
def test_sigkill_under_max_restarts_ends_bitwise_equal_to_an_uninterrupted_run(restarted, references):
    _, out, _ = restarted
    assert _same_weights(out, references / "2")


@pytest.mark.slow
def test_torchrun_restart_also_resumes(references, small_npz, tmp_path):
    out = tmp_path / "run"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "--max-restarts", "1", "-m"]
    proc = run_cli("train", "--data", str(small_npz), *BASE, "--output-dir", str(out), launcher=launcher,
                   env={"SCALETRAIN_FAULT": "kill:10:0", "SCALETRAIN_FAULT_ONCE": str(tmp_path / "fired")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "fired").exists(), "the fault never fired"
    assert _same_weights(out, references / "2")


# -- SIGTERM: save, stop with 75, resume -----------------------------------------------------------------------
def _stopped_and_resumed(small_npz, out, setting, fault):
    """Stop a run with SIGTERM; return the stopping process, the checkpoints it left, and the resuming process."""
    stopped = _train(small_npz, out, *SETTINGS[setting], env={"SCALETRAIN_FAULT": fault}, expect=75)
    states = _states(out)
    return stopped, states, _train(small_npz, out, *SETTINGS[setting])


@pytest.fixture(scope="module")
def sigterm_on_2(tmp_path_factory, small_npz):
    """Rank 1 of 2 gets SIGTERM after micro-batch 11."""
    out = tmp_path_factory.mktemp("sigterm") / "run"
    return (out, *_stopped_and_resumed(small_npz, out, "2", "term:11:1"))


@pytest.mark.slow
def test_sigterm_stops_with_exit_75_and_one_message_saying_how_to_resume(sigterm_on_2):
    _, stopped, _, _ = sigterm_on_2
    assert stopped.stderr.count("stopped by") == 1
    assert "run the same command again to resume" in stopped.stderr


@pytest.mark.slow
def test_sigterm_on_one_rank_checkpoints_every_rank_at_the_next_step(sigterm_on_2):
    # The signal came after batch 11; every rank checkpointed at the next step boundary, step 12.
    _, _, states, _ = sigterm_on_2
    assert states[-1] == "step-00000012"


@pytest.mark.slow
def test_after_sigterm_the_same_command_ends_bitwise_equal(sigterm_on_2, references):
    out, _, _, resumed = sigterm_on_2
    assert "resuming from" in resumed.stdout and "optimizer step 12" in resumed.stdout
    assert _same_weights(out, references / "2")


def test_sigterm_to_the_whole_job_with_dataloader_workers_still_saves_and_stops_with_75(tmp_path, mnist):
    """SLURM's scancel and `kill -- -PGID` signal every process of the job, the DataLoader workers too: they leave
    the stop to the training, which saves at its next step (torch's worker handler ended them at once, and the
    training in a traceback, before)."""
    data, out = digit_pngs(tmp_path / "data", mnist, range(64)), tmp_path / "run"
    proc = start_python([sys.executable, "-m", "scaletrain", "train", "--data", data, "--model", "tinycnn",
                         "--data-on-device", "no", "--num-workers", "2", "--epochs", "500", "--batch-size", "8",
                         "--val-fraction", "0.25", "--output-dir", out], new_session=True)
    with proc:
        for line in proc.stdout:
            if line.startswith("first step done"):
                os.killpg(proc.pid, signal.SIGTERM)  # the training and its two workers
                break
        _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr[-2000:]
    assert "Traceback" not in stderr and stderr.count("stopped by SIGTERM after saving the training state") == 1
    assert _states(out), "no checkpoint saved"


def test_a_dataloader_worker_ends_on_its_trainings_sigterm_and_ignores_anothers():
    """The rule behind the test above: a worker of a process that catches SIGTERM ignores it from anyone else, and
    still ends on its own process's (torch's shutdown of a worker that does not stop, multiprocessing's at exit)."""
    from torch.utils.data import DataLoader

    from scaletrain.parallel.threads import data_worker_start
    from scaletrain.training.signals import StopSignals

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    StopSignals().install()
    it = None
    try:
        it = iter(DataLoader(range(8), batch_size=2, num_workers=1, persistent_workers=True,
                             worker_init_fn=data_worker_start))
        next(it)
        worker = it._workers[0]
        for sig in ("-TERM", "-USR1"):  # another process's, as scancel or kill -- -PGID sends them
            subprocess.run(["kill", sig, str(worker.pid)], check=True)
        worker.join(2)
        assert worker.is_alive() and next(it).tolist() == [2, 3]
        os.kill(worker.pid, signal.SIGTERM)  # its training's
        worker.join(10)
        assert worker.exitcode == 0
    finally:
        if it is not None:
            it._shutdown_workers()  # a worker left by a failed assertion would ignore a SIGTERM of pytest's exit
        for s, handler in before.items():
            signal.signal(s, handler)


@pytest.fixture(scope="module")
def sigterm_at_epoch_end(tmp_path_factory, small_npz):
    """SIGTERM after micro-batch 24 of 25: the stop comes at the last batch of the epoch."""
    out = tmp_path_factory.mktemp("sigterm-epoch-end") / "run"
    return (out, *_stopped_and_resumed(small_npz, out, "1", "term:24"))


@pytest.mark.slow
def test_a_stop_at_the_last_batch_of_an_epoch_still_saves_first(sigterm_at_epoch_end):
    _, stopped, states, _ = sigterm_at_epoch_end
    assert "after saving the training state at optimizer step 25" in stopped.stderr
    assert states[-1] == "step-00000025"


@pytest.mark.slow
def test_a_stop_at_the_last_batch_of_an_epoch_resumes_bitwise_equal(sigterm_at_epoch_end, references):
    out, _, _, _ = sigterm_at_epoch_end
    assert _same_weights(out, references / "1")


# -- a stalled rank ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_stalled_rank_fails_the_job_within_the_timeout(small_npz, tmp_path):
    start = time.monotonic()
    proc = run_cli("train", "--data", str(small_npz), *BASE, "--nproc", "2", "--timeout", "5",
                   "--output-dir", str(tmp_path / "run"), env={"SCALETRAIN_FAULT": "hang:4:1"}, timeout=150)
    assert proc.returncode != 0
    assert "waited more than --timeout for the others" in proc.stderr
    # the stuck rank ignores the launcher's SIGTERM no longer than --timeout, not until the launcher's SIGKILL
    assert "SIGTERM received and no progress for 5 s" in proc.stderr
    assert time.monotonic() - start < 60


# -- damaged checkpoints -----------------------------------------------------------------------------------------
def _damage_newest_and_resume(killed, small_npz, tmp_path, damage):
    """Damage the newest checkpoint of a copy of the run killed at micro-batch 7, then resume it."""
    out = _copy(killed("1", 7), tmp_path)
    states = _states(out)
    assert len(states) >= 2, "nothing to fall back to"
    newest = out / "state" / states[-1]
    damage(newest)
    proc = _train(small_npz, out)
    return out, newest, out / "state" / states[-2], proc


@pytest.fixture(scope="module")
def truncated(killed, small_npz, tmp_path_factory):
    def truncate(folder):
        f = folder / "rank-0.safetensors"
        f.write_bytes(f.read_bytes()[:100])

    return _damage_newest_and_resume(killed, small_npz, tmp_path_factory.mktemp("truncated"), truncate)


@pytest.mark.slow
def test_a_truncated_checkpoint_is_named_unusable_for_its_checksum(truncated):
    _, newest, _, proc = truncated
    assert f"checkpoint {newest} is unusable" in proc.stdout
    assert "does not match its checksum" in proc.stdout


@pytest.mark.slow
def test_a_truncated_checkpoint_falls_back_to_the_previous_one_and_ends_bitwise_equal(truncated, references):
    out, _, previous, proc = truncated
    assert f"resuming from {previous}" in proc.stdout
    assert _same_weights(out, references / "1")


@pytest.mark.slow
def test_crafted_pickle_in_a_checkpoint_is_never_run(killed, references, small_npz, tmp_path):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            import os
            return (os.system, (f"touch {marker}",))

    def plant(folder):
        (folder / "model.safetensors").write_bytes(pickle.dumps(Exploit()))

    out, newest, previous, proc = _damage_newest_and_resume(killed, small_npz, tmp_path, plant)
    assert not marker.exists()
    assert f"checkpoint {newest} is unusable" in proc.stdout and f"resuming from {previous}" in proc.stdout
    assert _same_weights(out, references / "1")


# -- a full disk -------------------------------------------------------------------------------------------------
@pytest.fixture
def full_disk_save(tmp_path, monkeypatch):
    """A checkpoint at step 1, then a save at step 2 whose optimizer file finds the disk full.
    Returns the run folder and the warnings the failed save gave."""
    from scaletrain.training import checkpoint
    from scaletrain.parallel import Runtime

    runtime = Runtime()
    try:
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        cfg = scaletrain.TrainConfig()
        settings = resolve(cfg, cfg.plan(1))
        ckpt = checkpoint.Checkpointer(tmp_path, runtime, model, opt, sched, settings.run, settings.to_dict(),
                                       settings.plan)
        ckpt.save(checkpoint.TrainState(0, 1, 1))
        import safetensors.torch
        real_save = safetensors.torch.save_file

        def disk_full(tensors, path):
            if path.endswith("optimizer.safetensors"):
                raise OSError(28, "No space left on device")
            real_save(tensors, path)

        monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ckpt.save(checkpoint.TrainState(0, 2, 2))
    finally:
        runtime.end()
    return tmp_path, [str(w.message) for w in caught]


def test_a_full_disk_during_a_save_warns_and_training_goes_on(full_disk_save):
    _, caught = full_disk_save
    assert any("No space left on device" in message for message in caught), caught


def test_a_full_disk_during_a_save_keeps_only_the_previous_checkpoint(full_disk_save):
    from scaletrain.training import checkpoint

    run, _ = full_disk_save
    assert _states(run) == ["step-00000001"], "the half-written checkpoint was left behind"
    assert checkpoint.find_resumable(run) == run / "state" / "step-00000001"
