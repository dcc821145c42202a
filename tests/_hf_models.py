"""Tiny Hugging Face models built from configs (no download), deterministic per-rank batches,
and the single-process torch reference the sharded runs are compared against, within `TOL`."""

from __future__ import annotations

import torch
from _reference import mean_grad_reference
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM
from transformers.initialization import no_init_weights

import vescale_optim as vo

VOCAB, SEQ, BATCH = 64, 8, 2
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    attn_implementation="eager",
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
CONFIGS = {
    # tied embeddings, grouped-query attention (4 query heads over 2 key/value heads)
    "llama": lambda: LlamaConfig(intermediate_size=48, tie_word_embeddings=True, **_COMMON),
    # 4 experts (top 2) as fused 3-D matrices: gate_up_proj [4, 64, 32], down_proj [4, 32, 32]
    "mixtral": lambda: MixtralConfig(
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False, **_COMMON
    ),
}
CLASSES = {"llama": LlamaForCausalLM, "mixtral": MixtralForCausalLM}

MUON = dict(lr=0.02, weight_decay=0.1)
AUX = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)  # Muon's AdamW group
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
WORLD = 3  # the ranks of the sharded runs
# Both cover twice the noise floor of summing the ranks' gradients in another order (gloo's ring
# does on W=3), measured by tests/test_references.py; the reference sums them in rank order and
# then divides, as the library does (`_reference.mean_grad_reference`). AdamW: that floor,
# ~1.3e-7 (rtol 1e-5 on top). Muon: Newton-Schulz in bf16 turns the floor into the odd flipped
# rounding of its output (see tests/_fsdp_cases.py), ~1.4e-4 measured.
TOL = {"adamw": 1e-5, "muon": 2e-3}


def build(kind: str, seed: int = 0, meta: bool = False):
    """The model built normally under `seed` (or on the meta device, after seeding)."""
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return CLASSES[kind](CONFIGS[kind]())
    return CLASSES[kind](CONFIGS[kind]())


def hf_initialised(kind: str, seed: int = 0):
    """The model as transformers' own initialisation makes it from `seed`: built without torch's
    construction-time init (which `LlamaForCausalLM(config)` draws first and then overwrites),
    then `init_weights()` (`_init_weights` on every module, then the embedding tie)."""
    with no_init_weights():
        model = CLASSES[kind](CONFIGS[kind]())
    torch.manual_seed(seed)
    model.init_weights()
    return model


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def loss_fn(model, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy (transformers shifts the labels)."""
    return model(input_ids=tokens, labels=tokens, use_cache=False).loss


def ours(kind: str, model, **sharding):
    if kind == "adamw":
        return vo.AdamW(model.parameters(), **ADAMW, **sharding)
    groups = vo.muon_param_groups(
        model,
        exclude=["lm_head"],
        adamw_lr=AUX["lr"],
        adamw_betas=AUX["betas"],
        adamw_weight_decay=AUX["weight_decay"],
    )
    return vo.Muon(groups, **MUON, **sharding)


class Reference:
    """torch.optim.AdamW, or torch.optim.Muon on the matrices `vo.muon_param_groups` picks
    (each slice of a 3-D expert stack its own matrix) + torch.optim.AdamW for the rest."""

    def __init__(self, kind: str, model):
        self.slices: list[tuple[torch.Tensor, list[torch.nn.Parameter]]] = []
        if kind == "adamw":
            self.opts = [torch.optim.AdamW(model.parameters(), **ADAMW)]
            return
        muon_group, adamw_group = vo.muon_param_groups(model, exclude=["lm_head"])
        assert adamw_group.get("use_muon") is False
        mats = []
        for p in muon_group["params"]:
            if p.ndim == 2:
                mats.append(p)
            else:  # torch.optim.Muon takes 2-D parameters only: one stand-in per matrix of the stack
                stand_ins = [torch.nn.Parameter(m.detach().clone()) for m in p.unbind(0)]
                self.slices.append((p, stand_ins))
                mats += stand_ins
        self.opts = [torch.optim.Muon(mats, **MUON), torch.optim.AdamW(adamw_group["params"], **AUX)]

    def step(self) -> None:
        for p, stand_ins in self.slices:
            for m, g in zip(stand_ins, p.grad.unbind(0)):
                m.grad = g.clone()
        for opt in self.opts:
            opt.step()
        with torch.no_grad():
            for p, stand_ins in self.slices:
                p.copy_(torch.stack(stand_ins))


def reference(kind: str, optimizer: str, world: int, steps: int, reversed_order: bool = False) -> dict:
    """One process, fed at every step the mean gradient of the `world` ranks' batches, reduced
    as the library reduces it (`_reference.mean_grad_reference`)."""
    model = build(kind)
    opt = Reference(optimizer, model)
    for t in range(steps):
        mean_grad_reference(
            model.parameters(), world, lambda r, t=t: loss_fn(model, batch(t, r)).backward(), reversed_order
        )
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
