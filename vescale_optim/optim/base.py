"""The sharded-optimizer base: buckets, flat buffers, the step pipeline and clipping.

A subclass says how big a unit of each parameter is (`_unit`), which flat state it
keeps per bucket (`_state_names`) and how to update a bucket's local slice
(`_update`). Everything else — binding parameters into planned buckets, averaging
gradients with one reduce-scatter per bucket, gathering parameters back with one
all-gather, clipping and checkpoints — lives here.

A parameter takes a step iff some rank has a gradient for it (`p.grad is not None`),
as in torch; the ranks agree on that with one small all-reduce per step.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch.profiler import record_function

from ..shard import Comm, all_gather_, all_reduce_, bucket_indices, plan_layout
from ..shard import reduce_scatter_ as _reduce_scatter
from ..shard.collectives import all_gather_object, broadcast_
from . import lowbit
from ._guards import caller_stacklevel, check_amp_scaler, label_params
from .bucket import Bucket
from .checkpoint import CheckpointMixin
from .gradients import GradTrackingMixin


class ShardedOptimizer(CheckpointMixin, GradTrackingMixin, torch.optim.Optimizer):
    """A `torch.optim.Optimizer` whose parameters, gradients and state are ragged-sharded.

    Without an initialised process group it is an ordinary single-process optimizer.
    """

    state_bits = 32  # storage of element-wise state; subclasses may take it as an argument
    _whole_buckets = False  # step every parameter of a bucket when any of them steps
    _structural: tuple[str, ...] = ()  # param-group keys that shape the state: fixed after construction

    def __init__(
        self,
        params,
        defaults: dict,
        *,
        process_group=None,
        bucket_cap_numel: int = 64 * 1024 * 1024,
        align: int = 16,
        skip_nonfinite: bool = False,
        sync_params: bool = True,
    ):
        self._buckets = None
        super().__init__(params, defaults)
        self._comm = Comm(process_group)
        self.skip_nonfinite = skip_nonfinite
        self.skipped_steps = 0
        self._grads_reduced = False
        all_params = [p for g in self.param_groups for p in g["params"]]
        self._check_params(all_params)
        self._check_same_on_every_rank()
        self._labels = label_params(self.param_groups)
        index = {id(p): i for i, p in enumerate(all_params)}
        trainable = [
            (p, gi) for gi, g in enumerate(self.param_groups) for p in g["params"] if p.requires_grad
        ]
        for p, _ in trainable:
            if p.dtype == torch.float64 and lowbit.tier(p, self.state_bits) != "fp32":
                raise ValueError(
                    f"parameter {self._labels[id(p)]} is float64, but state_bits={self.state_bits} would "
                    "keep its state below fp32; use state_bits=32"
                )
        keys = [
            (
                gi,
                p.dtype,
                p.device,
                lowbit.tier(p, self.state_bits),
                self._bucket_key(p, self.param_groups[gi]),
            )
            for p, gi in trainable
        ]
        buckets: list[Bucket] = []
        for idx in bucket_indices([p.numel() for p, _ in trainable], keys, bucket_cap_numel):
            params = [trainable[i][0] for i in idx]
            group = self.param_groups[trainable[idx[0]][1]]
            quantized = lowbit.tier(params[0], self.state_bits) == "q8"
            units = [lowbit.q8_unit(p) if quantized else self._unit(p, group) for p in params]
            bucket_align = math.lcm(align, lowbit.BLOCK) if quantized else align
            layout = plan_layout([p.numel() for p in params], units, self._comm.world_size, bucket_align)
            buckets.append(Bucket(params, [index[id(p)] for p in params], group, layout, self._comm))
        self._buckets = buckets
        bucketed = {id(p) for b in buckets for p in b.params}
        self._frozen = [p for p in all_params if id(p) not in bucketed]
        if sync_params:
            self._broadcast_params()
        for b in buckets:
            b.init_master()
            b.state_names = self._state_names(b)  # fixed: the keys that shape them are
            b.state = self._init_state(b)
        self._structure = [{k: g.get(k) for k in self._structural} for g in self.param_groups]
        self._install_hooks()

    # --- subclass hooks -----------------------------------------------------------

    def _unit(self, p: torch.Tensor, group: dict) -> int:
        """Elements per unit: rank boundaries inside `p` fall on multiples of this."""
        return 1

    def _bucket_key(self, p: torch.Tensor, group: dict) -> object:
        """Extra key: parameters with different keys never share a bucket."""
        return None

    def _state_names(self, bucket: Bucket) -> list[str]:
        """Names of the element-wise state tensors kept for a bucket's local slice."""
        return []

    def _kind(self, bucket: Bucket) -> str:
        """Storage tier of the bucket's element-wise state (see `lowbit`)."""
        return lowbit.tier(bucket.params[0], self.state_bits)

    def _init_state(self, bucket: Bucket) -> dict[str, torch.Tensor]:
        """The bucket's local state: each of `_state_names` over the local slice, zero."""
        return lowbit.new_state(
            self._state_names(bucket),
            self._kind(bucket),
            bucket.layout.shard_size,
            bucket.local_params.device,
            bucket.local_params.dtype,
        )

    def _update(self, bucket: Bucket, grads: torch.Tensor) -> None:
        """Update the active ranges (`bucket.runs()`) of `bucket.local_params` (and state)
        from the averaged local `grads`."""
        raise NotImplementedError

    def _check_group(self, gi: int, group: dict) -> str | None:
        """A problem with a param group's current hyperparameters, checked at every step."""
        return None

    # --- construction ---------------------------------------------------------------

    @staticmethod
    def _check_params(params: list[torch.Tensor]) -> None:
        seen = set()
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"parameter {i} is a {type(p).__name__}, not a tensor")
            if id(p) in seen:
                raise ValueError(f"parameter {i} (shape {tuple(p.shape)}) appears more than once")
            seen.add(id(p))
            if p.is_sparse or p.layout != torch.strided:
                raise ValueError(f"parameter {i} (shape {tuple(p.shape)}) is sparse; only dense parameters")
            if not p.is_floating_point():
                raise ValueError(f"parameter {i} (shape {tuple(p.shape)}) has dtype {p.dtype}; need floating")

    def _signature(self) -> list[tuple]:
        sig = []
        for gi, g in enumerate(self.param_groups):
            hyper = tuple(sorted((k, repr(v)) for k, v in g.items() if k != "params"))
            sig.append(("group", gi, len(g["params"]), hyper))
            sig.extend(
                ("param", gi, j, tuple(p.shape), str(p.dtype), p.requires_grad)
                for j, p in enumerate(g["params"])
            )
        return sig

    def _check_same_on_every_rank(self) -> None:
        """Raise (on every rank, so nobody hangs later) if ranks passed different params."""
        sigs = all_gather_object(self._signature(), self._comm)
        for rank, sig in enumerate(sigs):
            if sig == sigs[0]:
                continue
            for a, b in zip(sigs[0], sig):
                if a != b:
                    raise ValueError(f"rank {rank} passed different parameters than rank 0: {b} vs {a}")
            raise ValueError(
                f"rank {rank} passed {sum(s[0] == 'param' for s in sig)} parameters, rank 0 passed "
                f"{sum(s[0] == 'param' for s in sigs[0])}"
            )

    @torch.no_grad()
    def _broadcast_params(self) -> None:
        """Make every rank's parameters rank 0's: one broadcast per bucket (frozen
        parameters, which have no bucket, one each)."""
        handles = [broadcast_(b.pbuf.data, 0, self._comm, async_op=True) for b in self._buckets]
        for p in self._frozen:
            if p.is_contiguous():
                broadcast_(p.data, 0, self._comm)
            else:
                tmp = p.detach().contiguous()
                broadcast_(tmp, 0, self._comm)
                p.copy_(tmp)
        for h in handles:
            h.wait()

    # --- the step pipeline --------------------------------------------------------

    @property
    def process_group(self):
        return self._comm.group

    @property
    def world_size(self) -> int:
        return self._comm.world_size

    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # read by torch.amp.GradScaler.step; refuses a scaler whose skip decision is per rank
        check_amp_scaler(self._comm.active)
        return False

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Agree which parameters step and average gradients over ranks into each rank's
        local slices (once per step)."""
        if self._grads_reduced:
            return
        with record_function("vescale_optim.agree"):
            self._agree()
        self._reattach()
        with record_function("vescale_optim.reduce_scatter"):
            handles = [_reduce_scatter(b.gbuf, self._comm, "mean", async_op=True) for b in self._buckets]
            for h in handles:
                h.wait()
        self._grads_reduced = True

    @property
    def _device(self) -> torch.device:
        """Where this rank's buckets live (small control tensors go there too, for NCCL)."""
        return self._buckets[0].gbuf.data.device if self._buckets else torch.device("cpu")

    def _any_nonfinite(self) -> bool:
        flag = torch.zeros(1, device=self._device)
        for b in self._buckets:
            if not torch.isfinite(b.gbuf.local).all():
                flag.fill_(1)
                break
        all_reduce_(flag, self._comm, "max")
        return bool(flag.item())

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.reduce_gradients()
        self._grads_reduced = False
        if self.skip_nonfinite and self._any_nonfinite():
            self.skipped_steps += 1
            warnings.warn(
                f"skipped step: non-finite gradients ({self.skipped_steps} so far)",
                stacklevel=caller_stacklevel(),
            )
            return loss
        for b in self._buckets:
            b.advance()
            if b.any_active:
                b.refresh_master()
        with record_function("vescale_optim.update"):
            self._step_buckets()
        return loss

    def _step_buckets(self) -> None:
        """Update every bucket's local slice, then gather parameters back."""
        for b in self._buckets:
            if b.any_active:
                self._update(b, b.local_grads())
        self._gather_params([b for b in self._buckets if b.any_active])

    def _gather_params(self, buckets: list[Bucket] | None = None) -> None:
        handles = []
        for b in self._buckets if buckets is None else buckets:
            b.publish()
            handles.append(all_gather_(b.pbuf, self._comm, async_op=True))
        for h in handles:
            h.wait()

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_buckets", None) is not None:
            raise NotImplementedError(
                f"{type(self).__name__} plans its buffers at construction; pass every param group then"
            )
        super().add_param_group(param_group)

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the averaged gradient to `max_norm` in `norm_type` norm over all shards.

        Returns the total norm before clipping (the same on every rank, and what
        `torch.nn.utils.clip_grad_norm_` gives on one process with the mean gradient).
        The reduce-scatter happens here, and `step()` does not repeat it.
        """
        self.reduce_gradients()
        norm_type = float(norm_type)
        grads = [b.gbuf.local for b in self._buckets if b.gbuf.local.numel()]
        inf = math.isinf(norm_type)
        parts = [g.abs().max().float() if inf else torch.linalg.vector_norm(g.float(), norm_type) ** norm_type
                 for g in grads]  # fmt: skip
        total = torch.zeros(1, device=self._device)
        if parts:
            total[0] = torch.stack(parts).max() if inf else torch.stack(parts).sum()
        all_reduce_(total, self._comm, "max" if inf else "sum")
        total = total[0] if inf else total[0] ** (1.0 / norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
                "so it cannot be clipped. To disable this error and scale the gradients by the "
                "non-finite norm anyway, set `error_if_nonfinite=False`"
            )
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total

    def local_state_numel(self) -> int:
        """Elements of optimizer state (masters included) held by this rank."""
        return sum(t.numel() for t in self._local_state_tensors())

    def local_state_bytes(self) -> int:
        """Bytes of every persistent tensor the optimizer holds on this rank besides the
        parameter and gradient buffers: state, masters and working buffers."""
        return sum(t.numel() * t.element_size() for t in self._local_state_tensors())

    def _local_state_tensors(self):
        for b in self._buckets:
            yield from b.state.values()
            if b.master is not None:
                yield b.master


__all__ = ["Bucket", "ShardedOptimizer"]
