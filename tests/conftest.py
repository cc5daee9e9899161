"""Shared fixtures: small real datasets cut from the embedded MNIST images, and a CLI runner."""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import signal
import tempfile
from pathlib import Path

import numpy as np
import pytest

from scaletrain.data import embedded_mnist

# What runs learn about image folders goes to the default --cache-dir: keep the tests' out of the user's home (the
# commands the tests start inherit this).
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="scaletrain-test-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)  # not one more folder a session
# huggingface_hub's and matplotlib's caches named outright (where XDG_CACHE_HOME would put them), as they read them at
# import: a test that gives a command its own XDG_CACHE_HOME (scaletrain's cache) then changes nothing read at import,
# and the command can be forked (tests/forkserver.py)
os.environ.setdefault("HF_HOME", os.path.join(os.environ["XDG_CACHE_HOME"], "huggingface"))
os.environ.setdefault("MPLCONFIGDIR", os.path.join(os.environ["XDG_CACHE_HOME"], "matplotlib"))
# Commands the tests start take Ctrl-C as at a terminal, however pytest was started: a shell without job control
# starts its background commands (`pytest ... &`, CI runners) with SIGINT ignored, and every command started from
# there would ignore it too, so a test's SIGINT would pass unseen.
signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_finish(session):
    """What the test modules imported (torch, timm, scaletrain...) lives as long as the run: out of the collector's
    sight, so the collections during the tests that train in this process walk only what the tests made."""
    gc.collect()
    gc.freeze()


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
