"""Workers of `benchmarks/_gpu_multi.py`, one per rank under torchrun (NCCL on its own GPU,
gloo on CPU):

    torchrun --nproc-per-node 8 benchmarks/_gpu_worker.py hsdp --shards 4
    torchrun --nproc-per-node 8 --monitor-interval 60 benchmarks/_gpu_worker.py kill --log-dir D

`hsdp`: the same fully sharded training (vo.AdamW, vo.Muon) on a (replicate, shard) mesh of
(W / shards, shards) and on (1, W), each rank on its own batches; rank 0 prints one line
`GPU_MULTI_HSDP {json}` with the largest parameter difference between the two meshes.

`kill`: fully sharded AdamW; in the backward of step 2 rank `--victim` kills itself with
SIGKILL. Every rank appends timestamped lines to `D/rank<r>.log` (START, KILL, ERROR with the
exception's first lines, DONE); a survivor that raises exits at once (`os._exit`: a hung NCCL
communicator must not hold the process in its destructor). Every wait is bounded: the
library's (`set_collective_timeout(--timeout)`) and, later, the process group's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import vescale_optim as vo  # noqa: E402
from benchmarks import _gpu_models as gm  # noqa: E402


def setup(timeout: float, bounded: float | None) -> tuple[torch.device, int, int]:
    """Join torchrun's group (`vo.init_distributed`: NCCL bound to this rank's GPU, else gloo,
    under keys of this restart attempt only). The group's timeout is `timeout`; `bounded` sets
    the library's own bound on every wait (None: none)."""
    device = vo.init_distributed(timeout=timedelta(seconds=timeout))
    vo.set_collective_timeout(bounded)
    return device, dist.get_rank(), dist.get_world_size()


def _batch(step: int, rank: int, size, device):
    return gm.batch(10_000 * step + rank, size, device)


def hsdp(args) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    # on NCCL the group's timeout alone (a bounded wait blocks the host); on gloo the library's too
    device, rank, world = setup(args.timeout, None if torch.cuda.is_available() else args.timeout)
    shards = args.shards
    meshes = {
        f"{world // shards}x{shards}": init_device_mesh(
            device.type, (world // shards, shards), mesh_dim_names=("replicate", "shard")
        ),
        f"1x{world}": init_device_mesh(device.type, (1, world), mesh_dim_names=("replicate", "shard")),
    }
    size = (4, 32)
    steps = 3
    result = {"world": world, "meshes": list(meshes), "steps": steps}
    for kind in ("adamw32", "muon"):
        finals = {}
        for name, mesh in meshes.items():
            model = gm.build(64, 3, device)
            opt = gm.make_ours(kind, model, "zero3", mesh=mesh)
            for t in range(steps):
                gm.loss_of(model, *_batch(t, rank, size, device)).backward()
                opt.step()
                opt.zero_grad()
            finals[name] = gm.full_state(model)
            if kind == "muon":  # each matrix orthogonalized once in the whole world, on any mesh
                count = torch.tensor([opt.step_stats["ns_matrices"]], device=device)
                dist.all_reduce(count)
                result[f"muon.{name}.ns_matrices"] = int(count)
                result["muon.matrices"] = gm.muon_matrices(model)
        a, b = finals.values()
        diff, where = gm.max_diff(a, b)
        worst = torch.tensor([diff], dtype=torch.float64, device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        result[kind] = {"max_abs_diff": float(worst), "where_on_rank0": where}
    result["muon_bound"] = steps * gm.muon_max_adjusted_lr(gm.build(64, 3, torch.device("cpu"))) * 2.0**-6
    if rank == 0:
        print("GPU_MULTI_HSDP " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def kill(args) -> None:
    log_dir = Path(args.log_dir)
    rank_env = int(os.environ["RANK"])
    log = open(log_dir / f"rank{rank_env}.log", "a", buffering=1)  # noqa: SIM115 (kept open until exit)

    def note(what: str, text: str = "") -> None:
        log.write(f"{what} {time.time():.3f} {text}".rstrip() + "\n")
        log.flush()
        os.fsync(log.fileno())

    note("START")
    try:
        device, rank, world = setup(args.timeout + 30, args.timeout)
        model = gm.build(256 if device.type == "cuda" else 32, 4, device)
        opt = gm.make_ours("adamw32", model, "zero3")
        armed = {"on": False}

        def die(grad):
            if armed["on"]:
                note("KILL", f"rank {rank} kills itself with SIGKILL in backward")
                os.kill(os.getpid(), signal.SIGKILL)
            return grad

        def arm(module, inputs, output):
            if output.requires_grad:
                output.register_hook(die)

        model.blocks[1].register_forward_hook(arm)
        for step in range(5):
            armed["on"] = step == 2 and rank == args.victim
            loss = gm.loss_of(model, *_batch(step, rank, (4, 32), device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            note("STEP", str(step))
        note("DONE", "every step finished: no rank died, or this one did not notice")
    except BaseException as e:  # noqa: BLE001 (what a survivor reports is the point)
        text = " | ".join(f"{type(e).__name__}: {e}".strip().splitlines()[:6])
        note("ERROR", text)
        log.close()
        os._exit(1)
    log.close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    h = sub.add_parser("hsdp")
    h.add_argument("--shards", type=int, default=4)
    h.add_argument("--timeout", type=float, default=120)
    k = sub.add_parser("kill")
    k.add_argument("--log-dir", required=True)
    k.add_argument("--victim", type=int, default=1)
    k.add_argument("--timeout", type=float, default=20)
    args = ap.parse_args()
    {"hsdp": hsdp, "kill": kill}[args.what](args)


if __name__ == "__main__":
    main()
