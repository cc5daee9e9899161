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
from scaletrain.pipeline import Preprocess, to_model_input
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


def test_two_processes_give_one_set_of_outputs_and_exact_validation(two_process_run, small_npz):
    out, proc = two_process_run
    for epoch in (1, 2):
        assert proc.stdout.count(f"epoch {epoch}/2 ") == 1, proc.stdout
    assert proc.stdout.count("training tinycnn on 400 samples, validating on 101; 2 process(es)") == 1
    assert sorted(p.name for p in out.parent.iterdir()) == ["run"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["val_samples"] == 101
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    assert [r["epoch"] for r in rows] == ["1", "2"]
    accuracy, loss, n = _single_process_scores(out, small_npz)
    assert n == 101
    assert float(rows[-1]["val_accuracy"]) == pytest.approx(accuracy, abs=1e-9)
    assert float(rows[-1]["val_loss"]) == pytest.approx(loss, rel=1e-4)


def test_torchrun_and_accelerate_launch_run_the_same_job(two_process_run, small_npz, tmp_path):
    reference = load_file(two_process_run[0] / "last.safetensors")
    launchers = {
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m"],
        "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                       "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m"],
    }
    for name, launcher in launchers.items():
        out = tmp_path / name
        proc = run_cli("train", "--data", str(small_npz), *TINY, "--output-dir", str(out), launcher=launcher)
        assert proc.returncode == 0, proc.stderr
        assert json.loads((out / "summary.json").read_text())["world_size"] == 2, name
        weights = load_file(out / "last.safetensors")
        assert all(torch.equal(weights[k], reference[k]) for k in reference), f"{name} trained differently"


def _finish(procs) -> None:
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]


def test_slurm_tasks_and_two_machines_train_like_torchrun(two_process_run, small_npz, tmp_path):
    """`srun --ntasks 2` (SLURM's variables only) and two "machines" started with --nnodes 2 on this one both
    form the same 2-process job as --nproc 2, down to the last bit of the weights."""
    reference = load_file(two_process_run[0] / "last.safetensors")
    port = free_port()
    slurm = [start_cli("train", "--data", str(small_npz), *TINY, "--output-dir", str(tmp_path / "slurm"),
                       env={"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank),
                            "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": "4242", "MASTER_PORT": str(port)})
             for rank in (0, 1)]
    _finish(slurm)
    port = free_port()
    nodes = [start_cli("train", "--data", str(small_npz), *TINY, "--output-dir", str(tmp_path / "nodes"),
                       "--nproc", "1", "--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1",
                       "--master-port", str(port)) for rank in (0, 1)]
    _finish(nodes)
    for name in ("slurm", "nodes"):
        assert json.loads((tmp_path / name / "summary.json").read_text())["world_size"] == 2, name
        weights = load_file(tmp_path / name / "last.safetensors")
        assert all(torch.equal(weights[k], reference[k]) for k in reference), f"{name} trained differently"


NOTEBOOK = """
import sys
from accelerate import notebook_launcher
import scaletrain

config = scaletrain.TrainConfig()
config.data.data, config.run.output_dir = sys.argv[1], sys.argv[2]
config.model.model, config.optim.epochs, config.optim.batch_size, config.run.log_every = "tinycnn", 2, 16, 5
notebook_launcher(scaletrain.train, args=(config,), num_processes=2)
"""


def test_notebook_launcher_with_the_python_api_trains_like_torchrun(two_process_run, small_npz, tmp_path):
    script = tmp_path / "notebook.py"
    script.write_text(NOTEBOOK)
    proc = run_cli(str(small_npz), str(tmp_path / "nb"), launcher=[sys.executable], module=str(script))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "nb" / "summary.json").read_text())["world_size"] == 2
    reference = load_file(two_process_run[0] / "last.safetensors")
    weights = load_file(tmp_path / "nb" / "last.safetensors")
    assert all(torch.equal(weights[k], reference[k]) for k in reference)


def test_slurm_node_lists_give_the_first_host():
    from scaletrain.parallel import first_host

    assert first_host("node[01-03,07],gpu5") == "node01"
    assert first_host("gpu5,gpu6") == "gpu5"
    assert first_host("localhost") == "localhost"
    assert first_host("n[9-10]-ib") == "n9-ib"


def test_a_loss_that_diverges_stops_every_rank(small_npz, tmp_path):
    proc = run_cli("train", "--data", str(small_npz), *TINY, "--lr", "1e12", "--momentum", "0", "--nproc", "2",
                   "--output-dir", str(tmp_path / "run"), timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.count("scaletrain: error: training loss became") == 1, proc.stderr
    assert not (tmp_path / "run" / "summary.json").exists()


def test_sync_bn_on_cpu_makes_two_processes_train_like_one_with_the_same_global_batch(tmp_path, mnist):
    """With SyncBN and the same --global-batch-size (1 x 32 or 2 x 16), 2 processes reach the weights of 1."""
    data = tmp_path / "s384.npz"
    import numpy as np

    np.savez(data, images=mnist.images[:384, 0].numpy(), labels=mnist.labels[:384].numpy(),
             val_images=mnist.images[400:450, 0].numpy(), val_labels=mnist.labels[400:450].numpy())
    common = ["--data", str(data), "--model", "tinycnn", "--epochs", "1", "--augment", "none", "--lr", "0.01",
              "--no-channels-last", "--log-every", "4"]
    runs = {"one": ["--global-batch-size", "32"],
            "sync": ["--global-batch-size", "32", "--nproc", "2", "--sync-bn"],
            "plain": ["--global-batch-size", "32", "--nproc", "2"]}
    weights = {}
    for name, extra in runs.items():
        proc = run_cli("train", *common, *extra, "--output-dir", str(tmp_path / name))
        assert proc.returncode == 0, proc.stderr[-2000:]
        weights[name] = load_file(tmp_path / name / "last.safetensors")
    assert json.loads((tmp_path / "sync" / "summary.json").read_text())["batch_size_per_device"] == 16

    def gap(a, b):
        return max((a[k].float() - b[k].float()).abs().max().item() for k in a)

    assert gap(weights["one"], weights["sync"]) < 1e-4
    assert gap(weights["one"], weights["plain"]) > 1e-3, "without SyncBN the statistics are per process"


def test_a_dataparallel_replica_computes_in_the_jobs_precision_inside_its_own_thread():
    # torch starts each DataParallel replica in a new thread under autocast with the device's default dtype
    # (fp16 on CUDA, bf16 on the CPU); the replica must still compute in the dtype the job asked for.
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

    for call, expected in ((replica, torch.bfloat16), (in_autocast(replica, "cpu", torch.float16), torch.float16)):
        thread = threading.Thread(target=worker, args=(call,))
        thread.start()
        thread.join()
        assert seen["default"] == torch.bfloat16 and seen["dtype"] == expected and seen["out"].dtype == expected
