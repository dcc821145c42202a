"""The demo run's configuration: everything a run depends on, with the checks that need no run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .model import GPTConfig


@dataclass
class TrainConfig:
    """Everything a run depends on; `optimizer` is one name, several separated by commas or "all"
    (None: AdamW and Muon, from the same initial weights; AdamW alone with a `checkpoint_dir`);
    `batch_size` is per rank, `lr=None` is each optimizer's default,
    `zero` 3 shards parameters per block (`shard_modules`), 2 keeps them whole on every rank.
    With `checkpoint_dir` the run saves every `checkpoint_every` steps and at the end, and with
    `resume` continues from the newest complete checkpoint there; `timeout` (seconds) bounds
    every collective wait. `param_dtype` ("fp32" or "bf16"; None: bf16 on CUDA, fp32 on the
    CPU) is the dtype of the gathered parameters and the compute, over fp32 shards. `sharding`:
    more sharding keywords (`vo.ShardingConfig`'s fields, e.g. `{"gather_bits": 8, "reduce_bits":
    8}`) for every optimizer of the run, over those `zero` and `param_dtype` give (no flag: set it
    from Python; keep its values JSON-friendly, the summary records them). `muon_variant` is what
    "muon" runs: "muon" (torch's coefficients), "polar" (Polar Express) or "normuon" (NorMuon)."""

    optimizer: str | None = None
    muon_variant: str = "muon"
    zero: int = 3
    steps: int = 100
    batch_size: int = 8
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    lr: float | None = None
    warmup: int = 20
    grad_clip: float = 1.0
    val_tokens: int = 16384
    seed: int = 0
    out: str = "demo_out"
    progress: bool = True
    checkpoint_dir: str | None = None
    checkpoint_every: int = 50
    resume: bool = False
    timeout: float = 60.0
    param_dtype: str | None = None
    sharding: dict[str, Any] = field(default_factory=dict)

    def model_config(self) -> GPTConfig:
        return GPTConfig(
            seq_len=self.seq_len, d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads
        )
