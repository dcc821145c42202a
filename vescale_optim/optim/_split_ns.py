"""Newton–Schulz of one matrix split over a group of ranks, each holding a block of its rows.

torch's iteration runs on `X` (a x b, a <= b: the matrix, transposed when tall) divided by its
Frobenius norm; each of `steps` steps is `A = X Xᵀ`, `B = β A + γ A A`, `X <- α X + B X`. Every
product is row-wise in its left factor, so a member holding the rows `X_i` computes

    A_i = X_i Xᵀ             needs all of X
    B_i = β A_i + γ A_i A    needs all of A (A is symmetric: A_i A is the rows i of A A)
    X_i <- α X_i + B_i X     needs all of X, which it already has

The exchange per step is one all-gather of X's row blocks (a·b elements) and one of A's (a·a),
in bf16, of the very values one rank computes: the result equals the one-rank iteration up to
the reduction order inside each matmul. A member receives `(g-1)/g (ab + a²)` elements a step.
The alternatives cost more: splitting X by columns makes `A = Σ_j X^j X^jᵀ` a sum of partial
Grams, an all-reduce of a² (in fp32, to round as one matmul does) plus an all-gather of B's
rows, `10a²` bytes against this split's `2(ab + a²)`: cheaper only when `b > 4a` (no matrix the
planner splits in the benchmark models); iterating on the Gram matrix alone changes the
rounding. No all-reduce is needed for the norm: the first gather brings the whole matrix (the
members' rows of M), and each member takes the norm of it as one rank does, bit for bit.

A tall matrix (m > n) is held by rows of M, which are columns of X: after the first gather
the members work on row blocks of X (`x_rows`), and in the last step they gather B too (a·a
more) and compute their own columns of the new X, `α X[:, c] + B X[:, c]`: their rows of M.

`member` is one member's part as a generator: it yields what it contributes to each
all-gather and is sent the gathered matrix. `simulate` runs every member in one process;
`run_split` runs this rank's members of several groups together over their process groups,
one round of all-gathers at a time, so each group's exchange overlaps another's compute.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass

import torch

from ..kernels.newton_schulz import ns_schedule
from ..shard.collectives import Comm, all_gather_into_


@dataclass(frozen=True)
class Split:
    """How one `shape = (m, n)` matrix is split over `len(rows)` members, in member order:
    `rows` of M each holds (its data, contiguous in the flat matrix), `x_rows` of X each
    computes (the same as `rows` unless the matrix is tall)."""

    shape: tuple[int, int]
    rows: tuple[int, ...]
    x_rows: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def tall(self) -> bool:
        return self.shape[0] > self.shape[1]

    def member_flops(self, index: int, steps: int) -> int:
        """FLOPs member `index` runs: its rows of `X Xᵀ`, `A A` and `B X` each step (a tall
        matrix's last `B X` by its columns instead); the members' sum is `ns_flops`."""
        m, n = self.shape
        a, b, x = min(m, n), max(m, n), self.x_rows[index]
        if not self.tall:
            return steps * (4 * x * a * b + 2 * x * a * a)
        last = 2 * a * a * self.rows[index]  # B X[:, its columns]
        return steps * (2 * x * a * b + 2 * x * a * a) + (steps - 1) * 2 * x * a * b + last

    def gathers(self, steps: int) -> list[tuple[tuple[int, ...], int]]:
        """The all-gathers of a split run, as `(rows per member, columns)`: M's blocks, then
        each step X's (but the first) and A's, and B's in a tall matrix's last step."""
        m, n = self.shape
        a, b = min(m, n), max(m, n)
        out = [(self.rows, n)]
        for k in range(steps):
            if k:
                out.append((self.x_rows, b))
            out.append((self.x_rows, a))
            if self.tall and k == steps - 1:
                out.append((self.x_rows, a))
        return out

    def start(self, index: int) -> int:
        """The first row of M member `index` holds."""
        return sum(self.rows[:index])


Request = tuple[torch.Tensor, tuple[int, ...]]  # (this member's rows, every member's row count)


def member(
    split: Split, index: int, block: torch.Tensor, steps: int, coefficients, eps: float
) -> Generator[Request, torch.Tensor, torch.Tensor]:
    """Member `index`'s split Newton–Schulz on its `block` (its rows of M): yields `(rows,
    counts)` for each all-gather and is sent the gathered matrix (`sum(counts)` rows); returns
    its rows of `NS(M)` in bf16. `coefficients` as `newton_schulz` takes them (one triple,
    one per step, or a name)."""
    schedule, scale = ns_schedule(coefficients, steps)
    steps = len(schedule)
    full = yield block, split.rows
    X = full.bfloat16()
    if split.tall:
        X = X.mT
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
    X = X / (norm if scale == 1.0 else norm * scale).clamp(min=eps)  # as one rank does
    lo = sum(split.x_rows[:index])
    Xi = X[lo : lo + split.x_rows[index]]
    for k, (a, b, c) in enumerate(schedule):
        if k:
            X = yield Xi, split.x_rows
        Ai = Xi @ X.mT
        A = yield Ai, split.x_rows
        Bi = torch.addmm(Ai, Ai, A, beta=b, alpha=c)
        if split.tall and k == steps - 1:
            B = yield Bi, split.x_rows
            start = split.start(index)
            cols = X[:, start : start + split.rows[index]]
            return torch.addmm(cols, B, cols, beta=a).mT
        Xi = torch.addmm(Xi, Bi, X, beta=a)
    return Xi


def padded(block: torch.Tensor, width: int, out: torch.Tensor) -> None:
    """`block` (r x cols, r <= width) into `out` (width x cols), zeros below."""
    out[: block.shape[0]].copy_(block)
    out[block.shape[0] :].zero_()


def assemble(gathered: torch.Tensor, counts: Sequence[int], cols: int) -> torch.Tensor:
    """The `sum(counts)` x cols matrix from an all-gather of blocks padded to `max(counts)` rows."""
    width = max(counts)
    blocks = gathered.view(len(counts), width, cols)
    if all(n == width for n in counts):
        return blocks.view(-1, cols)
    return torch.cat([blocks[i, :n] for i, n in enumerate(counts)])


def simulate(split: Split, matrix: torch.Tensor, steps: int, coefficients, eps: float) -> torch.Tensor:
    """`NS(matrix)` computed by every member of `split` in this process, the all-gathers done
    through the same padding and assembly as over a process group."""
    gens, requests, results = [], [], [None] * split.size
    for i in range(split.size):
        start = split.start(i)
        gens.append(member(split, i, matrix[start : start + split.rows[i]], steps, coefficients, eps))
        requests.append(next(gens[-1]))
    while any(r is not None for r in requests):
        counts, cols = requests[0][1], requests[0][0].shape[1]
        width = max(counts)
        gathered = requests[0][0].new_empty(split.size, width, cols)
        for i, (rows, _) in enumerate(requests):
            padded(rows, width, gathered[i])
        full = assemble(gathered.view(-1), counts, cols)
        for i, gen in enumerate(gens):
            try:
                requests[i] = gen.send(full)
            except StopIteration as done:
                requests[i], results[i] = None, done.value
    return torch.cat(results)


@dataclass(frozen=True)
class Job:
    """This rank's part of one split matrix: member `index` of `split` over `comm` (the
    group's process group, in which this rank is `index`), holding `block` (its rows of M,
    rows x n), with its param group's Newton–Schulz settings."""

    split: Split
    index: int
    block: torch.Tensor
    comm: Comm
    steps: int
    coefficients: tuple[tuple[float, float, float], ...] | tuple[float, float, float] | str
    eps: float


def run_split(jobs: Sequence[Job]) -> tuple[list[torch.Tensor], int]:
    """Every job's rows of `NS(M)`, and the bytes this rank received. Rounds of all-gathers:
    each round issues every unfinished job's next all-gather (asynchronously, in job order,
    which every rank keeps: the order of the plan's matrices) and then resumes each job with
    its result. A job's k-th all-gather is in round k on each of its members, so no collective
    waits for one of a later round, and the groups' exchanges overlap one another's compute."""
    gens = [member(j.split, j.index, j.block, j.steps, j.coefficients, j.eps) for j in jobs]
    requests = [next(g) for g in gens]
    results: list[torch.Tensor | None] = [None] * len(jobs)
    received = 0
    while any(r is not None for r in requests):
        issued = []
        for job, req in zip(jobs, requests):
            if req is None:
                issued.append(None)
                continue
            rows, counts = req
            width, cols, comm = max(counts), rows.shape[1], job.comm
            gathered = rows.new_empty(len(counts) * width * cols)
            mine = gathered[comm.rank * width * cols : (comm.rank + 1) * width * cols]
            padded(rows, width, mine.view(width, cols))
            handle = all_gather_into_(gathered, mine, comm, async_op=True, what="split Newton–Schulz")
            received += (len(counts) - 1) * width * cols * gathered.element_size()
            issued.append((gathered, counts, cols, handle))
        for i, item in enumerate(issued):
            if item is None:
                continue
            gathered, counts, cols, handle = item
            handle.wait()
            try:
                requests[i] = gens[i].send(assemble(gathered, counts, cols))
            except StopIteration as done:
                requests[i], results[i] = None, done.value
    return results, received
