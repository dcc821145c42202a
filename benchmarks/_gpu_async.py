"""The library's stages of `benchmarks/gpu_check.py` on an asynchronous device: ZeRO-3 in one
process without a process group (`single_gpu`) and on a world-1 group with the collectives forced
(`delay`), plainly and with every collective or its local copy late; the bits must not change.
Each fills a `Result` (see `_gpu_stages`)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from benchmarks._gpu_common import NEEDS_CUDA, SIZES, _torch, sleep_cycles
from benchmarks._gpu_stages import Result


@contextlib.contextmanager
def _sleepy_side_streams(torch, cycles: int):
    """A device sleep of `cycles` queued on a side stream each time work is issued there
    (the library's `Streams` contexts, patched here only): whatever is issued next on it (an
    all-gather, a reduction or their local copies) lands late, and any reader not ordered after
    it reads too early."""
    from vescale_optim.units import streams

    original = streams.Streams._on

    @contextlib.contextmanager
    def on(self, stream):
        with original(self, stream):
            if self.cuda:
                torch.cuda._sleep(cycles)
            yield

    streams.Streams._on = on
    try:
        yield
    finally:
        streams.Streams._on = original


def stage_single_gpu(r: Result, *, out: Path, mode: str) -> None:
    """ZeRO-3 AdamW and Muon (and AdamW with reduce_bits=8) in one process with no process
    group: what stands in for each collective is a copy on a side stream, which the compute
    stream must wait for. Against torch.optim (bounds of `zero3`; 8-bit reduction: 2 x steps
    x lr), plainly and with a device sleep of ~2 ms on the side streams before every
    local copy (CPU: under the emulated asynchronous device, `delayed()`); the delayed run must
    be the same bits as the plain one."""
    torch = _torch()
    import torch.distributed as dist

    from benchmarks import _gpu_models as gm
    from vescale_optim.shard.handle import delayed

    dev, sz = gm.device_for(mode), SIZES[mode]
    cuda = dev.type == "cuda"
    if dist.is_initialized():
        raise AssertionError("single_gpu runs without a process group")
    steps = 3
    base = gm.build(sz["dim"], sz["blocks"], dev)
    tol = dict(adamw32=1e-5, muon=steps * gm.muon_max_adjusted_lr(base) * 2.0**-6)
    tol["adamw_reduce8"] = 2 * steps * gm.ADAMW["lr"]
    cycles = sleep_cycles(2.0) if cuda else 0
    slow = "sleep" if cuda else "emulated"
    rows = []
    for kind in tol:
        ref = gm.fresh_copy(base)
        ref_kind = "adamw32" if kind == "adamw_reduce8" else kind
        gm.train(ref, gm.make_reference(ref_kind, ref), range(steps), sz["batch"], dev)
        want = gm.full_state(ref)
        got = {}
        for variant in ("plain", slow):
            model = gm.fresh_copy(base)
            extra = {"reduce_bits": 8} if kind == "adamw_reduce8" else {}
            opt = gm.make_ours(ref_kind, model, "zero3", **extra)
            late = _sleepy_side_streams(torch, cycles) if cuda else delayed()
            ctx = late if variant != "plain" else contextlib.nullcontext()
            with ctx:
                gm.train(model, [opt], range(steps), sz["batch"], dev)
                gm.synchronize(dev)
            got[variant] = gm.full_state(model)
            diff, where = gm.max_diff(got[variant], want)
            rows.append(dict(optimizer=kind, variant=variant, max_abs_diff=diff, where=where))
            what = f"max |param - torch.optim| after {steps} steps, no process group (at {where})"
            r.check(f"{kind}.{variant}", diff <= tol[kind], measured=diff, bound=tol[kind], detail=what)
        diff, where = gm.max_diff(got[slow], got["plain"])
        what = f"the {slow} run against the plain one (at {where})"
        r.check(f"{kind}.{slow}_bitwise", diff == 0, measured=diff, bound=0, detail=what)
    if not cuda:
        r.skip("sleep", f"{NEEDS_CUDA}: torch.cuda._sleep on the side streams (rehearsed under delayed())")
    r.measure(rows=rows, tolerances=tol, sleep_cycles=cycles, device=str(dev))
    print(json.dumps(rows, indent=1))


def stage_delay(r: Result, *, out: Path, mode: str) -> None:
    """Every collective of a ZeRO-3 AdamW and Muon run on a world-1 group with the collectives
    forced is preceded by ~2 ms of device sleep on the stream it is issued from
    (`before_issue`; CPU: the emulated asynchronous device, `delayed()`): the trained
    parameters must be the same bits as an undelayed run."""
    torch = _torch()
    from benchmarks import _gpu_models as gm
    from vescale_optim.shard.handle import before_issue, delayed

    dev, sz = gm.device_for(mode), SIZES[mode]
    cuda = dev.type == "cuda"
    found = {}
    with gm.world_of_one(dev):
        cycles = sleep_cycles(2.0) if cuda else 0
        base = gm.build(sz["dim"], sz["blocks"], dev)
        for kind in ("adamw32", "muon"):
            got, counts = {}, {}
            for variant in ("plain", "delayed"):
                model = gm.fresh_copy(base)
                opt = gm.make_ours(kind, model, "zero3")
                count = [0]

                def sleep(what: str, count=count) -> None:
                    count[0] += 1
                    torch.cuda._sleep(cycles)

                if variant == "plain":
                    ctx = contextlib.nullcontext()
                else:
                    ctx = before_issue(sleep) if cuda else delayed()
                with ctx as held:
                    gm.train(model, [opt], range(3), sz["batch"], dev)
                    gm.synchronize(dev)
                counts[variant] = count[0] if cuda else getattr(held, "held_at_wait", 0)
                got[variant] = gm.full_state(model)
            diff, where = gm.max_diff(got["delayed"], got["plain"])
            found[kind] = dict(max_abs_diff=diff, where=where, delayed=counts["delayed"])
            how = "each after ~2 ms of _sleep" if cuda else "held back until waited for (delayed())"
            what = f"{counts['delayed']} collectives {how}; at {where}"
            ok = diff == 0 and counts["delayed"] > 0
            r.check(f"{kind}.bitwise", ok, measured=diff, bound=0, detail=what)
    if not cuda:
        r.skip("sleep", f"{NEEDS_CUDA}: torch.cuda._sleep before every collective (rehearsed: delayed())")
    r.measure(**found, sleep_cycles=cycles, device=str(dev))
    print(json.dumps(found, indent=1))
