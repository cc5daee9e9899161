"""Chunked data in object storage, streamed by LitData: `scaletrain prepare --output s3://...` into an S3-compatible
server on loopback (moto's, a real HTTP server), then `scaletrain train --data s3://...` on 1 and 2 processes
with a cache a quarter of the dataset's size, sampled while it runs; a damaged and a missing chunk refused by
key; the server stopped mid-epoch and started again, and the run resumed to the bits of an uninterrupted one; a
chunk that never comes (a server on loopback in front of moto's that holds its requests) named with the server
once SCALETRAIN_CHUNK_TIMEOUT has passed."""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from helpers import free_port, run_python

pytest.importorskip("litdata")
boto3 = pytest.importorskip("boto3")
moto_server = pytest.importorskip("moto.server")

LIMIT = 320_000  # bytes: a quarter of the 1.25 MB of training images
ARGS = ["--model", "tinycnn", "--epochs", "1", "--batch-size", "32", "--cache-limit", str(LIMIT), "--lr", "0.02"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A moto server on loopback (its objects live in this process, so it can stop and start again holding
    them), with s3://data/digits prepared from 1,600 + 400 MNIST digits in chunks of 32 KB."""
    from scaletrain.data import load_image_sets

    train, val = load_image_sets("default")
    npz = tmp_path_factory.mktemp("digits") / "digits.npz"
    np.savez(npz, images=train.images[:1600].numpy(), labels=train.labels[:1600].numpy(),
             val_images=val.images[:400].numpy(), val_labels=val.labels[:400].numpy())
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="test",
                          aws_secret_access_key="test", region_name="us-east-1")
    client.create_bucket(Bucket="data")
    proc = _cli(env, "prepare", "--data", str(npz), "--output", "s3://data/digits", "--chunk-size", "32KB")
    assert proc.returncode == 0, proc.stderr
    yield type("Store", (), {"env": env, "client": client, "server": server, "port": port})
    server.stop()


def _cli(env, *args) -> subprocess.CompletedProcess:
    return run_python([sys.executable, "-m", "scaletrain", *args], timeout=600, env=env)


def _train(store, out: Path, cache: Path, *extra: str, data: str = "s3://data/digits") -> tuple:
    """Train in a fresh process while sampling the size of the chunk cache; (the process, the largest size)."""
    most, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            most[0] = max(most[0], _size(cache / "chunks"))
            time.sleep(0.02)

    watcher = threading.Thread(target=sample)
    watcher.start()
    try:
        proc = _cli(store.env, "train", "--data", data, *ARGS, "--cache-dir", str(cache), "--output-dir", str(out),
                    *extra)
    finally:
        done.set()
        watcher.join()
    return proc, most[0]


def _size(folder: Path) -> int:
    """Bytes of the chunks and LitData's index under `folder` (the small checked files beside them aside)."""
    total = 0
    for path in folder.rglob("*"):
        try:
            if path.is_file() and "files" not in path.parts:
                total += path.stat().st_size
        except OSError:  # deleted while we looked
            pass
    return total


@pytest.fixture(scope="module")
def uninterrupted(store, tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    proc, most = _train(store, root / "run", root / "cache")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "run", most, proc


def test_prepare_writes_chunks_with_their_checksums(store):
    manifest = json.loads(store.client.get_object(Bucket="data", Key="digits/prepared.json")["Body"].read())
    assert manifest["format"] == "scaletrain-chunks" and manifest["splits"]["train"]["count"] == 1600
    listed = {f"digits/{split}/{name}" for split, part in manifest["splits"].items() for name in part["files"]}
    stored = {o["Key"] for o in store.client.list_objects_v2(Bucket="data", Prefix="digits/")["Contents"]}
    assert stored == listed | {"digits/prepared.json"} and len(listed) > 40  # dozens of chunks


def test_training_streams_within_the_cache_limit_and_validates_every_sample(uninterrupted):
    run, most, proc = uninterrupted
    summary = json.loads((run / "summary.json").read_text())
    assert summary["val_samples"] == 400 and summary["best_val_accuracy"] > 0.5
    assert 0 < most <= LIMIT, f"the cache reached {most} bytes"


@pytest.mark.slow
def test_two_processes_stream_their_parts_within_the_limit(store, tmp_path):
    proc, most = _train(store, tmp_path / "run", tmp_path / "cache", "--nproc", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["val_samples"] == 400
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    assert rows[1].split(",")[rows[0].split(",").index("train_samples")] == "1600"
    assert 0 < most <= LIMIT, f"the cache reached {most} bytes"


def _copy(store, prefix: str) -> dict:
    """s3://data/<prefix>: a copy of s3://data/digits; returns its manifest."""
    for o in store.client.list_objects_v2(Bucket="data", Prefix="digits/")["Contents"]:
        store.client.copy_object(Bucket="data", Key=prefix + o["Key"][len("digits"):],
                                 CopySource={"Bucket": "data", "Key": o["Key"]})
    return json.loads(store.client.get_object(Bucket="data", Key="digits/prepared.json")["Body"].read())


def test_a_damaged_chunk_is_refused_by_its_key(store, tmp_path):
    manifest = _copy(store, "damaged")
    chunk = sorted(n for n in manifest["splits"]["train"]["files"] if n.endswith(".bin"))[5]
    body = bytearray(store.client.get_object(Bucket="data", Key=f"digits/train/{chunk}")["Body"].read())
    body[len(body) // 2] ^= 0xFF
    store.client.put_object(Bucket="data", Key=f"damaged/train/{chunk}", Body=bytes(body))
    proc, _ = _train(store, tmp_path / "run", tmp_path / "cache", data="s3://data/damaged")
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert f"s3://data/damaged/train/{chunk}: damaged" in last and "Traceback" not in proc.stderr


def test_a_missing_chunk_is_refused_by_its_key(store, tmp_path):
    manifest = _copy(store, "holed")
    chunk = sorted(n for n in manifest["splits"]["train"]["files"] if n.endswith(".bin"))[3]
    store.client.delete_object(Bucket="data", Key=f"holed/train/{chunk}")
    proc, _ = _train(store, tmp_path / "run", tmp_path / "cache", data="s3://data/holed")
    assert proc.returncode == 2
    assert f"s3://data/holed/train/{chunk}: missing" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_store_that_stops_answering_stops_with_a_checkpoint_and_resumes_to_the_same_bits(store, uninterrupted,
                                                                                            tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "run"

    def stop_when_reading():  # the server goes away once the first chunks are here
        while not any((cache / "chunks").rglob("chunk-*.bin")):
            time.sleep(0.01)
        time.sleep(0.3)
        store.server.stop()

    stopper = threading.Thread(target=stop_when_reading)
    stopper.start()
    try:
        proc, _ = _train(store, out, cache, "--checkpoint-every", "5")
    finally:
        stopper.join()
        store.server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=store.port, verbose=False)
        store.server.start()
    assert proc.returncode == 75, proc.stderr[-3000:]
    assert "does not answer" in proc.stderr and "run the same command again" in proc.stderr
    proc, _ = _train(store, out, cache, "--checkpoint-every", "5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = load_file(str(out / "last.safetensors")), load_file(str(uninterrupted[0] / "last.safetensors"))
    assert all(got[k].equal(want[k]) for k in want)


def test_an_unreachable_store_or_a_missing_dataset_is_one_line(store, tmp_path):
    nobody = {**store.env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}  # a port nothing listens on
    proc = _cli(nobody, "train", "--data", "s3://data/digits", *ARGS, "--output-dir", str(tmp_path / "a"))
    assert proc.returncode == 2 and "s3://data/digits: the object store does not answer" in proc.stderr
    proc = _cli(store.env, "train", "--data", "s3://data/elsewhere", *ARGS, "--output-dir", str(tmp_path / "b"))
    assert proc.returncode == 2 and "s3://data/elsewhere: cannot read prepared.json" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_evaluate_refuses_streamed_data_on_one_line(uninterrupted, tmp_path):
    proc = _cli({}, "prepare", "--output", str(tmp_path / "chunks"), "--chunks")
    assert proc.returncode == 0, proc.stderr
    proc = _cli({}, "evaluate", "--checkpoint", str(uninterrupted[0] / "last.safetensors"), "--data",
                str(tmp_path / "chunks"), "--split", "val")
    assert proc.returncode == 2 and "streamed for training only" in proc.stderr and "Traceback" not in proc.stderr


def test_litdatas_download_thread_does_not_wait_on_an_empty_queue_with_a_cache_limit():
    """LitData waits 0.1 s on its (nearly always empty) queue of forced downloads whenever its prefetch window is
    full, before it sees the reader's deletions: one stream then reads about a chunk per 0.1 s whatever the store
    answers. With scaletrain's registration the empty queue is passed over at once (a cache limit set)."""
    import queue
    from types import SimpleNamespace

    from litdata.streaming.reader import PrepareChunksThread

    from scaletrain.data.sources.chunks import _register_with_litdata

    _register_with_litdata()
    thread = SimpleNamespace(_max_cache_size=30 * 2**20, _force_download_queue=queue.Queue())
    t0 = time.perf_counter()
    for _ in range(10):
        PrepareChunksThread._force_download(thread)
    assert time.perf_counter() - t0 < 0.2  # LitData's own wait: 10 x 0.1 s


class _Holding:
    """An HTTP server on loopback in front of the store that passes requests on to it, but holds every request
    for a chunk after the first `passed` unanswered (a store that took the connection and never sends the chunk),
    until it is closed."""

    def __init__(self, port: int, passed: int):
        self.release, self.passed, lock = threading.Event(), passed, threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self._pass_on(head=True)

            def do_GET(self):
                self._pass_on(head=False)

            def _pass_on(self, head: bool):
                if "/chunk-" in self.path:
                    with lock:
                        outer.passed -= 1
                        held = outer.passed < 0
                    if held:
                        outer.release.wait()
                        self.close_connection = True
                        return
                upstream = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                upstream.request(self.command, self.path, headers=dict(self.headers))
                answer = upstream.getresponse()
                body = answer.read()
                self.send_response(answer.status)
                for key, value in answer.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", answer.getheader("Content-Length", str(len(body))) if head
                                 else str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)
                upstream.close()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def test_a_chunk_that_never_comes_stops_the_run_after_the_timeout_naming_the_chunk_and_the_server(store, tmp_path):
    """Chunks held mid-epoch: exit 75 with the training state saved (the same command resumes), on one line,
    seconds after the timeout (boto3 alone would wait minutes on a held request)."""
    holding = _Holding(store.port, passed=12)
    try:
        env = {**store.env, "AWS_ENDPOINT_URL": holding.url, "SCALETRAIN_CHUNK_TIMEOUT": "2"}
        t0 = time.perf_counter()
        proc = _cli(env, "train", "--data", "s3://data/digits", *ARGS, "--cache-dir", str(tmp_path / "cache"),
                    "--output-dir", str(tmp_path / "run"), "--checkpoint-every", "5")
        seconds = time.perf_counter() - t0
    finally:
        holding.close()
    assert proc.returncode == 75, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert re.search(rf"s3://data/digits/train/chunk-\d+-\d+\.bin: not downloaded from the object store at "
                     rf"{re.escape(holding.url)} within 2 s \(SCALETRAIN_CHUNK_TIMEOUT sets the wait\)", last), last
    assert "Traceback" not in proc.stderr and seconds < 60
    step = re.search(r"saved the training state at optimizer step (\d+): run the same command again", last)
    assert step and int(step.group(1)) > 0, last


def test_a_chunk_timeout_that_is_not_seconds_is_refused_on_one_line(monkeypatch):
    from scaletrain.data.sources.chunks import chunk_timeout
    from scaletrain.errors import UserError

    monkeypatch.setenv("SCALETRAIN_CHUNK_TIMEOUT", "soon")
    with pytest.raises(UserError, match=r"^SCALETRAIN_CHUNK_TIMEOUT=soon: expected the seconds a chunk may take "
                                        r"to arrive, a number above 0 \(default 300\)$"):
        chunk_timeout()
    monkeypatch.setenv("SCALETRAIN_CHUNK_TIMEOUT", "2.5")
    assert chunk_timeout() == 2.5
