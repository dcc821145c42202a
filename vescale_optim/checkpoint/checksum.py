"""Checksums of a checkpoint's files: computed from the bytes as DCP writes them, checked on load.

The checksum is zlib's CRC-32 (`ALGORITHM`). It guards against damage (a flipped bit, a torn
or partly rewritten file, a copy that went wrong), not against someone forging a file, and
for that it is the fastest choice in the standard library: on this project's CPU host, over
64 MiB, `zlib.crc32` ran at 2.9 GB/s, `hashlib.sha256` at 1.4, `blake2b` and `md5` at 0.6.
A CRC-32 detects every burst of up to 32 flipped bits and misses other damage with
probability 2**-32. Like hashlib, `zlib.crc32` releases the GIL on buffers over 5 KiB, so an
asynchronous save's writer thread computes it while training runs on the main thread.

* `SummingWriter` is DCP's `FileSystemWriter` whose streams count and checksum every byte
  on its way to the file (`SummingFileSystem`): nothing is read back. Each rank's data files'
  `(bytes, checksum)` travel to the coordinator with the write results DCP gathers anyway,
  and the coordinator adds its `.metadata`'s: `SummingWriter.files` on rank 0 names every
  file of the checkpoint, which the manager writes into the manifest.
* `of_file` reads a file back in chunks for a load's verification.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.futures import Future

ALGORITHM = "crc32"
CHUNK = 8 << 20  # bytes a verification reads at a time


class Crc32:
    """A running CRC-32 and byte count; `hexdigest()` is the manifest's form (8 hex digits)."""

    def __init__(self) -> None:
        self.value = 0
        self.size = 0

    def update(self, data) -> None:
        """Add `data` (any contiguous buffer: bytes, a memoryview of a tensor's storage)."""
        view = memoryview(data)
        self.value = zlib.crc32(view, self.value)
        self.size += view.nbytes

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


class _Counting:
    """A binary stream opened for writing whose every `write` is also counted and, with a
    `summer`, checksummed (the file's bytes are exactly what passed through here, in order:
    DCP's file writer only appends). Anything else goes to the stream itself."""

    def __init__(self, stream, summer: Crc32 | None) -> None:
        self._stream, self._summer, self.size = stream, summer, 0

    def write(self, data) -> int:
        n = self._stream.write(data)
        if self._summer is not None:
            self._summer.update(data)
        self.size += memoryview(data).nbytes
        return n

    def __getattr__(self, name: str):  # tell, flush, fileno, close, ...
        return getattr(self._stream, name)


class SummingFileSystem(FileSystem):
    """DCP's local file system whose files opened for writing are counted and checksummed:
    `record[name] = (bytes, checksum or None)` once a file is closed, kept under its new
    name when DCP renames it (`.metadata.tmp` -> `.metadata`). `checksums=False` only counts."""

    def __init__(self, checksums: bool = True) -> None:
        super().__init__()
        self.checksums = checksums
        self.record: dict[str, tuple[int, str | None]] = {}
        self._lock = threading.Lock()  # DCP may write files from several threads

    @contextmanager
    def create_stream(self, path, mode: str) -> Generator:
        if "w" not in mode and "a" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        summer = Crc32() if self.checksums else None
        with super().create_stream(path, mode) as stream:
            counting = _Counting(stream, summer)
            yield counting
        with self._lock:
            self.record[Path(path).name] = (counting.size, None if summer is None else summer.hexdigest())

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        with self._lock:
            if Path(path).name in self.record:
                self.record[Path(new_path).name] = self.record.pop(Path(path).name)


class _Written(list):
    """One rank's write results, and `files`: the data files it wrote, name -> (bytes,
    checksum). DCP gathers this list to the coordinator as it is (pickled with `files`)."""

    files: dict[str, tuple[int, str | None]]


class SummingWriter(dcp.FileSystemWriter):
    """DCP's file writer recording every file's size and checksum as it writes it (see the
    module's docstring); after `dcp.save`, the coordinator's `files` names every file of the
    checkpoint, `.metadata` included (other ranks' is empty). `per_thread_copy_ahead=0`
    picks DCP's serial loader: the overlapping one, which it takes whenever CUDA is
    available, synchronises the current CUDA stream (on a thread of its own: device 0's,
    creating a context there) although a staged state has nothing left to copy."""

    def __init__(self, path, checksums: bool = True) -> None:
        super().__init__(path, per_thread_copy_ahead=0)
        self.fs = SummingFileSystem(checksums)
        self.files: dict[str, tuple[int, str | None]] = {}

    def write_data(self, plan, planner) -> Future:
        results = _Written(super().write_data(plan, planner).wait())
        results.files = dict(self.fs.record)
        done: Future = Future()
        done.set_result(results)
        return done

    def finish(self, metadata, results) -> None:
        files: dict[str, tuple[int, str | None]] = {}
        for rank_results in results:
            files.update(getattr(rank_results, "files", {}))
        super().finish(metadata, results)
        meta = self.fs.record.get(".metadata")
        if meta is not None:
            files[".metadata"] = meta
        self.files = files


def of_file(path: Path, buffer: bytearray | None = None) -> tuple[int, str]:
    """(bytes, checksum) of the file at `path`, read in chunks of `CHUNK` bytes."""
    summer = Crc32()
    buffer = buffer if buffer is not None else bytearray(CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            summer.update(view[:n])
    return summer.size, summer.hexdigest()


def verify(path: Path, files: dict[str, list], names: list[str], checksums: bool = True) -> list[str]:
    """What is wrong with the files `names` of the checkpoint in `path`, against the
    manifest's `files` (name -> [bytes, checksum or None]): a file missing, of another size,
    or (with `checksums`, where one was recorded) whose bytes do not match its checksum."""
    problems, buffer = [], None
    for name in names:
        size, digest = files[name]
        f = path / name
        try:
            have = f.stat().st_size
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        except OSError as e:
            problems.append(f"{name} cannot be read ({type(e).__name__}: {e})")
            continue
        if have != size:
            how = "is truncated" if have < size else "has grown"
            problems.append(f"{name} {how} ({have:,} bytes; the manifest records {size:,})")
            continue
        if not checksums or digest is None:
            continue
        buffer = buffer if buffer is not None else bytearray(CHUNK)
        try:
            _, got = of_file(f, buffer)
        except OSError as e:
            problems.append(f"{name} cannot be read ({type(e).__name__}: {e})")
            continue
        if got != digest:
            problems.append(f"{name} is damaged: its {ALGORITHM} is {got}, the manifest records {digest}")
    return problems


__all__ = ["ALGORITHM", "Crc32", "SummingFileSystem", "SummingWriter", "of_file", "verify"]
