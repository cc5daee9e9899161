"""A folder that decodes to more than --cache-memory: peak host memory and images/s, first and second run, beside
the same folder held in memory (the default limit, a quarter of this machine's memory). A class folder of photo-like
JPEGs of 500 x 375 (_data.photo_folder, kept), tinycnn at 224 px (each image kept at 256 x 256 for the crop),
batch 64, 2 epochs, 2 workers, each run a fresh process over an empty or a filled --cache-dir. "At rest": the same
command over a folder of 200 of the photos with --cache-memory 1MB (full batches, nothing held): the process's own
memory, its model's and its batches'; "above rest" is what holding the data costs it.

    python benchmarks/bounded_cache.py                      # 4,000 photos (786 MB decoded), limit 256MB
    python benchmarks/bounded_cache.py --files 8000 --limit 512MB
"""

from __future__ import annotations

import argparse

import _data
import _harness as h


def train(work, name: str, folder, cache: str, *extra: str) -> dict:
    out = work / name
    cmd = h.scaletrain("train", "--data", str(folder), "--model", "tinycnn", "--image-size", "224", "--epochs", "2",
                       "--batch-size", "64", "--num-workers", "2", "--cache-dir", str(work / cache),
                       "--output-dir", str(out), *extra)
    r = h.run(cmd, env=h.env(), memory=True, merge=True, log=work / name).check(name)
    rows = h.metrics(out)
    return {"run": name, "peak_rss_mib": r.peak_rss_mib, "images_per_second": [x["images_per_second"] for x in rows],
            "train_loss": [x["train_loss"] for x in rows]}


def entry() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=4000)
    p.add_argument("--limit", default="256MB")
    p.add_argument("--work", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    work = h.work_dir("bounded_cache", a.work)
    folder, small = work / "photos", work / "photos-200"
    _data.photo_folder(folder, a.files, size=(500, 375))
    _data.photo_folder(small, 200, size=(500, 375))
    _data.warm(folder)
    rest = train(work, "at rest", small, "cache-rest", "--cache-memory", "1MB")["peak_rss_mib"]
    rows = [train(work, f"{how}, {turn} run", folder, f"cache-{how}", *extra)
            for how, extra in (("held", []), (f"--cache-memory {a.limit}", ["--cache-memory", a.limit]))
            for turn in ("first", "second")]
    for r in rows:
        r["above_rest_mib"] = r["peak_rss_mib"] - rest
    decoded = a.files * 3 * 256 * 256 / 2**20
    shown = [{"run": r["run"], "peak host memory (MiB)": f"{r['peak_rss_mib']:,.0f}",
              "above rest (MiB)": f"{r['above_rest_mib']:,.0f}",
              "images/s per epoch": " / ".join(f"{v:,.0f}" for v in r["images_per_second"]),
              "train loss per epoch": " / ".join(f"{v:.4f}" for v in r["train_loss"])} for r in rows]
    h.record("bounded_cache", rows, a.out, f"{a.files:,} photos of 500 x 375 ({decoded:,.0f} MiB decoded), tinycnn "
             f"224 px, batch 64, 2 epochs, 2 workers; at rest {rest:,.0f} MiB", shown, files=a.files, limit=a.limit,
             decoded_mib=decoded, at_rest_mib=rest)


if __name__ == "__main__":
    h.main(entry)
