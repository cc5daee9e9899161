"""Training from object storage against training from a local disk, in the same run: `scaletrain train` on data
prepared twice from the same images, once as local shards (`prepare --output DIR`) and once as LitData chunks in
an S3-compatible server on loopback (`prepare --output s3://...`, moto's server in this process).

Two figures:

- throughput: images/s of one training epoch (metrics.csv's images_per_second), streamed with a cache of a
  quarter of the dataset (`--cache-limit`) against the local shards, and the same chunks read from a local folder
  (what the stream costs without the server), taking turns for `--rounds` rounds; the median ratios to the
  local shards (chunks of 2 MB);
- time to the first step: "first step done N s after launch", for `--first-mb` MB of prepared images with a
  128 MB cache (chunks of 8 MB), against the same images as local shards (each run stopped once its first step
  is done).

The images are smooth colour gradients plus seeded noise, labels 0..9. Results go to benchmarks/results/ as JSON.

    python benchmarks/stream_s3.py                      # about 10 minutes on 2 cores
    python benchmarks/stream_s3.py --train-mb 64 --first-mb 256 --rounds 1   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SIDE = 64  # images are 3 x SIDE x SIDE


def images(mb: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    n = max(20, mb * 2**20 // (3 * SIDE * SIDE))
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n)
    ramp = np.linspace(0, 1, SIDE, dtype=np.float32)
    base = (labels[:, None, None, None] / 10 * 255 * ramp[None, None, None, :]).astype(np.float32)
    noise = rng.integers(0, 40, (n, 3, SIDE, SIDE), dtype=np.uint8)
    return (np.broadcast_to(base, (n, 3, SIDE, SIDE)) * 0.8 + noise).astype(np.uint8), labels


def cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "scaletrain", *args], capture_output=True, text=True,
                          env={**os.environ, **env})
    if proc.returncode:
        raise SystemExit(f"scaletrain {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return proc


def prepare_both(env: dict, root: Path, name: str, mb: int, chunk: str) -> tuple[str, str, int]:
    """(local shards folder, s3 url, bytes of training images) of `mb` MB of images."""
    x, y = images(mb, seed=mb)
    npz = root / f"{name}.npz"
    cut = len(x) * 9 // 10
    np.savez(npz, images=x[:cut], labels=y[:cut], val_images=x[cut:], val_labels=y[cut:])
    local = root / f"{name}-shards"
    cli(env, "prepare", "--data", str(npz), "--output", str(local), "--shard-size-mb", "64")
    cli(env, "prepare", "--data", str(npz), "--output", f"s3://bench/{name}", "--chunk-size", chunk)
    cli(env, "prepare", "--data", str(npz), "--output", str(root / f"{name}-chunks"), "--chunks", "--chunk-size", chunk)
    npz.unlink()
    return str(local), f"s3://bench/{name}", cut * 3 * SIDE * SIDE


def throughput(env: dict, data: str, root: Path, extra: list[str]) -> float:
    out = Path(tempfile.mkdtemp(dir=root))
    cli(env, "train", "--data", data, "--model", "tinycnn", "--epochs", "1", "--batch-size", "64",
        "--output-dir", str(out), "--cache-dir", str(root / "cache"), *extra)
    rows = (out / "metrics.csv").read_text().splitlines()
    value = float(rows[1].split(",")[rows[0].split(",").index("images_per_second")])
    shutil.rmtree(out)
    return value


def first_step(env: dict, data: str, root: Path, extra: list[str]) -> float:
    out = Path(tempfile.mkdtemp(dir=root))
    proc = subprocess.Popen([sys.executable, "-m", "scaletrain", "train", "--data", data, "--model", "tinycnn",
                             "--epochs", "1", "--batch-size", "64", "--output-dir", str(out), "--cache-dir",
                             str(root / "cache"), *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, **env})
    seconds = None
    for line in proc.stdout:  # type: ignore[union-attr]
        if line.startswith("first step done"):
            seconds = float(line.split()[3])
            break
    proc.kill()
    proc.wait()
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(root / "cache" / "chunks", ignore_errors=True)  # the next one starts with an empty cache
    if seconds is None:
        raise SystemExit(f"no first step from {data}")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train-mb", type=int, default=256, help="images for the throughput runs")
    ap.add_argument("--first-mb", type=int, default=1024, help="images for the time to the first step (0: skip)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "stream_s3.json"))
    args = ap.parse_args()

    import boto3
    from moto.server import ThreadedMotoServer

    sys.path.insert(0, str(HERE.parent / "tests"))
    from helpers import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1", "OMP_NUM_THREADS": "2"}
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="bench",
                          aws_secret_access_key="bench", region_name="us-east-1")
    client.create_bucket(Bucket="bench")
    root = Path(tempfile.mkdtemp(prefix="stream-s3-"))
    result: dict = {"date": str(date.today()), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                    "command": "python benchmarks/stream_s3.py " + " ".join(sys.argv[1:])}
    try:
        local, remote, nbytes = prepare_both(env, root, "small", args.train_mb, "2MB")
        cache = str(nbytes // 4)
        runs: dict[str, list[float]] = {"local": [], "s3": [], "local_chunks": []}
        for _ in range(args.rounds):
            runs["local"].append(throughput(env, local, root, []))
            runs["s3"].append(throughput(env, remote, root, ["--cache-limit", cache]))
            runs["local_chunks"].append(throughput(env, str(root / "small-chunks"), root, []))
        ratios = [s / loc for s, loc in zip(runs["s3"], runs["local"])]
        result["throughput"] = {"train_bytes": nbytes, "cache_limit": int(cache), "images_per_second": runs,
                                "ratio_median": statistics.median(ratios), "ratios": ratios,
                                "local_chunks_ratio_median": statistics.median(
                                    c / loc for c, loc in zip(runs["local_chunks"], runs["local"]))}
        print(json.dumps(result["throughput"]), flush=True)
        if args.first_mb:
            local, remote, nbytes = prepare_both(env, root, "big", args.first_mb, "8MB")
            firsts: dict[str, list[float]] = {"local": [], "s3": []}
            for _ in range(args.rounds):
                firsts["local"].append(first_step(env, local, root, []))
                firsts["s3"].append(first_step(env, remote, root, ["--cache-limit", "128MB"]))
            result["first_step"] = {"train_bytes": nbytes, "cache_limit": "128MB", "seconds": firsts,
                                    "median": {k: statistics.median(v) for k, v in firsts.items()}}
            print(json.dumps(result["first_step"]), flush=True)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
