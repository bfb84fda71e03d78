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

Everything runs point-to-point on a gloo group in host memory; XORs are local.
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


def _exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
              group: dist.ProcessGroup) -> None:
    ops = [dist.P2POp(dist.isend, t, peer, group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group) for t, peer in recvs]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _xor_all(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(like)
    for part in parts:
        out.bitwise_xor_(part)
    return out


def encode_parity(own: torch.Tensor, sizes: list[int], members: list[int], rank: int,
                  group: dist.ProcessGroup) -> torch.Tensor:
    """This member's parity chunk (int64 words) of its group's current buffers.

    Every member sends each of its chunks to the keeper of that chunk's stripe, and
    each keeper XORs what it receives (point-to-point: gloo's BXOR reduction runs
    several times slower than a send and a local XOR).
    """
    s, me = XorStripes(members, sizes), members.index(rank)
    mine = s.chunks(own)
    sends = [(mine[s.chunk_index(me, stripe)], keeper) for stripe, keeper in enumerate(members) if stripe != me]
    recvs = [(s.zeros(), m) for i, m in enumerate(members) if i != me]
    _exchange(sends, recvs, group)
    return _xor_all([t for t, _ in recvs], s.zeros())


def decode_lost(own: torch.Tensor | None, parity: torch.Tensor | None, sizes: list[int], members: list[int],
                lost: int, rank: int, group: dist.ProcessGroup) -> torch.Tensor | None:
    """Rebuild member `lost`'s buffer from the survivors; returned on `lost`, None elsewhere.

    For each stripe the lost member had a chunk in, every survivor sends its part (the
    stripe's keeper its parity, the others their chunk of that stripe); their XOR is
    the lost chunk.
    """
    s, me, gone = XorStripes(members, sizes), members.index(rank), members.index(lost)
    stripes = [c for c in range(s.g) if c != gone]  # the lost member kept no parity for its own stripe
    if me != gone:
        mine = s.chunks(own)
        parts = [(parity if me == c else mine[s.chunk_index(me, c)], lost) for c in stripes]
        _exchange(parts, [], group)
        return None
    received = {(c, m): s.zeros() for c in stripes for i, m in enumerate(members) if i != gone}
    _exchange([], [(t, m) for (c, m), t in received.items()], group)
    rebuilt = [None] * (s.g - 1)
    for c in stripes:
        rebuilt[s.chunk_index(gone, c)] = _xor_all([received[(c, m)] for i, m in enumerate(members) if i != gone],
                                                   s.zeros())
    return torch.cat(rebuilt).view(torch.uint8)[: sizes[lost]].clone()
