"""The suite's free_port: two xdist workers never draw the same port."""

from __future__ import annotations

import pytest

from tests import ports


class _Scripted:
    """A socket whose bind(0) gets the next of the given ports (no real port is taken)."""

    def __init__(self, drawn: list[int]):
        self.drawn = drawn

    def __call__(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def bind(self, address):
        self.port = self.drawn.pop(0)

    def getsockname(self):
        return ("127.0.0.1", self.port)


@pytest.mark.parametrize("worker, count, expected", [
    ("gw0", "2", 40001),  # 40001 // 2 = 20000: share 0 of 2
    ("gw1", "2", 40003),  # 20001: share 1
    ("gw3", "2", 40003),  # a replacement worker (gw3 of 2) takes over share 1
    ("gw1", "3", 40005),  # 40001 and 40003 are shares 2 and 0 of 3; 20002 % 3 = 1
    ("", "", 40001),  # outside xdist: the first free port
])
def test_each_worker_draws_from_its_own_share(monkeypatch, worker, count, expected):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", count)
    monkeypatch.setattr(ports.socket, "socket", _Scripted([40001, 40003, 40005, 40007]))
    assert ports.free_port() == expected


def test_a_share_that_never_comes_up_is_an_error(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    monkeypatch.setattr(ports.socket, "socket", _Scripted([40001] * 1000))
    with pytest.raises(RuntimeError, match="no free port in worker 1's share of 2"):
        ports.free_port()
