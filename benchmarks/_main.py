"""The skeleton every benchmark script's `main` shares: its command line (with `--quick` and
`--results`), the host it ran on, the goals it states, and the JSON it writes.

    args = parse(__doc__, argv, "a tiny model, a few steps", world_size=4,
                 steps=(12, "measured steps"), configs=dict(nargs="+", default=CONFIGS, choices=CONFIGS))
    ...
    print_goals("Goals (ours vs FSDP2):", goals)
    return finish("adamw", args, payload, threads=per_rank.threads)   # results/adamw[_quick].json

An option is `name=default` (its type the default's; False: a flag), `name=(default, help)`, or
`name=dict(...)`, the keywords of `argparse.ArgumentParser.add_argument`; `world_size` becomes
`--world-size`. `finish` adds the environment (versions, CPU, threads per rank, load average) under
"env", prints the host line and writes NAME.json (NAME_quick.json with `--quick`) to
`benchmarks/results/`, or the folder `--results` names.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import _report


class Args(argparse.Namespace):
    """The parsed arguments, picklable (ranks may take them), with argparse's `error`."""

    def error(self, message: str) -> None:
        """Exit as argparse does on a bad argument: the usage, then the message (status 2)."""
        sys.stderr.write(f"{self._usage}{self._prog}: error: {message}\n")
        raise SystemExit(2)


def parse(doc: str, argv: Sequence[str] | None, quick: str, **options: Any) -> Args:
    """The script's arguments: `--quick` (help: `quick`), `--results` and `options` (see the module's
    docstring)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    for name, spec in options.items():
        if isinstance(spec, tuple):
            spec = {"default": spec[0], "help": spec[1]}
        elif not isinstance(spec, dict):
            spec = {"default": spec}
        if spec.get("default") is False:
            spec = {"action": "store_true", **spec}
        elif type(spec.get("default")) in (int, float, str) and "type" not in spec and "choices" not in spec:
            spec = {"type": type(spec["default"]), **spec}
        ap.add_argument(f"--{name.replace('_', '-')}", **spec)
    ap.add_argument("--quick", action="store_true", help=quick)
    ap.add_argument("--results", type=Path, help="folder for the JSON and plots (default benchmarks/results)")
    args = ap.parse_args(argv, Args(_usage=ap.format_usage(), _prog=ap.prog))
    if args.results:
        _report.RESULTS_DIR = args.results.resolve()
    return args


def print_goals(title: str, goals: dict[str, bool]) -> dict[str, bool]:
    """Print each goal under `title`, met or NOT met; return them."""
    print(f"\n{title}")
    for k, ok in goals.items():
        print(f"  {'met    ' if ok else 'NOT met'}  {k}")
    return goals


def finish(name: str, args: Args, payload: dict, threads=None, png: Path | None = None, quick_suffix=True):
    """Print the host line (`threads`: per rank), add the environment to `payload` ("env") and
    write it to NAME.json (NAME_quick.json with `--quick`, unless not `quick_suffix`); return it."""
    print(f"\n{_report.host_line(threads)}")
    payload["env"] = _report.environment(threads)
    path = _report.save_json(f"{name}_quick" if args.quick and quick_suffix else name, payload)
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return payload
