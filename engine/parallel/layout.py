"""Which rank owns which layers. Contiguous ranges, as equal as the count allows; rank 0 also owns the
vocabulary tensors (embedding, head), so a remainder layer goes to the later ranks first."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageLayout:
    world: int
    ranges: tuple[range, ...]  # ranges[r]: the layers rank r runs, in order, covering every layer once

    def layers_of(self, rank: int) -> range:
        return self.ranges[rank]

    def as_dict(self) -> dict[str, list[list[int]]]:
        return {"layers": [[r.start, r.stop] for r in self.ranges]}


def split_layers(num_layers: int, world: int) -> StageLayout:
    """`num_layers` into `world` contiguous ranges; 43 over 2 -> [0, 21), [21, 43)."""
    if not 1 <= world <= num_layers:
        raise ValueError(f"world ({world}) must be between 1 and the model's {num_layers} layers: each rank runs at least one")
    base, extra = divmod(num_layers, world)
    sizes = [base + (1 if rank >= world - extra else 0) for rank in range(world)]
    starts = [sum(sizes[:rank]) for rank in range(world)]
    return StageLayout(world, tuple(range(start, start + size) for start, size in zip(starts, sizes)))
