"""A refusal agreed by every rank exits with one code on every rank: a try-later (75) raised on one
rank while it handled a failed read was rebuilt as a plain error (2) on its peers, so the job's code
depended on which rank srun or torchrun reported."""

from __future__ import annotations

import errno

import torch.multiprocessing as mp

from tests.distributed.harness import gloo_rank, start_ranks
from tests.ports import free_port


def _worker(rank: int, world: int, port: int, said) -> None:
    from shardline import errors
    from shardline.parallel.distributed import agreed

    def transient():
        if rank == 1:
            try:
                raise OSError(errno.ESTALE, "Stale file handle")
            except OSError:
                raise errors.DataError("data/x.jsonl cannot be read") from None

    def plain():
        if rank == 1:
            raise errors.DataError("data/x.jsonl holds no text")

    with gloo_rank(rank, world, port):
        for name, check in (("transient", transient), ("plain", plain)):
            try:
                agreed(check, world)
                said.put((rank, name, "passed", 0))
            except errors.ShardlineError as e:
                said.put((rank, name, str(e), errors.exit_code(e)))


def test_every_rank_exits_with_the_failing_ranks_code():
    said = mp.get_context("spawn").SimpleQueue()
    start_ranks(_worker, args=(2, free_port(), said), nprocs=2)
    found = {}
    while not said.empty():
        rank, attempt, text, code = said.get()
        found[rank, attempt] = (text, code)
    assert found[0, "transient"] == ("on rank 1: data/x.jsonl cannot be read", 75), found
    assert found[1, "transient"] == ("data/x.jsonl cannot be read", 75), found
    assert found[0, "plain"][1] == found[1, "plain"][1] == 2, found
