"""Shared fixtures: small real datasets cut from the embedded MNIST images, and a CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from scaletrain.data import embedded_mnist


@pytest.fixture(scope="session")
def mnist():
    return embedded_mnist()


def write_npz(path: Path, mnist, n_train: int, n_val: int, offset: int = 0) -> Path:
    images = mnist.images[:, 0].numpy()
    labels = mnist.labels.numpy()
    a, b, c = offset, offset + n_train, offset + n_train + n_val
    np.savez(path, images=images[a:b], labels=labels[a:b], val_images=images[b:c], val_labels=labels[b:c])
    return path


@pytest.fixture(scope="session")
def small_npz(tmp_path_factory, mnist) -> Path:
    """400 training and 101 validation digits (101: not a multiple of 2 or 3 processes or of any batch)."""
    return write_npz(tmp_path_factory.mktemp("data") / "small.npz", mnist, 400, 101)


def run_cli(*args: str, timeout: float = 300, env: dict | None = None, cwd: Path | None = None,
            module: str = "scaletrain", launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run scaletrain (or a launcher in front of it) in a fresh process, as a user would."""
    cmd = [*(launcher or [sys.executable, "-m"]), module, *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)
