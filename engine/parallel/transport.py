"""How arrays and step messages move between pipeline ranks: point to point, or through collectives.

MLX 0.32's NCCL backend (CUDA) has only collectives (all_sum, all_gather, …): `mx.distributed.send` raises
"Send has no CUDA implementation." So there are two transports with one interface:
- `PointToPoint` (ring backend): a hop is a send on its source rank and a recv on its destination.
- `Collective` (NCCL): every rank calls the same all_gather for every hop, in the same order; the source
  contributes its array, the others zeros of the same shape, and the destination keeps the source's slice.
  A hop moves W× the bytes, and every rank takes part in every hop (docs/PARALLEL.md).
Either way every rank walks the hops 0…W-1 of a step in order (hop h: rank h → rank (h+1) % W) and knows
each hop's shape, because every rank sees the same step.

The transport is chosen by backend (nccl → collective, otherwise point to point); TESSERA_PARALLEL_TRANSPORT
(`collective` or `p2p`) forces one, which is how the CPU tests run the collective path.
"""

from __future__ import annotations

import os
from typing import Protocol

import mlx.core as mx
import numpy as np

TRANSPORT_ENV = "TESSERA_PARALLEL_TRANSPORT"
TRANSPORTS = ("p2p", "collective")


class Transport(Protocol):
    name: str

    def hop(self, hop: int, payload: mx.array | None, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array | None:
        """Hop `hop` (rank hop → rank (hop + 1) % W). The source passes `payload` (of `shape`, `dtype`);
        the destination gets it back; the others get None. Call it on every rank, for every hop, in order
        (the collective transport needs every rank at every hop)."""
        ...

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's `data` on every rank (rank 0 passes it, the others None)."""
        ...


class PointToPoint:
    name = "p2p"

    def __init__(self, group: mx.distributed.Group) -> None:
        self.group, self.rank, self.world = group, group.rank(), group.size()

    def hop(self, hop: int, payload: mx.array | None, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array | None:
        src, dst = hop, (hop + 1) % self.world
        if self.rank == src:
            mx.eval(mx.distributed.send(payload, dst, group=self.group))
        if self.rank == dst:
            return mx.distributed.recv(shape, dtype, src, group=self.group)
        return None

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Passed rank to rank along the pipeline: length first ([1] int32), then the bytes ([n] uint8)."""
        if self.rank != 0:
            length = mx.distributed.recv((1,), mx.int32, self.rank - 1, group=self.group)
            data = bytes(np.array(mx.distributed.recv((int(length.item()),), mx.uint8, self.rank - 1, group=self.group)))
        if self.rank + 1 < self.world:
            mx.eval(mx.distributed.send(mx.array([len(data)], dtype=mx.int32), self.rank + 1, group=self.group))
            mx.eval(mx.distributed.send(_as_uint8(data), self.rank + 1, group=self.group))
        return data


class Collective:
    name = "collective"

    def __init__(self, group: mx.distributed.Group) -> None:
        self.group, self.rank, self.world = group, group.rank(), group.size()

    def hop(self, hop: int, payload: mx.array | None, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array | None:
        src, dst = hop, (hop + 1) % self.world
        contribution = payload if self.rank == src else mx.zeros(shape, dtype=dtype)
        gathered = mx.distributed.all_gather(contribution, group=self.group)  # [W * rows, …]: rank r's rows at r
        mx.eval(gathered)  # every rank runs the collective now, receiver or not
        rows = shape[0]
        return gathered[src * rows : (src + 1) * rows] if self.rank == dst else None

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """The length by all_sum (the others add 0), then the bytes by all_gather (the others send zeros)."""
        mine = data if self.rank == 0 else b""
        n = int(mx.distributed.all_sum(mx.array([len(mine)], dtype=mx.int32), group=self.group).item())
        padded = _as_uint8(mine) if self.rank == 0 else mx.zeros((n,), dtype=mx.uint8)
        gathered = mx.distributed.all_gather(padded, group=self.group)  # [W * n]: rank 0's bytes first
        return bytes(np.array(gathered[:n]))


def _as_uint8(data: bytes) -> mx.array:
    return mx.array(np.frombuffer(data, dtype=np.uint8))


def transport_name(backend: str) -> str:
    """The forced transport (TESSERA_PARALLEL_TRANSPORT), else the collective one where only collectives exist."""
    forced = os.environ.get(TRANSPORT_ENV, "")
    if forced:
        if forced not in TRANSPORTS:
            raise ValueError(f"{TRANSPORT_ENV}={forced!r}: choose one of {', '.join(TRANSPORTS)}")
        return forced
    if backend == "any":  # launched without saying which: the backend MLX picks where it is CUDA
        backend = "nccl" if mx.default_device() == mx.gpu and mx.cuda.is_available() else "ring"
    return "collective" if backend == "nccl" else "p2p"


def make_transport(group: mx.distributed.Group, backend: str) -> Transport:
    return Collective(group) if transport_name(backend) == "collective" else PointToPoint(group)
