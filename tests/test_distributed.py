"""Real multi-process runs: 2 workers on gloo over loopback, started by each supported launcher."""

from __future__ import annotations

import csv
import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from helpers import free_port, run_cli, start_cli
from scaletrain.data import load_image_sets
from scaletrain.models import build_model
from scaletrain.data.transforms import Preprocess, to_model_input
from scaletrain.runfolder import load_weights

TINY = ["--model", "tinycnn", "--epochs", "2", "--batch-size", "16", "--log-every", "5"]


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, small_npz):
    out = tmp_path_factory.mktemp("nproc2") / "run"
    proc = run_cli("train", "--data", str(small_npz), *TINY, "--nproc", "2", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr
    return out, proc


def _single_process_scores(run_dir, data_path):
    """Accuracy and loss of the saved weights, computed here in one process without the engine."""
    weights, meta = load_weights(run_dir / "last.safetensors")
    _, val = load_image_sets(str(data_path))
    model = build_model(meta["model"], val.channels, len(meta["classes"]))
    model.load_state_dict(weights)
    model.eval()
    with torch.no_grad():
        logits = model(to_model_input(val.images, Preprocess(**meta["preprocess"]), channels_last=False))
    loss = torch.nn.functional.cross_entropy(logits, val.labels).item()
    return (logits.argmax(1) == val.labels).sum().item() / len(val), loss, len(val)


@pytest.mark.slow
def test_two_processes_print_each_epoch_and_the_plan_once(two_process_run):
    _, proc = two_process_run
    assert [proc.stdout.count(f"epoch {epoch}/2 ") for epoch in (1, 2)] == [1, 1], proc.stdout
    assert proc.stdout.count("training tinycnn on 400 samples, validating on 101; 2 process(es)") == 1


@pytest.mark.slow
def test_the_first_optimizer_step_is_announced_once_with_the_seconds_since_launch(two_process_run):
    _, proc = two_process_run
    lines = [line for line in proc.stdout.splitlines() if line.startswith("first step done ")]
    assert len(lines) == 1, proc.stdout
    seconds = float(lines[0].split()[3])
    assert 0 < seconds < 120 and lines[0].endswith(" s after launch")


@pytest.mark.slow
def test_two_processes_write_one_run_folder_with_one_row_per_epoch(two_process_run):
    out, _ = two_process_run
    assert sorted(p.name for p in out.parent.iterdir()) == ["run"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["val_samples"] == 101
    assert [r["epoch"] for r in csv.DictReader((out / "metrics.csv").open())] == ["1", "2"]


@pytest.mark.slow
def test_two_process_validation_equals_one_process_scoring_the_saved_weights(two_process_run, small_npz):
    """Validation sharded over 2 ranks counts each of the 101 samples once: the logged accuracy and loss are
    those of the saved weights scored here in one process, without the engine."""
    out, _ = two_process_run
    last = list(csv.DictReader((out / "metrics.csv").open()))[-1]
    accuracy, loss, n = _single_process_scores(out, small_npz)
    assert n == 101
    assert float(last["val_accuracy"]) == pytest.approx(accuracy, abs=1e-9)
    assert float(last["val_loss"]) == pytest.approx(loss, rel=1e-4)


LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m"],
    # seeds 002-004's launcher: deprecated, and it appends --local-rank=N to the command
    "torch.distributed.launch": [sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node=2", "-m"],
    "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                   "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m"],
}


def _assert_same_two_process_job(out, reference_run, name):
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2, name
    reference, weights = load_file(reference_run / "last.safetensors"), load_file(out / "last.safetensors")
    assert weights.keys() == reference.keys()
    assert [k for k in reference if not torch.equal(weights[k], reference[k])] == [], f"{name} trained differently"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_a_launcher_in_front_runs_the_job_of_nproc_2(two_process_run, small_npz, tmp_path, name):
    out = tmp_path / name
    proc = run_cli("train", "--data", str(small_npz), *TINY, "--output-dir", str(out), launcher=LAUNCHERS[name])
    assert proc.returncode == 0, proc.stderr
    _assert_same_two_process_job(out, two_process_run[0], name)


def _finish(procs) -> None:
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]


@pytest.mark.slow
def test_slurm_tasks_train_like_nproc_2(two_process_run, small_npz, tmp_path):
    """`srun --ntasks 2`: SLURM's variables only, no launcher, form the same 2-process job down to the last bit."""
    port = free_port()
    _finish([start_cli("train", "--data", str(small_npz), *TINY, "--output-dir", str(tmp_path / "slurm"),
                       env={"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank),
                            "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": "4242", "MASTER_PORT": str(port)})
             for rank in (0, 1)])
    _assert_same_two_process_job(tmp_path / "slurm", two_process_run[0], "slurm")


@pytest.mark.slow
def test_two_machines_with_nnodes_2_train_like_nproc_2(two_process_run, small_npz, tmp_path):
    """Two "machines" started with --nnodes 2 --node-rank 0/1 on this one form the same job as --nproc 2."""
    port = free_port()
    _finish([start_cli("train", "--data", str(small_npz), *TINY, "--output-dir", str(tmp_path / "nodes"),
                       "--nproc", "1", "--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1",
                       "--master-port", str(port)) for rank in (0, 1)])
    _assert_same_two_process_job(tmp_path / "nodes", two_process_run[0], "nodes")


NOTEBOOK = """
import sys
from accelerate import notebook_launcher
import scaletrain

config = scaletrain.TrainConfig()
config.data.data, config.run.output_dir = sys.argv[1], sys.argv[2]
config.model.model, config.optim.epochs, config.optim.batch_size, config.run.log_every = "tinycnn", 2, 16, 5
notebook_launcher(scaletrain.train, args=(config,), num_processes=2)
"""


@pytest.mark.slow
def test_notebook_launcher_with_the_python_api_trains_like_nproc_2(two_process_run, small_npz, tmp_path):
    script = tmp_path / "notebook.py"
    script.write_text(NOTEBOOK)
    proc = run_cli(str(small_npz), str(tmp_path / "nb"), launcher=[sys.executable], module=str(script))
    assert proc.returncode == 0, proc.stderr[-2000:]
    _assert_same_two_process_job(tmp_path / "nb", two_process_run[0], "notebook_launcher")


@pytest.mark.parametrize("nodelist, first", [
    ("node[01-03,07],gpu5", "node01"),  # a range keeps its leading zeros
    ("gpu5,gpu6", "gpu5"),
    ("localhost", "localhost"),
    ("n[9-10]-ib", "n9-ib"),            # a suffix after the range stays
])
def test_slurm_node_lists_give_the_first_host(nodelist, first):
    from scaletrain.parallel import first_host

    assert first_host(nodelist) == first


@pytest.mark.slow
def test_a_loss_that_diverges_stops_every_rank(small_npz, tmp_path):
    """Both ranks stop at the same batch with one message naming the cause (the ranks agree on it over two
    all-reduces; with SyncBatchNorm, whose forward is a collective, no rank waits on another)."""
    proc = run_cli("train", "--data", str(small_npz), *TINY, "--lr", "1e12", "--momentum", "0", "--nproc", "2",
                   "--sync-bn", "--output-dir", str(tmp_path / "run"), timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.count("scaletrain: error: training loss became") == 1, proc.stderr
    assert "updates are too large; lower --lr" in proc.stderr or "update overflowed" in proc.stderr, proc.stderr
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.fixture(scope="module")
def global_batch_32(tmp_path_factory, mnist):
    """Last weights of one epoch at --global-batch-size 32: on 1 process, and on 2 with and without SyncBN."""
    import numpy as np

    root = tmp_path_factory.mktemp("global-batch")
    data = root / "s384.npz"
    np.savez(data, images=mnist.images[:384, 0].numpy(), labels=mnist.labels[:384].numpy(),
             val_images=mnist.images[400:450, 0].numpy(), val_labels=mnist.labels[400:450].numpy())
    common = ["--data", str(data), "--model", "tinycnn", "--epochs", "1", "--augment", "none", "--lr", "0.01",
              "--no-channels-last", "--log-every", "4", "--global-batch-size", "32"]
    runs = {"one": [], "sync": ["--nproc", "2", "--sync-bn"], "plain": ["--nproc", "2"]}
    for name, extra in runs.items():
        proc = run_cli("train", *common, *extra, "--output-dir", str(root / name))
        assert proc.returncode == 0, proc.stderr[-2000:]
    return root


def _gap(a, b) -> float:
    wa, wb = load_file(a / "last.safetensors"), load_file(b / "last.safetensors")
    return max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)


@pytest.mark.slow
def test_a_global_batch_of_32_is_16_per_process_on_2(global_batch_32):
    summary = json.loads((global_batch_32 / "sync" / "summary.json").read_text())
    assert (summary["batch_size_per_device"], summary["global_batch_size"]) == (16, 32)


@pytest.mark.slow
def test_sync_bn_on_cpu_makes_two_processes_train_like_one_with_the_same_global_batch(global_batch_32):
    assert _gap(global_batch_32 / "one", global_batch_32 / "sync") < 1e-4


@pytest.mark.slow
def test_without_sync_bn_two_processes_drift_from_one(global_batch_32):
    """BatchNorm statistics are per process without SyncBN: the control showing the test above can fail."""
    assert _gap(global_batch_32 / "one", global_batch_32 / "plain") > 1e-3


@pytest.mark.parametrize("wrapped, expected", [(False, torch.bfloat16), (True, torch.float16)],
                         ids=["plain-replica-gets-the-cpu-default", "in_autocast-replica-gets-the-jobs-dtype"])
def test_a_dataparallel_replica_computes_in_the_jobs_precision_inside_its_own_thread(wrapped, expected):
    """torch starts each DataParallel replica in a new thread under autocast with the device's default dtype
    (fp16 on CUDA, bf16 on the CPU); wrapped by in_autocast, the replica computes in the dtype the job asked for."""
    import threading

    from scaletrain.parallel import in_autocast

    seen = {}

    def replica(x):
        seen["dtype"] = torch.get_autocast_dtype("cpu")
        return torch.nn.functional.linear(x, torch.ones(2, 2))

    def worker(call):
        with torch.amp.autocast("cpu", enabled=True):
            seen["default"] = torch.get_autocast_dtype("cpu")
            seen["out"] = call(torch.ones(1, 2))

    thread = threading.Thread(target=worker, args=(in_autocast(replica, "cpu", torch.float16) if wrapped else replica,))
    thread.start()
    thread.join()
    assert seen["default"] == torch.bfloat16
    assert (seen["dtype"], seen["out"].dtype) == (expected, expected)
