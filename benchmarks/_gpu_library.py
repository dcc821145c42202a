"""The library's own stages of `benchmarks/gpu_check.py` on a world-1 group with the collectives
forced (`zero3`, `syncs`, `memory`, `meta`, `checkpoint`; `_gpu_async` has those that delay the
device). Each fills a `Result` (see `_gpu_stages`)."""

from __future__ import annotations

import contextlib
import json
import re
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path

from benchmarks._gpu_common import NEEDS_CUDA, SIZES, _torch
from benchmarks._gpu_stages import Result

# --- zero3 ----------------------------------------------------------------------------------------


def stage_zero3(r: Result, *, out: Path, mode: str) -> None:
    """ZeRO-3 and ZeRO-2 on a world-1 group with the collectives forced, against torch.optim.

    Bounds (fp32 parameters, 3 steps; 4 for Shampoo, whose roots start at step 2): AdamW 32-bit and
    Shampoo (fp64 roots) 1e-5: the parameters are views of a flat buffer and the gradients averaged
    by a collective, so a gradient may round an ulp or two apart (relative 1e-7..1e-6), moving
    Adam's update by about that share of lr a step. AdamW 8-bit against fp32 torch.optim.AdamW:
    2 * steps * lr (another algorithm; each moves an element by at most about lr a step: this bounds
    a broken update, not rounding); its state does not depend on the layout, so ZeRO-3 8-bit is held
    to ZeRO-2 8-bit at 1e-5. Muon: steps * max adjusted lr * 2^-6 (bf16 Newton-Schulz, torch's
    against the Triton kernel: outputs under 1 may differ by a few bf16 ulps, 4 ulps = 2^-6).
    """
    from benchmarks import _gpu_models as gm
    from vescale_optim.shard.handle import traced

    dev, sz = gm.device_for(mode), SIZES[mode]
    steps = {k: 4 if k == "shampoo" else 3 for k in gm.KINDS}
    lr_adj = None
    with gm.world_of_one(dev):
        base = gm.build(sz["dim"], sz["blocks"], dev)
        lr_adj = gm.muon_max_adjusted_lr(base)
        tol = dict(adamw32=1e-5, shampoo=1e-5, adamw8=2 * steps["adamw8"] * gm.ADAMW["lr"])
        tol["muon"] = steps["muon"] * lr_adj * 2.0**-6
        finals, rows = {}, []
        for kind in gm.KINDS:
            ref = gm.fresh_copy(base)
            gm.train(ref, gm.make_reference(kind, ref), range(steps[kind]), sz["batch"], dev)
            want = gm.full_state(ref)
            for sharding in ("zero3", "zero2"):
                model = gm.fresh_copy(base)
                opt = gm.make_ours(kind, model, sharding)
                start = time.perf_counter()
                with traced() as trace:
                    gm.train(model, [opt], range(steps[kind]), sz["batch"], dev)
                gm.synchronize(dev)
                seconds = time.perf_counter() - start
                got = gm.full_state(model)
                finals[kind, sharding] = got
                diff, where = gm.max_diff(got, want)
                row = dict(optimizer=kind, sharding=sharding, max_abs_diff=diff, where=where)
                rows.append(row)
                row.update(collectives=len(trace), units=len(opt.units), seconds=round(seconds, 3))
                vs = "torch.optim.AdamW (fp32)" if kind == "adamw8" else "the reference"
                what = f"max |param - {vs}| after {steps[kind]} steps (at {where}); {len(trace)} collectives"
                what += " issued"
                r.check(f"{kind}.{sharding}", diff <= tol[kind], measured=diff, bound=tol[kind], detail=what)
                if not trace:
                    what = "the force switch VESCALE_OPTIM_FORCE_COLLECTIVES=1 did not take effect"
                    r.fail(f"{kind}.{sharding}.forced", f"no collective was issued: {what}")
        diff, where = gm.max_diff(finals["adamw8", "zero3"], finals["adamw8", "zero2"])
        what = f"8-bit state does not depend on the layout (at {where})"
        r.check("adamw8.zero3_vs_zero2", diff <= 1e-5, measured=diff, bound=1e-5, detail=what)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    r.measure(rows=rows, tolerances=tol, muon_max_adjusted_lr=lr_adj, device=str(dev), backend=backend)
    print(json.dumps(rows, indent=1))


# --- syncs ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _sync_warnings(cuda: bool):
    """Warnings raised inside (all recorded), with CUDA's sync debug mode at "warn" on CUDA."""
    torch = _torch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")


def _sync_texts(caught) -> tuple[list[str], list[str]]:
    """(the sync warnings, the other warnings) as 'message (file:line)' strings."""
    syncs, other = [], []
    for w in caught:
        text = f"{str(w.message).strip().splitlines()[0][:200]} ({w.filename}:{w.lineno})"
        (syncs if "synchroniz" in str(w.message) else other).append(text)
    return syncs, other


def _is_eigh(text: str) -> bool:
    """Whether a sync warning's location ('... (file:line)') is a call of torch.linalg.eigh
    (its error check reads the device: one host sync a call, by torch's design)."""
    import linecache

    m = re.search(r"\(([^()]+):(\d+)\)$", text)  # the last parenthesis: torch's own comes before it
    return bool(m) and "eigh" in linecache.getline(m[1], int(m[2]))


# The documented host syncs (ARCHITECTURE.md, "On an asynchronous device"): one per backward on a
# group that talks (the agreement on no_sync(), read before the backward's first reduction), one
# per step (the step's agreement, skip_nonfinite's check in it), one more on a Shampoo step that
# refreshes roots (the agreed count of kept roots), besides torch.linalg.eigh's own.
SYNCS = {"backward": 1, "step": 1, "step_plain": 1, "step_refresh": 2}


def stage_syncs(r: Result, *, out: Path, mode: str) -> None:
    """Host synchronisations in warm ZeRO-3 steps with `skip_nonfinite` (the first step builds
    state and settles the order of reductions), against `SYNCS`: at most 1 in backward, 1 in
    step(), 2 on a Shampoo step that refreshes roots (eigh's error check syncs once a call,
    counted apart). On CUDA: `set_sync_debug_mode("warn")`'s warnings; everywhere: the reads
    of tensor values on the host (`shard.host_reads`, what a GPU waits for), checked on CPU
    (on CUDA they are measured: a read of a CPU tensor costs nothing there)."""
    from benchmarks import _gpu_models as gm
    from vescale_optim.shard.host_reads import host_reads

    dev, sz = gm.device_for(mode), SIZES[mode]
    cuda = dev.type == "cuda"
    found = {}

    @contextlib.contextmanager
    def watched():
        with _sync_warnings(cuda) as caught, host_reads() as reads:
            yield caught, reads

    with gm.world_of_one(dev):
        for kind in ("adamw32", "muon", "shampoo"):
            model = gm.build(sz["dim"], sz["blocks"], dev)
            opt = gm.make_ours(kind, model, "zero3", skip_nonfinite=True)
            gm.train(model, [opt], range(1), sz["batch"], dev)  # first step: state, orders, NCCL set-up
            for t in (1, 2) if kind == "shampoo" else (1,):
                x, y = gm.batch(t, sz["batch"], dev)
                roots = opt.step_stats["roots"] if kind == "shampoo" else 0
                with watched() as fwd:
                    loss = gm.loss_of(model, x, y)
                with watched() as bwd:
                    loss.backward()
                with watched() as step:
                    opt.step()
                opt.zero_grad()
                gm.synchronize(dev)
                refresh = kind == "shampoo" and opt.step_stats["roots"] > roots
                label = "step" if kind != "shampoo" else "step_refresh" if refresh else "step_plain"
                phases = (
                    ("forward", fwd, None),
                    ("backward", bwd, SYNCS["backward"]),
                    (label, step, SYNCS[label]),
                )
                if kind == "shampoo" and t == 2:
                    phases = phases[2:]  # the backward was checked at the first
                for phase, (caught, reads), goal in phases:
                    _count(r, f"{kind}.{phase}", caught, reads, goal, cuda, found)
    r.measure(bounds=SYNCS, **found)
    print(json.dumps(found, indent=1))


def _count(r: Result, name: str, caught, reads: list[str], goal: int | None, cuda: bool, found: dict) -> None:
    """Record one phase's syncs (CUDA's warnings, eigh's apart) and host reads; check them
    against `goal` (None: measured only)."""
    syncs, other = _sync_texts(caught)
    eigh = [t for t in syncs if _is_eigh(t)]
    counted = [t for t in syncs if not _is_eigh(t)]
    found[name] = dict(syncs=len(counted), eigh_syncs=len(eigh), texts=syncs, host_reads=reads)
    found[name]["other_warnings"] = other
    if goal is None:
        return
    if cuda:
        what = ("; ".join(counted) or "no synchronizing CUDA call") + (
            f" (+{len(eigh)} in eigh)" if eigh else ""
        )
        r.check(name, len(counted) <= goal, measured=len(counted), bound=goal, detail=what)
        return
    r.skip(
        name,
        f"{NEEDS_CUDA}: torch.cuda.set_sync_debug_mode (the step ran on gloo; its host reads are checked)",
    )
    what = "; ".join(reads) or "no read of a tensor value"
    r.check(f"{name}.host_reads", len(reads) <= goal, measured=len(reads), bound=goal, detail=what)


# --- memory ---------------------------------------------------------------------------------------


def stage_memory(r: Result, *, out: Path, mode: str) -> None:
    """Peak allocated bytes of a warm ZeRO-3 AdamW step against the prediction. World 1: the shards
    are whole. Between steps a rank holds what `memory_stats()` says (`unsharded` 0). During the
    step, besides: what a plain torch model holds (measured: `plain`, the same forward and backward
    without the library) and the library's transient buffers: at most four unit-sized buffers in
    backward (docs/guide.md) and the outermost unit's parameters and gradient buffer. Bounds: peak >=
    persistent + the largest unit (a gather must allocate it); peak <= persistent + plain + 4 x
    largest block + 2 x outermost + 128 MiB (cuBLAS workspaces, the reduction's staging, rounding).
    """
    torch = _torch()
    from benchmarks import _gpu_models as gm

    dev, sz = gm.device_for(mode), SIZES[mode]
    cuda = dev.type == "cuda"
    mib = 2**20
    SLACK = 128 * mib  # noqa: N806 (cuBLAS and cuBLASLt workspaces, NCCL staging, allocator rounding)
    with gm.world_of_one(dev):
        plain = gm.build(sz["mem_dim"], 4, dev, rotary=False)
        x, y = gm.batch(0, sz["mem_batch"], dev)
        n_params = sum(p.numel() for p in plain.parameters())
        plain_transient = None
        if cuda:
            gm.synchronize(dev)
            before = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            gm.loss_of(plain, x, y).backward()
            gm.synchronize(dev)
            plain_transient = torch.cuda.max_memory_allocated(dev) - before
        plain.zero_grad(set_to_none=True)  # the copy must not carry gradients into the optimizer
        model = gm.fresh_copy(plain)
        del plain
        opt = gm.make_ours("adamw32", model, "zero3")
        unit_bytes = {u.name: sum(p.numel() * p.element_size() for p in u.params) for u in opt.units}
        outer_name = next(u.name for u in opt.units if any(p is model.embed.weight for p in u.params))
        block_names = set(unit_bytes) - {outer_name}
        largest_block = max(unit_bytes[n] for n in block_names)
        outermost = unit_bytes[outer_name]
        gm.train(model, [opt], range(1), sz["mem_batch"], dev)
        between = opt.memory_stats()
        persistent = between["parameters"] + between["gradients"] + between["state"] + between["unsharded"]
        measured = {}
        if cuda:
            gm.synchronize(dev)
            measured["allocated_between_steps"] = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        loss = gm.loss_of(model, x, y)
        loss.backward()
        after_backward = opt.memory_stats()
        opt.step()
        opt.zero_grad()
        if cuda:
            gm.synchronize(dev)
            measured["peak"] = torch.cuda.max_memory_allocated(dev)
    r.measure(parameters=n_params, parameter_bytes=4 * n_params, unit_bytes=unit_bytes, **measured)
    r.measure(memory_stats_between_steps=between, memory_stats_after_backward=after_backward)
    r.measure(predicted_persistent=persistent, plain_transient=plain_transient)
    state, bound = between["state"], f">= {8 * n_params} (AdamW: two fp32 moments)"
    r.check("memory_stats.state", state >= 8 * n_params, measured=state, bound=bound)
    if not cuda:
        why = f"{NEEDS_CUDA}: torch.cuda.memory_allocated / max_memory_allocated (the step ran on CPU; "
        for name in ("between_steps", "peak_low", "peak_high"):
            r.skip(name, why + f"predicted persistent {persistent / mib:.2f} MiB)")
        return
    alloc, top = measured["allocated_between_steps"], persistent + x.numel() * x.element_size() * 2 + SLACK
    bound = f"[{persistent / mib:.1f}, {top / mib:.1f}] MiB (memory_stats() .. + batch + 128 MiB)"
    held = f"{alloc / mib:.1f} MiB allocated"
    r.check("between_steps", persistent <= alloc <= top, measured=held, bound=bound)
    low = alloc + max(unit_bytes.values())
    high = alloc + plain_transient + 4 * largest_block + 2 * outermost + SLACK
    peak, ratio = measured["peak"], f"peak / parameter bytes = {measured['peak'] / (4 * n_params):.2f}"
    r.check("peak_low", peak >= low, measured=f"{peak / mib:.1f} MiB", bound=f">= {low / mib:.1f} MiB")
    held, bound = f"{peak / mib:.1f} MiB", f"<= {high / mib:.1f} MiB"
    r.check("peak_high", peak <= high, measured=held, bound=bound, detail=ratio)


# --- meta -----------------------------------------------------------------------------------------


def stage_meta(r: Result, *, out: Path, mode: str) -> None:
    """A Net (with the buffer-only Rotary) built on the meta device and materialised by the
    optimizer (`shard_modules`, `device=`) equals the Net built normally on the device under
    the same seed: every parameter and buffer, and the first loss."""
    torch = _torch()
    from benchmarks import _gpu_models as gm

    dev, sz = gm.device_for(mode), SIZES[mode]
    torch.manual_seed(0)
    with torch.device(dev):
        want = gm.Net(sz["dim"], sz["blocks"])  # as built, no perturbation: what the meta path can know
    want_buffers = {k: v.detach().cpu().clone() for k, v in want.named_buffers()}
    want_state = gm.full_state(want)
    x, y = gm.batch(0, sz["batch"], dev)
    want_loss = gm.loss_of(want, x, y).item()
    with gm.world_of_one(dev):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = gm.Net(sz["dim"], sz["blocks"])
        opt = gm.make_ours("adamw32", model, "zero3", device=dev)
        tensors = [*model.named_parameters(), *model.named_buffers()]
        left = [n for n, t in tensors if t.is_meta]
        r.check("nothing on meta", not left, measured=len(left), bound=0, detail=", ".join(left[:8]) or None)
        where = sorted({f"{n}: {t.device}" for n, t in tensors if t.device != dev})
        what = ", ".join(where[:8]) or f"every parameter and buffer on {dev}"
        r.check("on the device", not where, measured=len(where), bound=0, detail=what)
        got = gm.full_state(model)
        diff, at = gm.max_diff(got, want_state)
        r.check("parameters equal", diff == 0, measured=diff, bound=0, detail=f"largest at {at}")
        bufs = {k: v.detach().cpu() for k, v in model.named_buffers()}
        same = {k: k in bufs and torch.equal(bufs[k].float(), v.float()) for k, v in want_buffers.items()}
        bad = [k for k, ok in same.items() if not ok]
        what = ", ".join(bad) or f"{', '.join(want_buffers)} equal"
        ok = not bad and bufs.keys() == want_buffers.keys()
        r.check("buffers equal", ok, measured=len(bad), bound=0, detail=what)
        loss = gm.loss_of(model, x, y).item()
        r.check("first loss equal", loss == want_loss, measured=loss, bound=want_loss)
        gm.train(model, [opt], range(1), sz["batch"], dev)
    r.measure(buffers=list(want_buffers), units=[u.name for u in opt.units], device=str(dev))


# --- checkpoint -----------------------------------------------------------------------------------


def stage_checkpoint(r: Result, *, out: Path, mode: str) -> None:
    """CheckpointManager round trips (sync, async) of a ZeRO-3 AdamW run with dropout and a
    schedule: save at step 3, run on to 6; a fresh run loads step 3 and must reach step 6
    with the same losses and weights, bit for bit (same world size: random states restored)."""
    torch = _torch()
    import vescale_optim as vo
    from benchmarks import _gpu_models as gm

    dev, sz = gm.device_for(mode), SIZES[mode]
    timeout = timedelta(seconds=gm.TIMEOUT_S)

    def run():
        model = gm.build(sz["dim"], sz["blocks"], dev, dropout=0.1)
        opt = gm.make_ours("adamw32", model, "zero3")
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
        return model, opt, sched

    def steps(model, opt, sched, span):
        losses = []
        for t in span:
            loss = gm.loss_of(model, *gm.batch(t, sz["batch"], dev))
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            losses.append(loss.detach().float().cpu().item())
        return losses

    timings = {}
    with gm.world_of_one(dev), tempfile.TemporaryDirectory(prefix="gpu_check_ckpt_") as tmp:
        for style in ("sync", "async"):
            folder = Path(tmp) / style
            model, opt, sched = run()
            manager = vo.CheckpointManager(
                folder, model, opt, sched, async_save=style == "async", timeout=timeout
            )
            steps(model, opt, sched, range(3))
            gm.synchronize(dev)
            t0 = time.perf_counter()
            manager.save(3)
            save_s = time.perf_counter() - t0
            staging = getattr(manager, "last_staging", None)
            want = steps(model, opt, sched, range(3, 6))
            t0 = time.perf_counter()
            manager.wait()
            wait_s = time.perf_counter() - t0
            manager.close()
            want_state = gm.full_state(model)
            model, opt, sched = run()
            resumed = vo.CheckpointManager(folder, model, opt, sched, timeout=timeout)
            t0 = time.perf_counter()
            loaded = resumed.load()
            load_s = time.perf_counter() - t0
            step = None if loaded is None else loaded.step
            r.check(f"{style}.loaded", step == 3, measured=step, bound=3)
            got = steps(model, opt, sched, range(3, 6))
            resumed.close()
            diff, where = gm.max_diff(gm.full_state(model), want_state)
            what = "steps 4-6 after loading"
            r.check(f"{style}.losses", got == want, measured=got, bound=want, detail=what)
            r.check(f"{style}.weights", diff == 0, measured=diff, bound=0, detail=f"largest at {where}")
            timings[style] = dict(save_s=save_s, wait_s=wait_s, load_s=load_s, staging=_staging(staging))
            print(style, json.dumps(timings[style], default=str))
    r.measure(**timings, device=str(dev))
    seconds = {k: (t["staging"] or {}).get("seconds") for k, t in timings.items()}
    reported = all(t["staging"] is not None for t in timings.values())
    what = "CheckpointManager.last_staging after each save"
    r.check("staging time reported", reported, measured=seconds, detail=what)


def _staging(stats) -> dict | None:
    if stats is None:
        return None
    import dataclasses

    return dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else dict(vars(stats))
