"""Start-up on folders of many small images: how the time to the first training step grows with the file count.

Makes (once, reused) class folders of small colour JPEGs (32 x 32 px, about 1 KB each, 10 classes) with 20,000
and 200,000 files, reads every file once so the page cache is warm, then for each folder runs

    scaletrain train --data FOLDER --model tinycnn --image-size 32 --epochs 1 --batch-size 256

twice with the same empty --cache-dir: the first run checks and decodes every file; the second finds each
file's check and the decoded pixels in the cache and reads no image. Records the seconds from launch to the
end of the first optimizer step (scaletrain's `first step done` line) and the per-file cost of the first run's
start beyond the second's. The training itself is cut short after the first step (SIGTERM, then a checkpoint).

    python benchmarks/many_files.py                       # 20,000 and 200,000 files
    python benchmarks/many_files.py --counts 2000 --out /tmp/smoke.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CLASSES = 10


def _write(job: tuple[str, int]) -> int:
    from PIL import Image

    path, seed = job
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:32, 0:32]
    base = np.stack([(x * (seed % 7 + 1)) % 256, (y * (seed % 5 + 2)) % 256, (x + y + seed) % 256], -1)
    Image.fromarray(np.clip(base + rng.integers(0, 40, base.shape), 0, 255).astype(np.uint8)).save(path, quality=90)
    return os.path.getsize(path)


def make_folder(root: Path, files: int) -> dict:
    stamp = root / "made.json"
    if stamp.is_file() and json.loads(stamp.read_text()).get("files") == files:
        return json.loads(stamp.read_text())
    for c in range(CLASSES):
        (root / f"class_{c}").mkdir(parents=True, exist_ok=True)
    jobs = [(str(root / f"class_{i % CLASSES}" / f"{i:07d}.jpg"), i) for i in range(files)]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        sizes = list(pool.map(_write, jobs, chunksize=256))
    made = {"files": files, "mean_kb": sum(sizes) / len(sizes) / 1024, "seconds_to_make": time.perf_counter() - t0}
    stamp.write_text(json.dumps(made))
    return made


def first_step(root: Path, work: Path, cache: Path, name: str, env: dict) -> dict:
    """Seconds to the first optimizer step of `scaletrain train` on `root`; stopped right after it."""
    cmd = [sys.executable, "-m", "scaletrain", "train", "--data", str(root), "--model", "tinycnn", "--image-size",
           "32", "--epochs", "1", "--batch-size", "256", "--cache-dir", str(cache), "--output-dir", str(work / name)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    seen, said, tail = None, None, []
    for line in proc.stdout:  # type: ignore[union-attr]
        tail = (tail + [line.rstrip()])[-10:]
        if seen is None and "first step done" in line:
            seen, said = time.perf_counter() - t0, line.strip()
            proc.send_signal(signal.SIGTERM)
    code = proc.wait()
    own = re.search(r"first step done ([\d.]+) s", said or "")
    return {"first_step_s": seen, "first_step_said_s": float(own.group(1)) if own else None, "exit_code": code,
            "log_tail": tail if seen is None else []}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--counts", default="20000,200000", help="file counts, comma-separated [default: 20000,200000]")
    p.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "scaletrain-small",
                   help="folders are made (and kept) at <data-dir>-<count>")
    p.add_argument("--out", type=Path, default=HERE / "results" / "many_files_cpu.json")
    args = p.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"),
                                                        os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    results = {}
    for count in (int(c) for c in args.counts.split(",")):
        root = args.data_dir.with_name(f"{args.data_dir.name}-{count}")
        made = make_folder(root, count)
        for path in root.rglob("*.jpg"):  # warm page cache for both runs
            path.read_bytes()
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            first = first_step(root, work, work / "cache", "first", env)
            second = first_step(root, work, work / "cache", "second", env)
        r = {"made": made, "first_run": first, "second_run": second}
        if first["first_step_s"] and second["first_step_s"]:
            r["check_ms_per_file"] = 1000 * (first["first_step_s"] - second["first_step_s"]) / count
        results[str(count)] = r
        print(f"{count} files: first step {first['first_step_s'] or float('nan'):.1f} s on the first run, "
              f"{second['first_step_s'] or float('nan'):.1f} s on the second; "
              f"{r.get('check_ms_per_file', float('nan')):.3f} ms per file checked", flush=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "cpu_cores": os.cpu_count(), "command": " ".join(sys.argv)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(r["first_run"]["exit_code"] in (0, 75) and r["second_run"]["exit_code"] in (0, 75)
                    for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
