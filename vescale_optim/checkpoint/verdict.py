"""One rank's share of verifying a checkpoint before it is loaded (the manager agrees the
verdict over the ranks through `shard.collectives`).

A checkpoint's files (its manifest's `files`: DCP's data files and `.metadata`) are shared
out over the loading ranks, rank r taking every `world_size`-th name in sorted order from
the r-th, so the world reads each file once more in all, whatever the world size that saved
it. Each rank keeps its verdict on its share while the files' sizes and modification times
(and the manifest's) are unchanged, so `latest()` followed by `load()` reads them once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

from ..shard.collectives import Comm, all_gather_object
from . import checksum
from . import manifest as _manifest
from .dcp_tree import check_storage
from .manifest import MANIFEST
from .outcome import CheckpointError


def refused(path: Path, step: int, problems: list[str]) -> CheckpointError:
    """The error of a load of `step` from `path` refused for `problems`, before any change."""
    return CheckpointError(
        f"cannot load step {step} from {path}: {'; '.join(problems)}. Nothing was changed."
    )


def unverified(manifest: dict) -> bool:
    """Whether the checkpoint's manifest records no checksum for some file (format 1, or a
    save with `verify=False`): its files can be checked for presence and size only."""
    files = manifest.get("files")
    return files is None or any(digest is None for _, digest in files.values())


class Verifier:
    """This rank's checks of checkpoint folders (`integrity`, sizes only with `verify`
    False) and the verdicts agreed over `comm`'s ranks (`examine`, `newest`, `choose`)."""

    def __init__(self, comm: Comm, verify: bool = True) -> None:
        self.comm, self.rank, self.world_size, self.verify = comm, comm.rank, comm.world_size, verify
        self._sound: dict[Path, tuple] = {}  # folder -> the stats its verified share had

    def _stats(self, path: Path, names: list[str]) -> tuple | None:
        """What the verdict on `names` of `path` is kept by (None: a file is gone)."""
        try:
            return tuple((n, (st := (path / n).stat()).st_size, st.st_mtime_ns) for n in [MANIFEST, *names])
        except OSError:
            return None

    def integrity(self, path: Path, step: int) -> tuple[list[str], dict | None]:
        """This rank's share of checking that the checkpoint of `step` in `path` is complete
        and sound: its manifest (every rank reads it), then this rank's share of its files:
        there, of their size and, with `verify`, checksum. A format-1 manifest records no
        files: rank 0 checks that DCP's metadata reads and its files are long enough.
        Returns the problems found and the manifest (None if it cannot be read)."""
        manifest, problems = _manifest.read(path, step)
        if manifest is None:
            return problems, None
        files = manifest.get("files")
        if files is None:
            return (check_storage(path) if self.rank == 0 else []), manifest
        names = sorted(files)[self.rank :: self.world_size]
        stats = self._stats(path, names)
        if stats is not None and self._sound.get(path) == (self.verify, stats):
            return [], manifest
        problems = checksum.verify(path, files, names, self.verify)
        if not problems and stats is not None:
            self._sound[path] = (self.verify, stats)
        return problems, manifest

    def examine(self, path: Path, step: int, ours: Callable[[int], dict] | None) -> tuple:
        """Whether the checkpoint of `step` in `path` is complete and sound, and (given
        `ours`, the manifest these objects would write at a step) what in its manifest does
        not fit: every rank's findings, agreed in one exchange (collective), and its manifest:
        (problems, misfits, manifest or None)."""
        problems, manifest = self.integrity(path, step)
        misfit = []
        if ours is not None and manifest is not None:
            misfit = _manifest.mismatches(manifest, ours(step))
        everyone = all_gather_object((problems, misfit), self.comm)
        unique = [list(dict.fromkeys(p for mine in everyone for p in mine[i])) for i in (0, 1)]
        return unique[0], unique[1], manifest

    def newest(
        self, steps: list[int], path: Callable[[int], Path], ours: Callable[[int], dict] | None = None
    ) -> tuple[int | None, dict | None, list[str], list[tuple[int, list[str]]]]:
        """The first of `steps` (every rank's the same: newest first) that is complete and
        verifies (collective): (its step or None, its manifest, its misfits, and the steps
        skipped before it with their problems)."""
        skipped = []
        for step in steps:
            problems, misfit, manifest = self.examine(path(step), step, ours)
            if not problems:
                return step, manifest, misfit, skipped
            skipped.append((step, problems))
        return None, None, [], skipped

    def choose(
        self,
        directory: Path,
        step: int | None,
        steps: list[int],
        path: Callable[[int], Path],
        ours: Callable[[int], dict],
    ) -> tuple[int, dict] | None:
        """What a load of `step` reads (collective): (the step, its manifest), or None when
        `step` is None and `steps` (every rank's the same: newest first) is empty. `step`
        must be complete, sound and fit, else `CheckpointError`; without it, the newest
        sound one of `steps` is taken, rank 0 warning about those skipped; none sound
        raises. A checkpoint without checksums warns (with `verify`)."""
        if step is None:
            step, manifest, problems, skipped = self.newest(steps, path, ours)
            if step is None:
                if skipped:
                    bad = "; ".join(f"step-{s}: {', '.join(p)}" for s, p in skipped)
                    raise CheckpointError(
                        f"no checkpoint in {directory} can be loaded ({bad}). Nothing was changed."
                    )
                return None
            if skipped and self.rank == 0:
                bad = "; ".join(f"step-{s} ({', '.join(p)})" for s, p in skipped)
                warnings.warn(
                    f"{directory}: skipped {bad}; loading step-{step}, the newest checkpoint "
                    "that is complete and verifies",
                    stacklevel=3,
                )
        else:
            integrity, misfit, manifest = self.examine(path(step), step, ours)
            problems = integrity + misfit
        if problems:
            raise refused(path(step), step, problems)
        if self.verify and self.rank == 0 and unverified(manifest):
            warnings.warn(
                f"{path(step)} records no checksums (a manifest of format 1, from before they were "
                "recorded, or a save with verify=False): its files were checked for presence and "
                "size only",
                stacklevel=3,
            )
        return step, manifest


__all__ = ["Verifier", "refused", "unverified"]
