"""What the watch decides from the ranks' progress (watch.Watch._stalled, one look's probe), on a real store in this
process: who is named, and what is not a stall."""

from __future__ import annotations

import itertools

import pytest
import torch.distributed as dist

from scaletrain.parallel.watch import FIRST_STEP_PATIENCE, Heartbeat, Watch, folder_bytes


@pytest.fixture()
def watch():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return Watch(store, 0, 3, 10.0, Heartbeat())


def beat(count: int, step: int = 5) -> list:
    """A rank's heartbeat as published: count, ticks, step, phase, since, pid, host."""
    return [count, count, step, "phase", 0.0, 1, "host"]


def test_the_rank_behind_the_others_with_no_progress_is_named(watch):
    beats = [beat(40), beat(39), beat(40)]
    assert watch._stalled(beats, {0: 11.0, 1: 11.0, 2: 11.0}) == [1]  # the others wait for it
    assert watch._stalled(beats, {0: 11.0, 1: 9.0, 2: 11.0}) == []  # not for --stall-timeout yet


def test_a_rank_ahead_that_waits_is_never_named_and_the_furthest_behind_comes_first(watch):
    assert watch._stalled([beat(40), beat(37), beat(38)], {0: 30.0, 1: 30.0, 2: 30.0}) == [1]


def test_a_rank_behind_that_still_progresses_is_no_stall(watch):
    assert watch._stalled([beat(30), beat(40), beat(40)], {0: 1.0, 1: 30.0, 2: 30.0}) == []


def test_no_rank_progressing_is_the_whole_job_stuck_later_before_the_first_step(watch):
    same = [beat(40), beat(40), beat(40)]
    assert watch._stalled(same, {0: 11.0, 1: 11.0, 2: 11.0}) == [0, 1, 2]
    first = [beat(12, step=0)] * 3  # compiling: every rank in its first forward
    assert watch._stalled(first, {r: 11.0 for r in range(3)}) == []
    assert watch._stalled(first, {r: 10.0 * FIRST_STEP_PATIENCE + 1 for r in range(3)}) == [0, 1, 2]


def test_a_phase_whose_probe_moves_counts_as_progress(watch, tmp_path):
    """A checkpoint being written: each look that finds more bytes is progress, though no mark is made."""
    b = watch.beat
    b.mark("checkpoint", probe=folder_bytes(tmp_path))
    ticks = b.ticks
    for k in range(3):
        (tmp_path / f"part-{k}").write_bytes(b"x" * (k + 1))
        watch.poll({})
    assert b.ticks == ticks + 3
    watch.poll({})  # nothing written since: no progress
    assert b.ticks == ticks + 3 and b.count == 1


def test_every_rank_makes_the_same_marks_in_each_of_a_batchs_phases():
    b = Heartbeat()
    for _ in b.each("reading data", range(3)):
        with b.during("collective"):
            pass
    assert (b.count, b.phase) == (1 + 3 * 3, "reading data")
    assert list(itertools.islice(Heartbeat().each("validation", iter(range(2))), 5)) == [0, 1]
