"""examples/train_torchrun.py as a torchrun worker (same arguments), with a death in a save:
with DIE_IN_SAVE=N, rank DIE_RANK of the first attempt SIGKILLs itself inside the write of
checkpoint step-N, once its own DCP files are written and before the checkpoint is complete
(DCP's metadata, the manifest, the rename). Just before, it records in DIE_MARKER (JSON) what
the checkpoint folder holds: whether its pieces are `written`, whether step-N is `complete`,
and the `newest` complete checkpoint."""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
from pathlib import Path

import torch.distributed.checkpoint as dcp

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_torchrun.py"

step = int(os.environ.get("DIE_IN_SAVE", "0"))
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
if step and first_attempt and os.environ.get("RANK") == os.environ.get("DIE_RANK", "1"):
    write_data = dcp.FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        written = write_data(self, plan, planner)
        folder = Path(self.path)
        if folder.name == f".step-{step}.tmp":
            written.wait()  # this rank's files are on disk; the others' results never reach rank 0
            ckpt = folder.parent
            complete = sorted(p.name for p in ckpt.glob("step-*"))
            state = {
                "written": sorted(p.name for p in folder.iterdir() if p.suffix == ".distcp"),
                "complete": (ckpt / f"step-{step}").exists(),
                "newest": max(complete, key=lambda n: int(n.split("-")[1])) if complete else None,
            }
            Path(os.environ["DIE_MARKER"]).write_text(json.dumps(state))
            os.kill(os.getpid(), signal.SIGKILL)
        return written

    dcp.FileSystemWriter.write_data = write_then_die

sys.argv = [str(EXAMPLE), *sys.argv[1:]]
runpy.run_path(str(EXAMPLE), run_name="__main__")
