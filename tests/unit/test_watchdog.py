"""The watchdog's verdicts without processes: stragglers, silent peers, who stopped."""

from __future__ import annotations

import random
import statistics
import threading

import pytest

from shardline.resilience.hangs import is_waiting, stopped_ranks, where, where_stopped
from shardline.config.resilience import WatchdogConfig
from shardline.resilience.stragglers import DATA_FLOOR, PeerWatch, StragglerTracker, median_without
from shardline.resilience.watchdog import Watchdog


def test_median_without_matches_brute_force():
    rng = random.Random(0)
    for n in range(2, 9):
        values = sorted(rng.choice([0.1, 0.2, 0.3, rng.random()]) for _ in range(n))
        for i in range(n):
            assert median_without(values, i) == pytest.approx(statistics.median(values[:i] + values[i + 1:]))


def _feed(tracker, per_step):
    return {step: [(s.rank, round(s.factor, 2)) for s in tracker.observe(step, times)]
            for step, times in enumerate(per_step, start=1)}


def test_slow_rank_reported_once_per_streak_healthy_never():
    rng = random.Random(1)

    def healthy():
        return 0.1 * rng.uniform(0.9, 1.2)  # jitter well under the factor

    slow = [True] * 5 + [False] + [True] * 3
    steps = [{0: healthy(), 1: healthy(), 2: healthy(), 3: 0.2 if s else healthy()} for s in slow]
    got = _feed(StragglerTracker(factor=1.5, steps=3), steps)
    reported = {step: found for step, found in got.items() if found}
    # Once when the first streak reaches 3 steps, again when the second one does.
    assert list(reported) == [3, 9]
    assert all(rank == 3 and factor > 1.5 for found in reported.values() for rank, factor in found)


def test_a_streak_shorter_than_steps_is_not_reported():
    steps = [{0: 0.1, 1: 0.1, 2: 0.3}] * 2 + [{0: 0.1, 1: 0.1, 2: 0.1}] + [{0: 0.1, 1: 0.1, 2: 0.3}] * 2
    assert not any(_feed(StragglerTracker(factor=1.5, steps=3), steps).values())


def test_two_ranks_the_slow_one_is_found():
    # With the median of all ranks, 3x slower would be only 1.5x "the median" of two.
    got = _feed(StragglerTracker(factor=1.5, steps=2), [{0: 0.1, 1: 0.3}] * 2)
    assert got[2] == [(1, 3.0)]


def _rec(step, in_step=True, elapsed=10.0, closed=False):
    return {"step": step, "in_step": in_step, "elapsed_s": elapsed, "limit_s": 3.0, "closed": closed}


WAIT = {"waiting": True}
BUSY = {"waiting": False}


def test_stopped_all_stuck_in_one_step_names_the_rank_not_in_a_collective():
    records = {0: _rec(4), 1: _rec(4), 2: _rec(4)}
    assert stopped_ranks(3, records, {0: WAIT, 1: BUSY, 2: WAIT}) == [1]


def test_stopped_the_culprit_not_yet_over_the_limit_is_still_named():
    # It began the step a little after the rank that declared the hang.
    records = {0: _rec(4), 1: _rec(4, elapsed=2.9), 2: _rec(4)}
    assert stopped_ranks(3, records, {0: WAIT, 1: BUSY, 2: WAIT}) == [1]
    # Of two busy ranks (no collective), the one over the limit.
    assert stopped_ranks(3, records, {0: BUSY, 1: BUSY, 2: WAIT}) == [0]


def test_stopped_behind_the_others():
    records = {0: _rec(9, elapsed=0.1), 1: _rec(4), 2: _rec(9, in_step=False)}
    assert stopped_ranks(3, records, {0: BUSY, 1: BUSY, 2: BUSY}) == [1]


def test_stopped_a_rank_that_could_not_dump_or_never_reported():
    records = {0: _rec(4), 1: _rec(4), 2: _rec(4)}
    assert stopped_ranks(3, records, {0: WAIT, 1: WAIT}) == [2]
    assert stopped_ranks(3, {0: _rec(4), 2: _rec(4)}, {0: WAIT, 2: WAIT}) == [1]


def test_a_frozen_ranks_record_steps_behind_is_not_the_reports_phase_or_limit():
    """Rank 1 frozen (SIGSTOP) in step 6: its last published record is from step 4's save (the
    watchdog publishes every poll). The report names step 6, the step's limit; not "save (after
    step 4)" with the save's long limit. A record one step behind, or a rank that dumped, stays
    the report's: a rank hung in step 4's save while its peer waits in step 5."""
    own = {**_rec(6), "phase": "step"}
    stale = {**_rec(4), "phase": "save", "limit_s": 100.0}
    assert where_stopped([1], {0: own, 1: stale}, {0: WAIT}, own) == (6, "step", 3.0)
    own5 = {**_rec(5), "phase": "step"}
    assert where_stopped([1], {0: own5, 1: stale}, {0: WAIT}, own5) == (4, "save", 100.0)
    assert where_stopped([1], {0: own, 1: stale}, {0: WAIT, 1: BUSY}, own) == (4, "save", 100.0)
    # Two stopped: the one that dumped is known current; its step, phase and limit, all three.
    eval5 = {**_rec(5), "phase": "eval", "limit_s": 50.0}
    assert where_stopped([1, 2], {0: own, 1: stale, 2: eval5}, {0: WAIT, 2: BUSY}, own) == (5, "eval", 50.0)
    assert where_stopped([1, 2], {0: own5, 1: stale, 2: eval5}, {0: WAIT}, own5) == (4, "save", 100.0)


def test_stopped_closed_ranks_are_never_named():
    records = {0: _rec(4), 1: _rec(4, closed=True), 2: _rec(4)}
    assert stopped_ranks(3, records, {0: WAIT, 2: BUSY}) == [2]


def test_stopped_a_rank_whose_training_raised_is_named_the_others_not():
    """Rank 1 raised (an OOM) and left its peers waiting in the next collective: closed, it was
    never named, and the report named the waiting ranks instead."""
    records = {0: _rec(4), 1: {**_rec(4, in_step=False, closed=True), "failed": True}, 2: _rec(4)}
    assert stopped_ranks(3, records, {0: WAIT, 2: WAIT}) == [1]
    # A rank killed mid-collective (dead: no dump) makes a peer raise too: the dead one is named.
    records = {0: _rec(4), 1: {**_rec(4, in_step=False, closed=True), "failed": True}, 2: _rec(4), 3: _rec(4)}
    assert stopped_ranks(4, records, {0: WAIT, 3: WAIT}) == [2]


def test_a_failed_run_publishes_its_rank_as_failed(tiny_config, tmp_path):
    """The trainer's failure path closes the watchdog as failed; a finished run as closed only."""
    import json

    from shardline.resilience.watchdog import _key
    from shardline.trainer import Trainer

    trainer = Trainer(tiny_config("watchdog.timeout_s=60", "train.eval_interval=0")).build()

    def out_of_memory():
        raise RuntimeError("CUDA out of memory")

    trainer.compute_gradients = out_of_memory
    with pytest.raises(RuntimeError, match="out of memory"):
        trainer.train()
    record = json.loads(trainer.guard.watchdog.store.get(_key("rec", 0)))
    assert record["closed"] and record["failed"]
    done = Trainer(tiny_config("watchdog.timeout_s=60", "train.eval_interval=0", run_dir=tmp_path / "done")).build()
    done.train()
    record = json.loads(done.guard.watchdog.store.get(_key("rec", 0)))
    assert record["closed"] and not record["failed"]


def test_stopped_indistinguishable_names_every_stuck_rank():
    records = {0: _rec(4), 1: _rec(4), 2: _rec(4, elapsed=0.5)}
    assert stopped_ranks(3, records, {0: WAIT, 1: WAIT, 2: WAIT}) == [0, 1]


def test_is_waiting_looks_at_the_innermost_frames_only():
    inner = ["/x/torch/distributed/distributed_c10d.py:2800 in all_reduce", "/w/train.py:10 in step"]
    assert is_waiting(inner)
    # A pipeline schedule wraps all compute: torch/distributed far out must not count.
    deep = ["/w/model.py:5 in forward", "/x/torch/nn/modules/module.py:1 in _call_impl",
            "/x/torch/nn/modules/module.py:2 in _wrapped_call_impl",
            "/x/torch/distributed/pipelining/schedules.py:900 in step"]
    assert not is_waiting(deep)


def test_where_reports_another_threads_frames():
    started, release = threading.Event(), threading.Event()

    def parked_here():
        started.set()
        release.wait()

    t = threading.Thread(target=parked_here)
    t.start()
    started.wait()
    try:
        assert any("in parked_here" in f for f in where(t.ident))
    finally:
        release.set()
        t.join()


def _peer_rec(beat, closed=False):
    return {"beat": beat, "closed": closed, "times": []}


def test_silent_peer_found_after_timeout_closed_peer_never():
    watch = PeerWatch(WatchdogConfig(timeout_s=3.0))
    assert watch.silent({1: _peer_rec(1), 2: _peer_rec(1, closed=True)}, now=0.0) == []
    assert watch.silent({1: _peer_rec(1), 2: _peer_rec(1, closed=True)}, now=2.9) == []
    assert watch.silent({1: _peer_rec(1), 2: _peer_rec(1, closed=True)}, now=3.1) == [1]
    assert watch.silent({1: _peer_rec(2), 2: _peer_rec(1, closed=True)}, now=9.0) == []  # it moved again


def test_peer_watch_judges_each_common_step_once():
    watch = PeerWatch(WatchdogConfig(straggler_factor=1.5, straggler_steps=2))

    def recs(n1):
        return {0: {"closed": False, "times": [[s, 0.1] for s in range(1, 5)]},
                1: {"closed": False, "times": [[s, 0.4] for s in range(1, n1 + 1)]}}

    assert watch.stragglers(recs(1)) == []  # only step 1 is common so far
    found = watch.stragglers(recs(4))
    assert [(s.step, s.rank) for s in found] == [(2, 1)]
    assert watch.stragglers(recs(4)) == []  # nothing judged twice


def test_compute_probes_name_the_slow_device_that_equal_step_times_hide():
    """A slow GPU's peers wait for it in the collectives: every step time is the same, and only
    the probes, judged on their own steps (every 2nd here), tell the ranks apart."""
    watch = PeerWatch(WatchdogConfig(straggler_factor=1.5, straggler_steps=2))
    recs = {r: {"closed": False, "times": [[s, 0.5] for s in range(1, 7)],
                "probes": [[s, 0.002 * (4 if r == 1 else 1)] for s in (2, 4, 6)]} for r in range(3)}
    found = watch.stragglers(recs)
    assert [(s.measure, s.step, s.rank) for s in found] == [("compute", 4, 1)]
    assert found[0].factor == pytest.approx(4.0)
    assert watch.stragglers(recs) == []  # nothing judged twice
    assert watch.stragglers({r: {"closed": False, "times": []} for r in range(3)}) == []  # a record without probes


def test_batch_reads_name_a_slow_reader_only_past_a_share_of_the_step():
    """A rank reading its batch slowly makes its peers wait in the step's collectives: equal
    step times, and only its reads tell it apart. Reads are microseconds, so a ratio of them
    is noise unless the excess is also a share of a typical step (DATA_FLOOR), which a step
    that also saved a checkpoint (timed with it) does not raise."""
    watch = PeerWatch(WatchdogConfig(straggler_factor=1.5, straggler_steps=2))
    step_s, fast = 1.0, 0.001
    slow = {1: fast * 3 + DATA_FLOOR * step_s * 0.9, 2: fast * 3 + DATA_FLOOR * step_s * 1.1}  # step -> rank 1's reads

    def recs(steps):
        return {r: {"closed": False, "times": [[s, 20 * step_s if s == 4 else step_s] for s in steps],
                    "reads": [[s, slow[(s + 1) // 2] if r == 1 else fast] for s in steps]} for r in range(3)}

    assert watch.stragglers(recs([1, 2])) == []  # 3x + 4.5 % of the step: under the floor
    found = watch.stragglers(recs([1, 2, 3, 4]))  # 3x + 5.5 %: slow at steps 3 and 4
    assert [(s.measure, s.step, s.rank) for s in found] == [("data", 4, 1)]
    assert found[0].step_time_s == pytest.approx(slow[2])


def test_batch_reads_wait_for_step_times():
    """The floor is a share of the steps' time: reads published before any step time (the
    watchdog publishes both together; a defence) are judged at a later poll, not skipped."""
    watch = PeerWatch(WatchdogConfig(straggler_factor=1.5, straggler_steps=1))
    reads = {r: [[1, 0.5 if r == 1 else 0.001]] for r in range(2)}
    assert watch.stragglers({r: {"closed": False, "times": [], "reads": reads[r]} for r in range(2)}) == []
    found = watch.stragglers({r: {"closed": False, "times": [[1, 1.0]], "reads": reads[r]} for r in range(2)})
    assert [(s.measure, s.step, s.rank) for s in found] == [("data", 1, 1)]


def test_off_in_one_process_and_a_store_required_for_many(tmp_path):
    off = Watchdog(WatchdogConfig(timeout_s=0), tmp_path, 0, 1, None, lambda *a, **k: None)
    off.start()
    assert off._thread is None
    off.step_begin(1), off.step_end(1, 0.1), off.close()
    with pytest.raises(ValueError, match="needs the c10d store"):
        Watchdog(WatchdogConfig(timeout_s=5), tmp_path, 0, 2, None, lambda *a, **k: None)


def test_a_phase_inside_a_step_hands_the_watch_back_to_the_step(tmp_path):
    """An anomaly's rollback restores inside a step (under the long limit); the rest of the step
    is watched again afterwards, with its own limit. A phase outside steps leaves nothing watched."""
    wd = Watchdog(WatchdogConfig(timeout_s=5), tmp_path, 0, 1, None, lambda *a, **k: None, phase_timeout_s=50)
    wd.phase_begin("restore", 0)  # start-up: no step yet
    wd.phase_end()
    assert not wd._progress.in_step
    wd.step_begin(1)
    wd.phase_begin("restore", 1)
    assert (wd._progress.phase, wd._progress.limit_s) == ("restore", 50)
    wd.phase_end()
    assert (wd._progress.in_step, wd._progress.phase, wd._progress.step, wd._progress.limit_s) == (True, "step", 1, 5)
    wd.step_end(1, 0.1)
    wd.phase_begin("drain", 1)
    wd.phase_end()
    assert not wd._progress.in_step


def test_a_store_that_fails_for_a_moment_is_tried_again(tmp_path, monkeypatch):
    """A TCPStore timeout or a reset connection passes: giving the store up at its first failure
    left the rank silent, and rank 0 declared it dead a hang limit later. It is given up only
    after failing for a whole hang limit."""
    from shardline.resilience import watchdog as module

    clock = [100.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: clock[0])
    wd = Watchdog(WatchdogConfig(timeout_s=5), tmp_path, 0, 1, None, lambda *a, **k: None)

    def fails():
        raise RuntimeError("Socket Timeout")

    assert wd._safe(fails) is None and not wd._store_lost
    clock[0] += 2
    assert wd._safe(lambda: "answer") == "answer"  # back: its failures are forgotten
    clock[0] += 1
    wd._safe(fails)
    clock[0] += 4.9
    wd._safe(fails)
    assert not wd._store_lost
    clock[0] += 0.2
    with pytest.warns(UserWarning, match="the c10d store failed for 5 s"):
        wd._safe(fails)
    assert wd._store_lost and wd._safe(lambda: "answer") is None


def _report_blocks(run_dir: str) -> None:
    """A declared hang whose stack dump blocks (the run dir's storage stalled)."""
    import time as clock

    from shardline.resilience import watchdog as module

    module.REPORT_DEADLINE_S = 0.5
    module.dump_stacks = lambda *args, **kwargs: clock.sleep(3600)
    dog = Watchdog(WatchdogConfig(timeout_s=1.0), run_dir, 0, 1, None, on_event=lambda *a, **k: None, exit_code=4)
    dog._respond({"dir": "hang-x", "by": 0, "suspects": [0], "at": 0.0})


def test_a_hang_report_that_blocks_still_exits_by_its_deadline(tmp_path):
    """Where a stalled file system is the hang, the report's writes block as well: the watchdog
    exits by a deadline anyway, or the job it exists to end stays hung."""
    import multiprocessing
    import time as clock

    child = multiprocessing.get_context("spawn").Process(target=_report_blocks, args=(str(tmp_path),))
    began = clock.monotonic()
    child.start()
    child.join(timeout=60)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive and child.exitcode == 4, child.exitcode
    assert clock.monotonic() - began < 30
