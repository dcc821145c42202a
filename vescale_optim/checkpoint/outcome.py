"""What a save or a load came to: `CheckpointError`, and each rank's outcome of a save,
agreed by every rank.

Rank 0 alone prepares a save's folder and commits it (the manifest, the renames, the
pruning); an asynchronous save's error reaches each rank's `wait()` on its own. Where the
ranks used to wait for each other in a barrier, they exchange their outcomes instead (one
collective either way), so a failure on one rank is raised on every rank at once rather
than leaving the others in the barrier until the process group's timeout.
"""

from __future__ import annotations

import torch.distributed.checkpoint as dcp

from ..shard import handle


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into these objects (the message says whether
    anything was changed), or a save that failed on some rank (raised on every rank)."""


def reason(e: BaseException) -> str:
    """One line per failing rank for DCP's error (which carries every rank's traceback)."""
    if not isinstance(e, dcp.CheckpointException):
        return f"{type(e).__name__}: {e}"
    return "; ".join(f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in sorted(e.failures.items()))


def failures(error: BaseException | None, rank: int, group, distributed: bool) -> list[str]:
    """Every rank's failure, `rank r: Error: message` (collective when `distributed`:
    every rank calls it, failed or not). DCP's own error names its ranks already and is
    the same on each, so it is said once."""
    mine = None if error is None else reason(error)
    if error is not None and not isinstance(error, dcp.CheckpointException):
        mine = f"rank {rank}: {mine}"
    everyone = handle.all_gather_object(mine, group) if distributed else [mine]
    return list(dict.fromkeys(m for m in everyone if m is not None))


def load_rest(path, rest: list[tuple[str, object, object]]) -> None:
    """`load_state_dict` of each (what, object, state), once the model and optimizer are
    loaded: these cannot be tried beforehand (a load changes its object), so a failure
    says what was loaded already."""
    done = ["the model", "the optimizer"]
    for what, obj, state in rest:
        try:
            obj.load_state_dict(state)
        except Exception as e:
            raise CheckpointError(
                f"loading {path} is incomplete: {what}'s load_state_dict failed "
                f"({reason(e)}); {', '.join(done)} were loaded already, the rest was "
                "not: load again, or build the run anew"
            ) from e
        done.append(what)
