"""A free TCP port for a test's rendezvous, safe when pytest-xdist runs two tests at once.

Kept apart from tests/distributed/harness.py, whose imports cost a spawned process ~1 s.
"""

from __future__ import annotations

import os
import socket


def _worker_slot() -> tuple[int, int]:
    """(this xdist worker's index, the number of workers); (0, 1) outside xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1), 1)
    # A worker that replaces a crashed one gets the next name (gw2 of 2): it takes over a share.
    return (int(name[2:]) % count if name[2:].isdigit() else 0), count


def free_port() -> int:
    """A port the kernel just called free, from this worker's share of the port space.

    Between returning a port and the rendezvous binding it, another worker could be handed the
    same one; giving each worker its own residue class of ports keeps two workers' rendezvous
    apart (within one worker, tests run one at a time). What stays open: any other bind(0) in
    that window (gloo's own listeners, the calibration's ports) may take the port. The class
    is of port // 2 because Linux hands bind(0) mostly odd ports.
    """
    index, count = _worker_slot()
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if (port // 2) % count == index:
            return port
    raise RuntimeError(f"no free port in worker {index}'s share of {count} after 1000 tries")
