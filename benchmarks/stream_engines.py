"""Streaming from object storage against the engines users would pick, in one run: the same images, the same
S3-compatible server on loopback, the same cache limit (a quarter of the training images), one training epoch of
the same network (`--model tinycnn`, batch 64, scaletrain's SGD) and the same batch transform, each contender a
fresh process:

- `litdata`: LitData alone, a plain loop over `StreamingDataset` + `StreamingDataLoader` (`--workers` DataLoader
  workers, default 2, scaletrain's `--num-workers` default) reading the very chunks `scaletrain prepare --chunks`
  wrote, with `max_cache_size` = the cache limit, reading S3 as it ships (LitData 0.2.76: through obstore, whose
  client is told to allow plain http, as these servers speak; LitData has no setting of its own for it);
- `litdata-w0`: the same loop reading in the training process (no workers), as scaletrain reads its chunks;
- `scaletrain`: `scaletrain train --data s3://... --cache-limit N --model tinycnn --epochs 1 --batch-size 64`
  over the same chunks (its own images/s from metrics.csv);
- `webdataset`: WebDataset over tar shards of the same images (`.npy` + `.cls`, shards as large as the chunks) on
  the same server, read through boto3 (a gopen handler for s3://, as WebDataset has none) with its own cache
  (`cache_dir`, `cache_size` = the cache limit; its cache clean-up made to run before every download instead of
  at most every 30 s, so that the limit holds in a short epoch), shard shuffle and a one-shard sample shuffle
  buffer, `WebLoader` with `--workers` workers.

The plain loops take the network from scaletrain's model registry and the batch transform (uint8 -> float,
scaletrain's `crop` augmentation of the digits recipe, normalisation by the prepared statistics, channels_last)
from scaletrain.data.transforms, so the compute per batch is scaletrain's; what differs is the reading and the
loop around it. The servers: moto's ThreadedMotoServer (in this process, as in stream_s3.py), s3rver (npm, Node,
objects as files; skipped when its binary is not found) and no server at all, the same files on the local disk
(`local disk`: each engine's ceiling here). Each server is started here on 127.0.0.1 and stopped in a `finally`.
Every run starts with an empty cache.

Figures: images/s over the training epoch (from the start of reading to the last optimizer step, as scaletrain's
metrics.csv counts it), and the time to the first step: from launching the command to the line that says its
first optimizer step is done, as this script sees it (scaletrain's own "first step done N s after launch" is
kept beside it); the CPU seconds of the contender's processes, of the server, and of any other process on the
machine meanwhile (`others_cpu_s`: another job timing itself shows there). The contenders take turns in each of
`--rounds` rounds (the order of servers and engines rotated each round); medians per contender and server, and
each one's ratio to LitData alone on the same server. Results go to benchmarks/results/stream_engines.json.

    npm install --prefix /work/tools/s3rver s3rver@3.7.1   # the second server (optional; or --s3rver PATH)
    pip install webdataset==1.0.2                          # the third engine (optional: --engines without it)
    python benchmarks/stream_engines.py                    # 128 MB of images, 3 rounds: about 12 minutes here
    python benchmarks/stream_engines.py --mb 48 --rounds 1 --chunk-size 1MB   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests"), str(HERE.parent / "src")]
from cpu_limit import cpu_name  # noqa: E402
from helpers import free_port  # noqa: E402
from stream_s3 import images  # noqa: E402

from scaletrain.config import parse_size  # noqa: E402

SIDE = 64  # images are 3 x SIDE x SIDE
BATCH = 64
BUCKET = "bench"
S3RVER_DEFAULT = "/work/tools/s3rver/node_modules/.bin/s3rver"
ENGINES = ("litdata", "litdata-w0", "scaletrain", "webdataset")


# -- the servers -----------------------------------------------------------------------------------------------
class Moto:
    name, key = "moto", "bench"

    def start(self) -> str:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
        port = free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self.server.start()
        return f"http://127.0.0.1:{port}"

    def cpu_seconds(self) -> float:
        """This process's CPU time: the server's threads, and this script's own (reading pipes, little)."""
        t = os.times()
        return t.user + t.system

    def stop(self) -> None:
        self.server.stop()


class S3rver:
    """npm's s3rver (Node), objects as files under a temporary folder; its fixed credentials."""
    name, key = "s3rver", "S3RVER"

    def __init__(self, binary: str):
        self.binary, self.proc, self.folder = binary, None, None

    def start(self) -> str:
        port = free_port()
        self.folder = tempfile.mkdtemp(prefix="s3rver-")
        self.proc = subprocess.Popen([self.binary, "-d", self.folder, "-a", "127.0.0.1", "-p", str(port), "-s"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                if self.proc.poll() is not None:
                    raise SystemExit(f"{self.binary} exited with {self.proc.returncode}")
                time.sleep(0.05)
        return f"http://127.0.0.1:{port}"

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)


class Local:
    """No server: the same chunks and shards read from the local disk (the ceiling of each engine here)."""
    name, key = "local disk", "none"

    def start(self) -> str:
        return ""

    def cpu_seconds(self) -> float:
        return 0.0

    def stop(self) -> None:
        pass


def server_env(url: str, key: str) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": key,
            "AWS_DEFAULT_REGION": "us-east-1", "OMP_NUM_THREADS": str(os.cpu_count() or 1)}


def upload(env: dict, folder: Path, prefix: str) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")
    try:
        client.create_bucket(Bucket=BUCKET)
    except (client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
        pass
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), BUCKET, f"{prefix}/{path.relative_to(folder).as_posix()}")


# -- the data --------------------------------------------------------------------------------------------------
def prepare(root: Path, mb: int, chunk: str, shards: bool = True) -> dict:
    """LitData chunks by `scaletrain prepare --chunks` and (`shards`) WebDataset tar shards of the same training
    images."""
    x, y = images(mb, seed=mb)
    cut = len(x) * 9 // 10
    npz = root / "images.npz"
    np.savez(npz, images=x[:cut], labels=y[:cut], val_images=x[cut:], val_labels=y[cut:])
    chunks = root / "chunks"
    proc = subprocess.run([sys.executable, "-m", "scaletrain", "prepare", "--data", str(npz), "--output", str(chunks),
                           "--chunks", "--chunk-size", chunk], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"scaletrain prepare failed:\n{proc.stderr[-3000:]}")
    npz.unlink()
    tars = root / "wds"
    tars.mkdir()
    if shards:  # WebDataset is needed for its engine only
        import webdataset as wds

        with wds.ShardWriter(str(tars / "train-%06d.tar"), maxsize=parse_size(chunk, "--chunk-size"),
                             verbose=0) as sink:
            for i in range(cut):
                sink.write({"__key__": f"{i:08d}", "npy": x[i], "cls": int(y[i])})
    manifest = json.loads((chunks / "prepared.json").read_text())
    return {"count": cut, "train_bytes": cut * 3 * SIDE * SIDE, "mean_std": manifest["mean_std"],
            "chunk_files": len([p for p in (chunks / "train").iterdir() if p.suffix == ".bin"]),
            "shards": sorted(p.name for p in tars.iterdir()), "chunk_bytes": manifest["chunk_bytes"]}


# -- the contenders, each in a fresh process -------------------------------------------------------------------
def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (all processes), from /proc/stat; 0 where there is none."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def launch(cmd: list[str], env: dict, server) -> dict:
    """Run `cmd`; the seconds from launching it to its "first step done" line, its last RESULT line, and the CPU
    seconds it took (with its DataLoader workers) and the server took meanwhile."""
    start, before, server_before = time.perf_counter(), os.times(), server.cpu_seconds()
    busy_before = machine_busy_seconds()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **env})
    first, own_first, result, tail = None, None, None, []
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            if first is None and line.startswith("first step done"):
                first = time.perf_counter() - start
                own_first = float(line.split()[3]) if len(line.split()) > 3 else None
            if line.startswith("RESULT "):
                result = json.loads(line[7:])
            tail = (tail + [line])[-40:]
        proc.wait()
    finally:
        if proc.poll() is None:  # interrupted: nothing is left running
            proc.kill()
            proc.wait()
    after = os.times()
    busy = machine_busy_seconds() - busy_before
    if proc.returncode or first is None:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{''.join(tail)}")
    cpu = after.children_user + after.children_system - before.children_user - before.children_system
    server_cpu = server.cpu_seconds() - server_before
    return {"first_step_s": first, "own_first_step_s": own_first, "wall_s": time.perf_counter() - start,
            "cpu_s": cpu, "server_cpu_s": server_cpu, "others_cpu_s": max(0.0, busy - cpu - server_cpu),
            **(result or {})}


def run_scaletrain(env: dict, root: Path, cache_limit: int, workers: int, server) -> dict:
    out, cache = root / "out-scaletrain", root / "cache-scaletrain"
    for p in (out, cache):
        shutil.rmtree(p, ignore_errors=True)
    data = str(root / "chunks") if isinstance(server, Local) else f"s3://{BUCKET}/chunks"
    got = launch([sys.executable, "-m", "scaletrain", "train", "--data", data, "--model",
                  "tinycnn", "--epochs", "1", "--batch-size", str(BATCH), "--cache-limit", str(cache_limit),
                  "--cache-dir", str(cache), "--output-dir", str(out), "--num-workers", str(workers)], env, server)
    rows = (out / "metrics.csv").read_text().splitlines()
    head, row = rows[0].split(","), rows[1].split(",")
    got["images_per_second"] = float(row[head.index("images_per_second")])
    got["epoch_seconds"] = float(row[head.index("epoch_seconds")])
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    return got


def run_plain(engine: str, env: dict, root: Path, cache_limit: int, workers: int, data: dict, server) -> dict:
    cache = root / f"cache-{engine}"
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir()
    spec = {"engine": engine, "cache_dir": str(cache), "cache_limit": cache_limit, "workers": workers,
            "location": str(root) if isinstance(server, Local) else f"s3://{BUCKET}",
            "mean_std": data["mean_std"], "shards": data["shards"], "count": data["count"]}
    got = launch([sys.executable, str(Path(__file__).resolve()), "--one", json.dumps(spec)], env, server)
    got["images_per_second"] = got["images"] / got["epoch_seconds"]
    shutil.rmtree(cache, ignore_errors=True)
    return got


# -- the plain loops (run by --one) ----------------------------------------------------------------------------
def plain_loop(spec: dict) -> None:
    import torch
    import torch.nn.functional as F

    from scaletrain.data.transforms import Preprocess, augment_seed, to_model_input
    from scaletrain.models import build_model

    torch.manual_seed(0)
    model = build_model("tinycnn", 3, 10).to(memory_format=torch.channels_last)
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": 5e-4}, {"params": no_decay, "weight_decay": 0}],
                                lr=0.05, momentum=0.9, nesterov=True)
    mean, std = spec["mean_std"]
    pre = Preprocess(3, SIDE, list(mean), list(std))
    steps = -(-spec["count"] // BATCH)
    loader = (webdataset_loader if spec["engine"] == "webdataset" else litdata_loader)(spec)
    model.train()
    images, first = 0, True
    t0 = time.perf_counter()
    for i, (x, y) in enumerate(loader):
        x = to_model_input(x, pre, True, ("crop",), torch.Generator().manual_seed(augment_seed(0, 0, 0, i)))
        for group in optimizer.param_groups:  # a rate set each step, as scaletrain's one-cycle schedule does
            group["lr"] = 0.05 * min((i + 1) / (steps / 2 + 1), max(0.0, 1 - (i - steps / 2) / (steps / 2)))
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        images += len(x)
        if first:
            print("first step done", flush=True)
            first = False
    seconds = time.perf_counter() - t0
    print("RESULT " + json.dumps({"images": images, "epoch_seconds": seconds, "loss": float(loss)}), flush=True)


def litdata_loader(spec: dict):
    from litdata import StreamingDataLoader, StreamingDataset
    from litdata.streaming import downloader

    # LitData reads S3 through obstore, whose client refuses plain http (these servers) unless told to allow it;
    # LitData passes its own client options, so obstore's AWS_ALLOW_HTTP is not read: the one option added there
    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"
    remote = spec["location"].startswith("s3://")
    dataset = StreamingDataset(f"{spec['location']}/chunks/train", cache_dir=spec["cache_dir"] if remote else None,
                               shuffle=True, drop_last=True, seed=0, max_cache_size=spec["cache_limit"])
    workers = 0 if spec["engine"] == "litdata-w0" else spec["workers"]
    loader = StreamingDataLoader(dataset, batch_size=BATCH, num_workers=workers)
    return ((batch["image"], batch["label"]) for batch in loader)


def webdataset_loader(spec: dict):
    import boto3
    import torch
    import webdataset as wds
    gopen = sys.modules["webdataset.gopen"]

    clients: dict[int, object] = {}  # one boto3 client per process (the DataLoader workers are forked)

    def s3_open(url, mode="rb", bufsize=8192, **kw):
        bucket, _, key = url[len("s3://"):].partition("/")
        if os.getpid() not in clients:
            clients[os.getpid()] = boto3.client("s3")
        return clients[os.getpid()].get_object(Bucket=bucket, Key=key)["Body"]

    gopen.gopen_schemes["s3"] = s3_open
    urls = [f"{spec['location']}/wds/{name}" for name in spec["shards"]]
    per_shard = max(1, spec["count"] // len(urls))
    dataset = wds.WebDataset(urls, shardshuffle=len(urls), cache_dir=spec["cache_dir"],
                             cache_size=spec["cache_limit"], seed=0, empty_check=False)
    for stage in dataset.pipeline:  # keep the limit in a short epoch: clean before every download
        if getattr(stage, "cleaner", None) is not None:
            stage.cleaner.interval = 0
    dataset = dataset.shuffle(per_shard).decode().to_tuple("npy", "cls").batched(BATCH, partial=True)
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=spec["workers"])
    return ((torch.as_tensor(x), torch.as_tensor(y)) for x, y in loader)


# -- the table -------------------------------------------------------------------------------------------------
def table(result: dict) -> str:
    """Medians per server and engine; "x LitData alone": against `litdata` on the same server; "x local disk":
    against the same engine reading the same files from the local disk (what the server and the transfer cost)."""
    lines = ["| server | engine | images/s | x LitData alone | x local disk | first step, s | x LitData alone | "
             "CPU s (server) | images/s values | first step values |", "|---|---|---|---|---|---|---|---|---|---|"]
    local = result["medians"].get("local disk", {})
    for server, engines in result["runs"].items():
        base = result["medians"][server].get("litdata")
        for engine in engines:
            m = result["medians"][server][engine]
            ratio = f"{m['images_per_second'] / base['images_per_second']:.3f}" if base else ""
            own = local.get(engine)
            lratio = f"{m['images_per_second'] / own['images_per_second']:.2f}" if own and server != "local disk" \
                else ""
            fratio = f"{m['first_step_s'] / base['first_step_s']:.2f}" if base else ""
            values = ", ".join(f"{r['images_per_second']:,.0f}" for r in engines[engine])
            fvalues = ", ".join(f"{r['first_step_s']:.1f}" for r in engines[engine])
            lines.append(f"| {server} | {engine} | {m['images_per_second']:,.0f} | {ratio} | {lratio} | "
                         f"{m['first_step_s']:.1f} | {fratio} | {m['cpu_s']:.1f} ({m['server_cpu_s']:.1f}) | "
                         f"{values} | {fvalues} |")
    return "\n".join(lines)


def versions(s3rver: str | None) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "litdata", "webdataset", "moto", "boto3"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    if s3rver:
        package = Path(s3rver).resolve().parent.parent / "package.json"
        if package.exists():
            found["s3rver"] = json.loads(package.read_text()).get("version", "")
    found["node"] = subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip() \
        if shutil.which("node") else ""
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=128, help="MB of 3x64x64 uint8 images (90 %% train)")
    ap.add_argument("--chunk-size", default="2MB", help="LitData chunk and tar shard size")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--servers", default="moto,s3rver,local", help="local: the same files on the local disk")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers of the plain loops and of "
                                                           "scaletrain's --num-workers")
    ap.add_argument("--s3rver", default=os.environ.get("S3RVER", S3RVER_DEFAULT), help="s3rver's binary")
    ap.add_argument("--out", default=str(HERE / "results" / "stream_engines.json"))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: one plain loop, in its own process
    args = ap.parse_args()
    if args.one:
        return plain_loop(json.loads(args.one))

    engines = [e for e in args.engines.split(",") if e]
    servers = []
    for name in args.servers.split(","):
        if name == "moto":
            servers.append(Moto())
        elif name == "local":
            servers.append(Local())
        elif name == "s3rver":
            binary = shutil.which(args.s3rver) or (args.s3rver if os.access(args.s3rver, os.X_OK) else None)
            if binary is None:
                print(f"s3rver: {args.s3rver} not found, skipped (npm install s3rver)", flush=True)
            else:
                servers.append(S3rver(binary))
    root = Path(tempfile.mkdtemp(prefix="stream-engines-"))
    result: dict = {"date": str(date.today()), "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                    f"{cpu_name()}",
                    "command": "python benchmarks/stream_engines.py " + " ".join(sys.argv[1:]),
                    "settings": {"mb": args.mb, "chunk_size": args.chunk_size, "workers": args.workers,
                                 "batch": BATCH, "model": "tinycnn"},
                    "versions": versions(next((x.binary for x in servers if isinstance(x, S3rver)), None)),
                    "runs": {}}
    started: list = []
    try:
        data = prepare(root, args.mb, args.chunk_size, shards="webdataset" in engines)
        cache_limit = data["train_bytes"] // 4
        result["data"] = {k: v for k, v in data.items() if k not in ("shards", "mean_std")}
        result["data"].update(shards=len(data["shards"]), cache_limit=cache_limit)
        print(json.dumps(result["data"]), flush=True)
        envs = {}
        for server in servers:  # all of them up at once, so that the rounds take turns across servers too
            url = server.start()
            started.append(server)
            result["runs"][server.name] = {e: [] for e in engines}
            if isinstance(server, Local):
                envs[server.name] = {"OMP_NUM_THREADS": str(os.cpu_count() or 1)}
                continue
            envs[server.name] = server_env(url, server.key)
            upload(envs[server.name], root / "chunks", "chunks")
            upload(envs[server.name], root / "wds", "wds")
        for r in range(args.rounds):
            for server in servers[r % len(servers):] + servers[:r % len(servers)]:
                env = envs[server.name]
                for engine in engines[r % len(engines):] + engines[:r % len(engines)]:
                    if engine == "scaletrain":
                        got = run_scaletrain(env, root, cache_limit, args.workers, server)
                    else:
                        got = run_plain(engine, env, root, cache_limit, args.workers, data, server)
                    result["runs"][server.name][engine].append(got)
                    print(f"round {r + 1} {server.name} {engine}: {got['images_per_second']:,.0f} images/s, "
                          f"first step {got['first_step_s']:.1f} s, CPU {got['cpu_s']:.1f} s (server "
                          f"{got['server_cpu_s']:.1f} s; other processes {got['others_cpu_s']:.1f} s), whole command "
                          f"{got['wall_s']:.1f} s", flush=True)
    finally:
        for server in started:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)
    keys = ("images_per_second", "first_step_s", "cpu_s", "server_cpu_s", "others_cpu_s", "wall_s")
    result["medians"] = {s: {e: {k: statistics.median(r[k] for r in v) for k in keys} for e, v in runs.items()}
                         for s, runs in result["runs"].items()}
    result["table"] = table(result)
    print(result["table"])
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
