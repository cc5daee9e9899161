"""`scaletrain prepare`: decode a dataset once into checksummed shards (see data/sources/prepared.py) that training
reads at memory speed, from a local folder or from object storage."""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import DataConfig, TrainConfig, _f
from ..errors import UserError
from .common import add_flags, field_like, options_from_args


def data_field(name: str) -> object:
    return field_like(DataConfig, name)


@dataclass(kw_only=True)
class PrepareOptions:
    data: str = data_field("data")
    output: str = _f(None, "folder to write (new, or empty), or s3://bucket/prefix (LitData chunks, streamed by "
                     "train; the endpoint and credentials are boto3's: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)",
                     required=True, metavar="DIR")
    chunks: bool = _f(False, "write LitData chunks to the folder too (to copy to object storage yourself); "
                      "without it a folder gets shards read by memory map, the fastest from a local disk")
    data_format: str = data_field("data_format")
    download: bool = data_field("download")
    image_column: str = data_field("image_column")
    label_column: str = data_field("label_column")
    image_size: int = data_field("image_size")
    channels: int = data_field("channels")
    recipe: str = data_field("recipe")
    crop_pct: float = data_field("crop_pct")
    val_fraction: float = data_field("val_fraction")
    seed: int = _f(0, "seed of the validation split, when the data has none (as train's --seed)")
    skip_bad_samples: bool = data_field("skip_bad_samples")
    cache_dir: str = data_field("cache_dir")
    shard_size_mb: int = _f(256, "largest shard, in MiB of decoded images")
    chunk_size: str = _f("64MB", "with chunks: the largest chunk (what is downloaded at a time), e.g. 8MB, 64MB")


def add_parser(subparsers) -> None:
    prepare = subparsers.add_parser(
        "prepare", help="decode a dataset once into checksummed shards that training reads at memory speed",
        description="Check and decode --data once (split into train and val as training would split it) and "
                    "write it to --output as shards of uint8 images with their labels and a manifest of "
                    "SHA-256 checksums. Then `scaletrain train --data DIR` starts without checking or decoding "
                    "any image. With --output s3://bucket/prefix (or --chunks) it writes LitData chunks instead, "
                    "which `scaletrain train --data s3://bucket/prefix` streams through a bounded local cache "
                    "(--cache-limit).")
    add_flags(prepare, PrepareOptions)


def run(args: argparse.Namespace) -> int:
    from ..data.read import load_image_sets
    from ..config import parse_size
    from ..data.sources.chunks import write_chunks
    from ..data.sources.prepared import write_prepared
    from ..data.types import Skipped

    opts: PrepareOptions = options_from_args(PrepareOptions, args)
    remote = opts.output.startswith("s3://")
    out = Path(opts.output)
    if not remote and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--output {out}: exists and is not an empty folder (nothing there is overwritten)")
    chunk_bytes = parse_size(opts.chunk_size, "--chunk-size")
    if chunk_bytes <= 0:
        raise UserError(f"--chunk-size {opts.chunk_size}: must be more than 0 bytes")
    if opts.shard_size_mb <= 0:
        raise UserError(f"--shard-size-mb must be a positive integer, got {opts.shard_size_mb}")
    cfg = DataConfig(**{f.name: getattr(opts, f.name) for f in dataclasses.fields(DataConfig)
                        if hasattr(opts, f.name)})
    TrainConfig(data=cfg).validate()  # the flags refused as train refuses them
    t0 = time.perf_counter()
    skipped = Skipped() if opts.skip_bad_samples else None
    train, val = load_image_sets(cfg, seed=opts.seed, skipped=skipped)
    checked = time.perf_counter() - t0
    say = lambda line: print(line, flush=True)  # noqa: E731
    chunked = remote or opts.chunks
    try:
        manifest = write_chunks(opts.output, {"train": train, "val": val}, chunk_bytes, say=say) if chunked else \
            write_prepared(out, {"train": train, "val": val}, opts.shard_size_mb << 20, say=say)
    except OSError as e:
        raise UserError(f"--output {opts.output}: cannot write ({e.strerror or e})") from None
    if skipped and skipped.entries:
        (out / "skipped_samples.txt").write_text("\n".join(skipped.entries) + "\n")
        print(f"skipped {len(skipped.entries)} bad sample(s), listed in {out / 'skipped_samples.txt'}")
    splits = manifest["splits"].values()
    if chunked:
        files = sum(len(s["files"]) for s in splits)
        written, size = f"{files} file(s) of LitData chunks", sum(s["bytes"] for s in splits)
    else:
        written = f"{sum(len(s['shards']) for s in splits)} shard(s)"
        size = sum(sh["bytes"] for s in splits for sh in s["shards"])
    print(f"prepared {len(train)} training and {len(val)} validation samples ({manifest['channels']} x "
          f"{manifest['size']} x {manifest['size']}, recipe {manifest['recipe']}) in {written}, "
          f"{size / 2**20:.0f} MiB, in {time.perf_counter() - t0:.1f} s ({checked:.1f} s reading --data); "
          f"train with: scaletrain train --data {opts.output}")
    return 0
