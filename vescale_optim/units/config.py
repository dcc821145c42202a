"""The sharding keywords, declared once: every optimizer takes them as `**sharding`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from ..kernels import wire


@dataclass(frozen=True)
class ShardingConfig:
    """How an optimizer shards its parameters, gradients and state over ranks.

    Every optimizer of the library takes every field as a keyword
    (`opt = Optimizer(params, lr=1e-3, shard_modules=[*model.layers, model])`):

    - `process_group`: the group to shard over (default: the world, or one process
      when `torch.distributed` is not initialised); or `mesh`: a 1-D `DeviceMesh`, or a
      2-D one with dimensions `("replicate", "shard")` for HSDP.
    - `shard_modules`: the modules whose parameters form one unit each, gathered before
      their forward and backward and freed after (ZeRO-3; list the model itself last).
      None keeps parameters whole on every rank (ZeRO-2), in buckets of at most
      `bucket_cap_numel` elements.
    - `reshard_after_forward`: free a unit after its forward (False: keep it gathered
      until its backward).
    - `backward_prefetch`: gather the next unit of backward while one computes (False:
      at most two unit-sized buffers in backward, no gather overlap).
    - `param_dtype` / `reduce_dtype`: the dtype of the gathered parameters (compute and
      all-gather) and of the gradient reduction (default: `param_dtype`).
    - `device`: where the shards of a model built on the meta device go (default: the
      process group's device).
    - `param_init_fn`: how a module built on the meta device is initialised:
      `param_init_fn(module)` for every module holding meta parameters or buffers, one unit
      at a time, after its meta tensors got memory on `device` (with transformers:
      `param_init_fn=model._init_weights`); default: the module's `reset_parameters()`.
    - `sync_params`: start every rank from rank 0's parameters (one broadcast per unit).
    - `skip_nonfinite`: skip a step (on every rank) whose gradients hold inf or NaN.
    - `gather_bits` / `reduce_bits`: 8 sends the unit all-gathers / gradient reductions as
      int8 codes with one fp32 scale per block of `comm_block` consecutive elements of a
      tensor (no rank boundary cuts a block, so the numbers do not depend on the world
      size); None (default) sends full precision. Shards, masters, state and checkpoints
      stay full precision. The bits name a wire codec (`kernels.wire`: 8 is "q8"); a format
      registered there is taken by its bits, its block rules checked on `comm_block`.
    - `align`: every tensor starts at a multiple of this many elements in its buffer.
    - `microbatches`: backward passes per optimizer step (a pipeline schedule's micro-batches,
      or gradient accumulation): the first `microbatches - 1` keep their gradients unreduced
      and the last reduces them once, overlapped with its backward; one reduction per step
      instead of one per micro-batch, for a full-size gradient per unit held in between. 1
      (default) reduces in every backward: only shards are held, when memory asks for it.
      Any number of backward passes stays correct: `step()` reduces what is left.
    """

    process_group: Any = None
    mesh: Any = None
    shard_modules: Sequence[nn.Module] | None = None
    reshard_after_forward: bool = True
    backward_prefetch: bool = True
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    device: torch.device | str | None = None
    param_init_fn: Callable[[nn.Module], None] | None = None
    bucket_cap_numel: int = 64 * 1024 * 1024
    sync_params: bool = True
    skip_nonfinite: bool = False
    gather_bits: int | None = None
    reduce_bits: int | None = None
    comm_block: int = 256
    align: int = 16
    microbatches: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.shard_modules, nn.Module):
            raise TypeError(
                "shard_modules is a list of modules (e.g. [*model.layers, model]), not one module"
            )
        if self.shard_modules is not None:
            modules = list(self.shard_modules)
            bad = [type(m).__name__ for m in modules if not isinstance(m, nn.Module)]
            if bad:
                raise TypeError(f"shard_modules must hold nn.Module objects; got {bad[0]}")
            object.__setattr__(self, "shard_modules", modules)
        if self.mesh is not None and not isinstance(self.mesh, DeviceMesh):
            raise TypeError(
                f"mesh must be a torch.distributed.device_mesh.DeviceMesh (e.g. init_device_mesh('cuda', "
                f"(8,)), or world['dp'] of a larger mesh); got {type(self.mesh).__name__} {self.mesh!r}"
            )
        if self.process_group is not None and not isinstance(self.process_group, ProcessGroup):
            raise TypeError(
                "process_group must be a torch.distributed.ProcessGroup (e.g. dist.new_group(ranks)); "
                f"got {type(self.process_group).__name__} {self.process_group!r}"
            )
        for name in ("reshard_after_forward", "backward_prefetch", "sync_params", "skip_nonfinite"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False; got {getattr(self, name)!r}")
        for name in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ValueError(f"{name} must be a floating-point torch.dtype or None; got {dtype!r}")
        for name in ("gather_bits", "reduce_bits"):
            bits = getattr(self, name)
            if bits is not None:
                try:
                    wire.codec(bits)
                except ValueError:
                    raise ValueError(
                        f"{name} must be None (full precision) or the bits of a wire codec: "
                        f"{wire.known()}; got {bits!r}"
                    ) from None
        # the codecs in use say what a block may be (without one, the default "q8" does)
        used = {wire.codec(b) for b in (self.gather_bits, self.reduce_bits) if b is not None}
        for c in used or {wire.codec(8)}:
            problem = c.block_problem(self.comm_block)
            if problem is not None:
                raise ValueError(f"comm_block must be {problem}; got {self.comm_block!r}")
        for name in ("bucket_cap_numel", "align", "microbatches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer; got {value!r}")
        if self.param_init_fn is not None and not callable(self.param_init_fn):
            got = self.param_init_fn
            raise TypeError(f"param_init_fn must be callable as param_init_fn(module); got {got!r}")
        if self.device is not None:
            object.__setattr__(self, "device", torch.device(self.device))

    @classmethod
    def of(cls, owner: str, keywords: dict[str, Any]) -> ShardingConfig:
        """The config from an optimizer's `**sharding` keywords; an unknown keyword is the
        TypeError Python gives for any unexpected keyword argument of `owner`."""
        known = {f.name for f in fields(cls)}
        for key in keywords:
            if key not in known:
                raise TypeError(f"{owner}.__init__() got an unexpected keyword argument '{key}'")
        return cls(**keywords)

    def wire_codec(self, bits: int | None) -> wire.WireCodec | None:
        """The codec `bits` (`gather_bits` or `reduce_bits`) sends with, in `comm_block` blocks."""
        return None if bits is None else wire.codec(bits, self.comm_block)

    @property
    def quantized_block(self) -> int | None:
        """The block every tensor keeps whole on the wire, when a collective goes through a
        wire codec (the least common multiple of the codecs' blocks)."""
        blocks = [self.wire_codec(b).block for b in (self.gather_bits, self.reduce_bits) if b is not None]
        return math.lcm(*blocks) if blocks else None

    @property
    def sharded(self) -> bool:
        """Whether units free their parameters between uses (ZeRO-3)."""
        return self.shard_modules is not None
