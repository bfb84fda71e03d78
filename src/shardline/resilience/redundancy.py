"""Redundancy for the in-memory checkpoint tier: peer replicas and XOR parity.

Each rank's snapshot is a byte buffer. Two ways to survive losing one:

- **replica**: every rank keeps a full copy of one peer's buffer. The peer is the rank
  `ranks_per_node` further on, i.e. on the next node, so a whole node can be lost
  (on a single node it is simply the next rank). Costs one extra snapshot per rank.
- **xor** (RAID-5 style): ranks form parity groups of g (one rank per node across
  nodes, or all ranks of a single node). Each member's buffer is cut into g-1 chunks;
  stripe c collects one chunk from every member except c, and member c keeps the XOR
  of that stripe. Losing any one member leaves every stripe it contributed to with its
  parity and all other chunks alive, so its chunks are XORs of the survivors'. Costs
  1/(g-1) of a snapshot per rank.

Everything runs on a gloo group in host memory; XOR is gloo's BXOR reduction.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

WORD = 8  # buffers are XORed as int64 words


def peer_step(world: int, ranks_per_node: int) -> int:
    """Distance from a rank to the peer that holds its replica (next node when there is one)."""
    return ranks_per_node if world > ranks_per_node else 1


def replica_holder(rank: int, world: int, ranks_per_node: int) -> int:
    return (rank + peer_step(world, ranks_per_node)) % world


def replica_source(rank: int, world: int, ranks_per_node: int) -> int:
    """The rank whose buffer `rank` keeps a copy of."""
    return (rank - peer_step(world, ranks_per_node)) % world


def parity_groups(world: int, ranks_per_node: int) -> list[list[int]]:
    """One rank per node across nodes (a lost node costs each group one member), else all ranks."""
    if world > ranks_per_node and world % ranks_per_node == 0:
        nodes = world // ranks_per_node
        return [[local + n * ranks_per_node for n in range(nodes)] for local in range(ranks_per_node)]
    return [list(range(world))]


def exchange_replicas(own: torch.Tensor, sizes: list[int], rank: int, world: int, ranks_per_node: int,
                      group: dist.ProcessGroup) -> torch.Tensor:
    """Send this rank's buffer to its holder; return the buffer of the rank it holds for."""
    source = replica_source(rank, world, ranks_per_node)
    received = torch.empty(sizes[source], dtype=torch.uint8)
    ops = [dist.P2POp(dist.isend, own, replica_holder(rank, world, ranks_per_node), group),
           dist.P2POp(dist.irecv, received, source, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received


def send_replicas(transfers: list[tuple[int, int]], rank: int, held: torch.Tensor | None, size: int,
                  group: dist.ProcessGroup) -> torch.Tensor | None:
    """Recovery: each (holder, lost) pair sends the held copy; returns what this rank received."""
    ops, received = [], None
    for holder, lost in transfers:
        if holder == rank:
            ops.append(dist.P2POp(dist.isend, held, lost, group))
        if lost == rank:
            received = torch.empty(size, dtype=torch.uint8)
            ops.append(dist.P2POp(dist.irecv, received, holder, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return received


class XorStripes:
    """The stripe geometry of one parity group: which chunk of which member goes where."""

    def __init__(self, members: list[int], sizes: list[int]):
        self.members, self.g = members, len(members)
        assert self.g >= 2, "a parity group needs at least two members"
        unit = WORD * (self.g - 1)
        longest = max(sizes[m] for m in members)
        self.chunk = -(-longest // unit) * unit // (self.g - 1)  # bytes per chunk

    def chunk_index(self, member: int, stripe: int) -> int:
        """Which of `member`'s g-1 chunks lies in `stripe` (member != stripe)."""
        return stripe if stripe < member else stripe - 1

    def chunks(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        padded = torch.zeros(self.chunk * (self.g - 1), dtype=torch.uint8)
        padded[: buffer.numel()] = buffer
        return list(padded.view(torch.int64).split(self.chunk // WORD))

    def zeros(self) -> torch.Tensor:
        return torch.zeros(self.chunk // WORD, dtype=torch.int64)


def encode_parity(own: torch.Tensor, sizes: list[int], members: list[int], rank: int,
                  group: dist.ProcessGroup) -> torch.Tensor:
    """This member's parity chunk (int64 words) of its group's current buffers."""
    s, me = XorStripes(members, sizes), members.index(rank)
    mine = s.chunks(own)
    parity = None
    for stripe, keeper in enumerate(members):
        part = s.zeros() if stripe == me else mine[s.chunk_index(me, stripe)].clone()
        dist.reduce(part, dst=keeper, op=dist.ReduceOp.BXOR, group=group)
        if stripe == me:
            parity = part
    return parity


def decode_lost(own: torch.Tensor | None, parity: torch.Tensor | None, sizes: list[int], members: list[int],
                lost: int, rank: int, group: dist.ProcessGroup) -> torch.Tensor | None:
    """Rebuild member `lost`'s buffer from the survivors; returned on `lost`, None elsewhere."""
    s, me, gone = XorStripes(members, sizes), members.index(rank), members.index(lost)
    mine = s.chunks(own) if own is not None else None
    rebuilt = [None] * (s.g - 1)
    for stripe, keeper in enumerate(members):
        if stripe == gone:
            continue  # its parity was on the lost member, and the lost member has no chunk in it
        if me == gone:
            part = s.zeros()
        elif me == stripe:
            part = parity.clone()
        else:
            part = mine[s.chunk_index(me, stripe)].clone()
        dist.reduce(part, dst=lost, op=dist.ReduceOp.BXOR, group=group)
        if me == gone:
            rebuilt[s.chunk_index(gone, stripe)] = part
    if me != gone:
        return None
    return torch.cat(rebuilt).view(torch.uint8)[: sizes[lost]].clone()
