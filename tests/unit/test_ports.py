"""The suite's free_port: two xdist workers never draw the same port."""

from __future__ import annotations

import socket

from tests.ports import free_port


def test_each_worker_draws_from_its_own_share(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    for worker in (0, 1):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{worker}")
        ports = {free_port() for _ in range(20)}
        assert all((port // 2) % 2 == worker for port in ports), (worker, ports)
        for port in ports:  # each was free when drawn, and still is
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))


def test_outside_xdist_any_free_port_will_do(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    assert 0 < free_port() < 65536
