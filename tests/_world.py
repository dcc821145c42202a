"""A persistent local gloo world for multi-rank tests (`vescale_optim.local_world`, one thread per rank).

Each `World` keeps `size` worker processes alive, all in one gloo process group.
`world.run(fn, *args)` runs `fn(*args)` on every rank and returns the per-rank
results. A rank that raises fails the call with its traceback (`RankError`); a call that does
not finish within `timeout` seconds kills the world and raises `TimeoutError`, so a hang is a
test failure rather than a stuck CI.
"""

from __future__ import annotations

from vescale_optim.local_world import LocalWorld, RankError

__all__ = ["RankError", "World", "WorldPool"]


class World(LocalWorld):
    def __init__(self, size: int, start_timeout: float = 120.0):
        super().__init__(size, threads=1, start_timeout=start_timeout, collective_timeout=120.0)


class WorldPool:
    """Lazily started worlds, one per size, closed together."""

    def __init__(self):
        self._worlds: dict[int, World] = {}

    def __call__(self, size: int) -> World:
        w = self._worlds.get(size)
        if w is None or not w.alive:
            w = self._worlds[size] = World(size)
        return w

    def close(self) -> None:
        for w in self._worlds.values():
            w.close()
        self._worlds.clear()
