"""The background thread saves run on (resilience/background.py), and what the CLI does with one
still running when a peer is lost."""

from __future__ import annotations

import threading

import pytest

from shardline.resilience.background import BackgroundWork, busy


def test_a_save_in_flight_is_named_busy_until_it_ends_and_its_error_comes_back():
    """What the CLI asks when a peer is lost: with one busy it leaves at once (atexit handlers run,
    no interpreter teardown), since its collective with that peer never returns and tearing its
    group down under it aborted the process (SIGABRT) instead of exiting 1; that exit is checked
    by hand (two simulated nodes, one killed during an async save), not here."""
    release = threading.Event()
    work = BackgroundWork("async-save")
    work.start(lambda: (release.wait(10), {"step": 3})[1])
    assert work.name == "shardline-background-async-save" and work.name in busy()
    release.set()
    (done,) = work.wait()
    assert done["step"] == 3 and done["background_s"] >= 0 and work.name not in busy()
    work.start(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        work.wait()
    assert work.name not in busy()
