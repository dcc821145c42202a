"""Parameter shapes of real transformer models, block by block, from their public configs.

Nothing here allocates a tensor: each model is a list of *blocks* (embedding, one per
transformer layer, head), and a block is the list of its parameters as
`(name, shape)` pairs in the order the Hugging Face modeling code registers them
(the order `model.named_parameters()` yields). Names follow the HF checkpoints.

    MODELS["llama3-8b"]()        -> list[Block]
    matrices("deepseek-v3")       -> every >=2-D parameter (fused 3-D experts stay 3-D)
    total_params("gpt-oss-120b")  -> 116_829_156_672

Only trainable parameters are listed: buffers (rotary `inv_freq`, DeepSeek-V3's
`e_score_correction_bias`, which is updated by a load-balancing rule, not by the
optimizer) are not, and neither is DeepSeek-V3's multi-token-prediction module
(layer 61 of the checkpoint), which is not part of the 671B main model.
"""

from __future__ import annotations

import math
from collections.abc import Callable

Shape = tuple[int, ...]
Param = tuple[str, Shape]
Block = list[Param]


def numel(shape: Shape) -> int:
    return math.prod(shape)


def is_vector(name: str, shape: Shape) -> bool:
    """True for parameters that are vectors to every optimizer: 1-D tensors (norm gains,
    biases, attention sinks) and stacks of per-expert biases such as GPT-OSS's
    `gate_up_proj_bias [128, 5760]`, which are 2-D but not matrices."""
    return len(shape) == 1 or name.endswith("bias")


# --------------------------------------------------------------------------- Llama 3


def _llama(hidden_size: int, layers: int, heads: int, kv_heads: int, inter: int, vocab: int) -> list[Block]:
    """`LlamaForCausalLM` (transformers `modeling_llama.py`), no biases
    (`attention_bias=False`, `mlp_bias=False`), untied embeddings
    (`tie_word_embeddings=False`)."""
    h = hidden_size
    head_dim = h // heads  # config has no head_dim: hidden / heads = 128
    q, kv = heads * head_dim, kv_heads * head_dim
    blocks: list[Block] = [[("model.embed_tokens.weight", (vocab, h))]]
    for i in range(layers):
        p = f"model.layers.{i}."
        blocks.append(
            [
                (p + "self_attn.q_proj.weight", (q, h)),
                (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, q)),
                (p + "mlp.gate_proj.weight", (inter, h)),
                (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter)),
                (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,)),
            ]
        )
    blocks.append([("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))])
    return blocks


def llama3_8b() -> list[Block]:
    """meta-llama/Meta-Llama-3-8B config.json: hidden, layers, heads, kv heads, intermediate, vocab."""
    return _llama(4096, 32, 32, 8, 14336, 128256)


def llama3_70b() -> list[Block]:
    """meta-llama/Meta-Llama-3-70B config.json: hidden, layers, heads, kv heads, intermediate, vocab."""
    return _llama(8192, 80, 64, 8, 28672, 128256)


# ----------------------------------------------------------------------- DeepSeek-V3


def deepseek_v3() -> list[Block]:
    """deepseek-ai/DeepSeek-V3 `config.json` with its `modeling_deepseek.py`
    (`DeepseekV3ForCausalLM`): MLA attention with low-rank q and kv, dense MLP in the
    first `first_k_dense_replace` layers, MoE (routed experts as separate `nn.Linear`s,
    as in the checkpoint, plus shared experts) in the rest."""
    hidden_size, num_hidden_layers, first_k_dense_replace, vocab_size = 7168, 61, 3, 129280
    intermediate_size = 18432  # dense MLP of the first 3 layers
    moe_intermediate_size, n_routed_experts, n_shared_experts, num_attention_heads = 2048, 256, 1, 128
    q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim = 1536, 512, 128, 64, 128
    # attention_bias=False, tie_word_embeddings=False

    h = hidden_size
    q_head_dim = qk_nope_head_dim + qk_rope_head_dim  # 192
    blocks: list[Block] = [[("model.embed_tokens.weight", (vocab_size, h))]]
    for i in range(num_hidden_layers):
        p = f"model.layers.{i}."
        block: Block = [
            (p + "self_attn.q_a_proj.weight", (q_lora_rank, h)),
            (p + "self_attn.q_a_layernorm.weight", (q_lora_rank,)),
            (p + "self_attn.q_b_proj.weight", (num_attention_heads * q_head_dim, q_lora_rank)),
            (p + "self_attn.kv_a_proj_with_mqa.weight", (kv_lora_rank + qk_rope_head_dim, h)),
            (p + "self_attn.kv_a_layernorm.weight", (kv_lora_rank,)),
            (
                p + "self_attn.kv_b_proj.weight",
                (num_attention_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank),
            ),
            (p + "self_attn.o_proj.weight", (h, num_attention_heads * v_head_dim)),
        ]
        if i < first_k_dense_replace:
            block += _mlp(p + "mlp.", h, intermediate_size)
        else:
            for e in range(n_routed_experts):
                block += _mlp(f"{p}mlp.experts.{e}.", h, moe_intermediate_size)
            # MoEGate.weight; its e_score_correction_bias is not trained by the optimizer
            block.append((p + "mlp.gate.weight", (n_routed_experts, h)))
            block += _mlp(p + "mlp.shared_experts.", h, moe_intermediate_size * n_shared_experts)
        block += [
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
        blocks.append(block)
    blocks.append([("model.norm.weight", (h,)), ("lm_head.weight", (vocab_size, h))])
    return blocks


def _mlp(prefix: str, hidden: int, inter: int) -> Block:
    return [
        (prefix + "gate_proj.weight", (inter, hidden)),
        (prefix + "up_proj.weight", (inter, hidden)),
        (prefix + "down_proj.weight", (hidden, inter)),
    ]


# ---------------------------------------------------------------------- GPT-OSS-120B


def gpt_oss_120b() -> list[Block]:
    """openai/gpt-oss-120b `config.json` with transformers `modeling_gpt_oss.py`
    (`GptOssForCausalLM`): attention with biases and per-head sinks, a biased router and
    fused 3-D expert tensors (`GptOssExperts`)."""
    hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim = 2880, 36, 64, 8, 64
    num_local_experts, vocab_size = 128, 201088
    intermediate_size = 2880  # GptOssExperts.expert_dim
    # attention_bias=True, tie_word_embeddings=False

    h = hidden_size
    q = num_attention_heads * head_dim  # 4096
    kv = num_key_value_heads * head_dim  # 512
    n_e = num_local_experts
    blocks: list[Block] = [[("model.embed_tokens.weight", (vocab_size, h))]]
    for i in range(num_hidden_layers):
        p = f"model.layers.{i}."
        blocks.append(
            [
                (p + "self_attn.q_proj.weight", (q, h)),
                (p + "self_attn.q_proj.bias", (q,)),
                (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.k_proj.bias", (kv,)),
                (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.bias", (kv,)),
                (p + "self_attn.o_proj.weight", (h, q)),
                (p + "self_attn.o_proj.bias", (h,)),
                (p + "self_attn.sinks", (num_attention_heads,)),
                (p + "mlp.router.weight", (n_e, h)),
                (p + "mlp.router.bias", (n_e,)),
                # [experts, hidden, 2 * expert_dim]: x @ W, not a Linear's [out, in]
                (p + "mlp.experts.gate_up_proj", (n_e, h, 2 * intermediate_size)),
                (p + "mlp.experts.gate_up_proj_bias", (n_e, 2 * intermediate_size)),
                (p + "mlp.experts.down_proj", (n_e, intermediate_size, h)),
                (p + "mlp.experts.down_proj_bias", (n_e, h)),
                (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,)),
            ]
        )
    blocks.append([("model.norm.weight", (h,)), ("lm_head.weight", (vocab_size, h))])
    return blocks


MODELS: dict[str, Callable[[], list[Block]]] = {
    "llama3-8b": llama3_8b,
    "llama3-70b": llama3_70b,
    "deepseek-v3": deepseek_v3,
    "gpt-oss-120b": gpt_oss_120b,
}


def total_params(model_name: str) -> int:
    return sum(numel(shape) for block in MODELS[model_name]() for _, shape in block)


def matrices(model_name: str, *, hidden_only: bool = False) -> list[Param]:
    """Every parameter with two or more dimensions, in model order; fused 3-D expert
    tensors stay 3-D (a batch of matrices over their leading dimension).

    `hidden_only=True` keeps what a Muon-style optimizer orthogonalizes: it drops the
    embedding, the output head and stacked per-expert biases, which are 2-D but not
    matrices of a linear map inside the network.
    """
    out = []
    for block in MODELS[model_name]():
        for name, shape in block:
            if len(shape) < 2:
                continue
            outer = "embed_tokens" in name or name.startswith("lm_head")
            if hidden_only and (is_vector(name, shape) or outer):
                continue
            out.append((name, shape))
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    """Print each model's totals (parameters, blocks, tensors, matrices) and save them to
    `benchmarks/results/model_shapes.json`."""
    import sys
    from pathlib import Path

    if __package__ in (None, ""):
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks._main import finish, parse
    from benchmarks._report import table

    args = parse(__doc__, argv, "the same listing: it is arithmetic, under a second")
    rows = []
    for name, blocks in ((name, make()) for name, make in MODELS.items()):
        row = {"model": name, "params": total_params(name), "blocks": len(blocks)}
        rows.append({**row, "tensors": sum(len(b) for b in blocks), "matrices": len(matrices(name))})
    print(table(rows))
    finish("model_shapes", args, {"rows": rows}, quick_suffix=False)
    return rows


if __name__ == "__main__":
    main()
