"""Meeting the job's other ranks (torch's env:// rendezvous at MASTER_ADDR:MASTER_PORT), said aloud.

torch waits there up to 30 minutes without a word: a rank that never started (srun told fewer tasks
than it said, a node of torchrun's --nnodes missing) or a rank 0 host name that does not resolve
from here left every other rank silent, or printing c10d's warnings, for half an hour. A rank
still waiting after WAIT_SAID_S says where it waits and what is likely wrong, and a port another
process holds is one line instead of a traceback.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading

import torch.distributed as dist

from shardline.errors import ConfigError

WAIT_SAID_S = 60.0


def meet(local_rank: int, timeout: datetime.timedelta | None = None) -> tuple[dist.Store, int, int]:
    """(store, rank, world) of env:// (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT); each node's
    first rank says so where it waits past WAIT_SAID_S. `timeout`: torch's (30 min) where None."""
    rank, world = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"

    def say() -> None:
        print(f"shardline: rank {rank} has waited {WAIT_SAID_S:g} s to meet the job's {world} ranks at {where} "
              "(rank 0's host): a rank that did not start (srun's task count, torchrun's --nnodes), or a host "
              "name that does not resolve from here (MASTER_ADDR sets it); torch waits up to 30 minutes",
              file=sys.stderr, flush=True)

    timer = threading.Timer(WAIT_SAID_S, say) if local_rank == 0 else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        return next(dist.rendezvous("env://", **({"timeout": timeout} if timeout else {})))
    except dist.DistNetworkError as e:
        if "EADDRINUSE" in str(e) or "address already in use" in str(e).lower():
            raise ConfigError(f"rank {rank} cannot serve the rendezvous at {where}: another process holds that "
                              "port (another job or job step on the node): set MASTER_PORT to a free one") from None
        raise
    finally:
        if timer is not None:
            timer.cancel()
