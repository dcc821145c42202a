"""The sharded-optimizer base: buckets, flat buffers, the step pipeline and clipping.

A subclass says how big a unit of each parameter is (`_unit`), which flat state it
keeps per bucket (`_state_names`) and how to update a bucket's local slice
(`_update`). Everything else — binding parameters into planned buckets, averaging
gradients with one reduce-scatter per bucket, gathering parameters back with one
all-gather, clipping and checkpoints — lives here.
"""

from __future__ import annotations

import math
import warnings

import torch

from ..shard import Comm, all_gather_, all_reduce_, bind_parameters, bucket_indices, plan_layout
from ..shard import reduce_scatter_ as _reduce_scatter
from ..shard.collectives import all_gather_object
from . import lowbit
from .checkpoint import CheckpointMixin

_MASTER_DTYPES = (torch.bfloat16, torch.float16)


class Bucket:
    """Parameters of one param group and dtype, planned and bound together."""

    def __init__(self, params: list[torch.nn.Parameter], indices: list[int], group: dict, layout, comm: Comm):
        self.params, self.indices, self.group, self.layout = params, indices, group, layout
        self.pbuf, self.gbuf = bind_parameters(params, layout, comm.rank)
        self.master: torch.Tensor | None = None
        if self.pbuf.data.dtype in _MASTER_DTYPES:
            self.master = self.pbuf.local.float()
        self.state: dict[str, torch.Tensor] = {}
        self.step = 0

    @property
    def local_params(self) -> torch.Tensor:
        """The fp32 (or native) local parameter slice the update writes."""
        return self.master if self.master is not None else self.pbuf.local

    def local_grads(self) -> torch.Tensor:
        g = self.gbuf.local
        return g.float() if self.master is not None else g

    def publish(self) -> None:
        """Copy the master slice into the parameters' own (low-precision) slice."""
        if self.master is not None:
            self.pbuf.local.copy_(self.master)


class ShardedOptimizer(CheckpointMixin, torch.optim.Optimizer):
    """A `torch.optim.Optimizer` whose parameters, gradients and state are ragged-sharded.

    Without an initialised process group it is an ordinary single-process optimizer.
    """

    state_bits = 32  # storage of element-wise state; subclasses may take it as an argument

    def __init__(
        self,
        params,
        defaults: dict,
        *,
        process_group=None,
        bucket_cap_numel: int = 64 * 1024 * 1024,
        align: int = 16,
        skip_nonfinite: bool = False,
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
        index = {id(p): i for i, p in enumerate(all_params)}
        trainable = [
            (p, gi) for gi, g in enumerate(self.param_groups) for p in g["params"] if p.requires_grad
        ]
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
            bucket = Bucket(params, [index[id(p)] for p in params], group, layout, self._comm)
            bucket.state = self._init_state(bucket)
            buckets.append(bucket)
        self._buckets = buckets

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
        )

    def _update(self, bucket: Bucket, grads: torch.Tensor) -> None:
        """Update `bucket.local_params` (and state) from the averaged local `grads`."""
        raise NotImplementedError

    # --- construction checks ------------------------------------------------------

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

    def _reattach(self) -> None:
        """Put back views that were replaced (e.g. `model.zero_grad()` sets grads to None,
        so autograd allocates new ones), keeping whatever values they hold."""
        for b in self._buckets:
            for i, p in enumerate(b.params):
                view = b.pbuf.view(i)
                if p.data_ptr() != view.data_ptr() or p.shape != view.shape:
                    view.copy_(p.detach())
                    p.data = view
                gview = b.gbuf.view(i)
                if p.grad is None:
                    gview.zero_()
                    p.grad = gview
                elif p.grad.data_ptr() != gview.data_ptr():
                    gview.copy_(p.grad)
                    p.grad = gview

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Average gradients over ranks into each rank's local slices (once per step)."""
        if self._grads_reduced:
            return
        self._reattach()
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
            warnings.warn(f"skipped step: non-finite gradients ({self.skipped_steps} so far)", stacklevel=2)
            return loss
        self._step_buckets()
        return loss

    def _step_buckets(self) -> None:
        """Update every bucket's local slice, then gather parameters back."""
        for b in self._buckets:
            b.step += 1
            self._update(b, b.local_grads())
        self._gather_params()

    def _gather_params(self) -> None:
        handles = []
        for b in self._buckets:
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

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffers. Gradients stay views of them whatever `set_to_none`
        says, since they must be where the reduce-scatter reads; frozen parameters
        follow `set_to_none` as in torch."""
        for b in self._buckets:
            b.gbuf.data.zero_()
            for i, p in enumerate(b.params):
                if p.grad is None or p.grad.data_ptr() != b.gbuf.view(i).data_ptr():
                    p.grad = b.gbuf.view(i)
        for g in self.param_groups:
            for p in g["params"]:
                if not p.requires_grad and p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.zero_()
        self._grads_reduced = False

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
        """Bytes of optimizer state (masters included) held by this rank."""
        return sum(t.numel() * t.element_size() for t in self._local_state_tensors())

    def _local_state_tensors(self):
        for b in self._buckets:
            yield from b.state.values()
            if b.master is not None:
                yield b.master


__all__ = ["Bucket", "ShardedOptimizer"]
