"""Model shapes used by the benchmarks: totals against the published parameter counts,
and the structure the padding and Muon benchmarks rely on. Arithmetic only."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.model_shapes import (  # noqa: E402
    MODELS,
    is_vector,
    matrices,
    numel,
    total_params,
)

# Published totals: Llama 3 from the HF safetensors indexes (bf16 bytes / 2),
# DeepSeek-V3 without its 14B multi-token-prediction module, GPT-OSS from its model card.
KNOWN = {
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.6e9,
    "deepseek-v3": 671e9,
    "gpt-oss-120b": 116.8e9,
}


@pytest.mark.parametrize("model", list(KNOWN))
def test_total_params_within_one_percent(model):
    assert total_params(model) == pytest.approx(KNOWN[model], rel=0.01)


def test_llama_totals_exact():
    assert total_params("llama3-8b") == 8_030_261_248
    assert total_params("llama3-70b") == 70_553_706_496


def test_models_are_exactly_the_four():
    assert set(MODELS) == set(KNOWN)


@pytest.mark.parametrize("model", list(KNOWN))
def test_block_structure(model):
    blocks = MODELS[model]()
    layers = {"llama3-8b": 32, "llama3-70b": 80, "deepseek-v3": 61, "gpt-oss-120b": 36}[model]
    assert len(blocks) == layers + 2  # embedding, layers, head
    assert [n for n, _ in blocks[0]] == ["model.embed_tokens.weight"]
    assert [n for n, _ in blocks[-1]] == ["model.norm.weight", "lm_head.weight"]
    names = [n for block in blocks for n, _ in block]
    assert len(names) == len(set(names))
    for block in blocks:
        assert block
        for name, shape in block:
            assert isinstance(name, str) and isinstance(shape, tuple)
            assert all(isinstance(d, int) and d > 0 for d in shape)
    for i, block in enumerate(blocks[1:-1]):
        assert all(n.startswith(f"model.layers.{i}.") for n, _ in block)


def _shapes(model, layer):
    prefix = f"model.layers.{layer}."
    return {n[len(prefix) :]: s for n, s in MODELS[model]()[layer + 1]}


def test_llama3_8b_layer():
    s = _shapes("llama3-8b", 0)
    assert s["self_attn.q_proj.weight"] == (4096, 4096)
    assert s["self_attn.k_proj.weight"] == (1024, 4096)  # 8 KV heads x 128
    assert s["mlp.down_proj.weight"] == (4096, 14336)
    assert sum(map(numel, s.values())) == 218_103_808 + 2 * 4096  # matrices + 2 norms


def test_deepseek_v3_layers():
    dense, moe = _shapes("deepseek-v3", 2), _shapes("deepseek-v3", 3)
    for s in (dense, moe):
        assert s["self_attn.q_a_proj.weight"] == (1536, 7168)
        assert s["self_attn.q_a_layernorm.weight"] == (1536,)
        assert s["self_attn.q_b_proj.weight"] == (128 * 192, 1536)
        assert s["self_attn.kv_a_proj_with_mqa.weight"] == (576, 7168)
        assert s["self_attn.kv_a_layernorm.weight"] == (512,)
        assert s["self_attn.kv_b_proj.weight"] == (128 * 256, 512)
        assert s["self_attn.o_proj.weight"] == (7168, 16384)
    assert dense["mlp.gate_proj.weight"] == (18432, 7168)
    assert "mlp.gate.weight" not in dense
    assert moe["mlp.gate.weight"] == (256, 7168)
    assert moe["mlp.experts.255.down_proj.weight"] == (7168, 2048)
    assert moe["mlp.shared_experts.up_proj.weight"] == (2048, 7168)
    assert sum(".experts." in n for n in moe) == 256 * 3
    assert not any("experts.256" in n for n in moe)
    assert len(MODELS["deepseek-v3"]()[-2]) == len(moe)  # layer 60 is MoE, MTP excluded


def test_gpt_oss_layer():
    s = _shapes("gpt-oss-120b", 0)
    assert s["mlp.experts.gate_up_proj"] == (128, 2880, 5760)
    assert s["mlp.experts.gate_up_proj_bias"] == (128, 5760)
    assert s["mlp.experts.down_proj"] == (128, 2880, 2880)
    assert s["mlp.router.weight"] == (128, 2880) and s["mlp.router.bias"] == (128,)
    assert s["self_attn.q_proj.weight"] == (4096, 2880)
    assert s["self_attn.o_proj.weight"] == (2880, 4096)
    assert s["self_attn.sinks"] == (64,)
    assert MODELS["gpt-oss-120b"]()[0][0][1] == (201088, 2880)


@pytest.mark.parametrize("model", list(KNOWN))
def test_matrices(model):
    mats = matrices(model)
    params = [p for block in MODELS[model]() for p in block]
    assert mats == [p for p in params if len(p[1]) >= 2]
    hidden = matrices(model, hidden_only=True)
    assert set(hidden) < set(mats)
    assert not any("embed_tokens" in n or n.startswith("lm_head") or n.endswith("bias") for n, _ in hidden)
    for name, shape in mats:
        assert len(shape) in (2, 3)
        assert len(shape) != 3 or "experts" in name
    assert all(math.prod(s) > 1 for _, s in mats)


def test_matrix_counts():
    # per MoE layer: 5 attention + 256 * 3 routed + gate + 3 shared; dense: 5 + 3
    assert len(matrices("deepseek-v3", hidden_only=True)) == 3 * 8 + 58 * (5 + 768 + 1 + 3)
    gpt = matrices("gpt-oss-120b")
    assert sum(len(s) == 3 for _, s in gpt) == 2 * 36  # fused experts stay 3-D
    assert len(matrices("gpt-oss-120b", hidden_only=True)) == 36 * (4 + 1 + 2)


def test_is_vector():
    assert is_vector("x.weight", (4096,))
    assert is_vector("mlp.experts.down_proj_bias", (128, 2880))
    assert not is_vector("mlp.experts.down_proj", (128, 2880, 2880))


def test_padding_granules_and_smoke():
    from benchmarks.padding import fsdp2_padding, granule_of, lower_bound_shard, run

    assert granule_of("x.weight", (4096,), 32) == 1
    assert granule_of("mlp.experts.gate_up_proj_bias", (128, 5760), 32) == 1
    assert granule_of("q_proj.weight", (4096, 2880), 32) == 32 * 2880
    # 128 does not divide the 2880 rows of one expert: the unit is that expert's matrix
    assert granule_of("mlp.experts.gate_up_proj", (128, 2880, 5760), 128) == 2880 * 5760
    assert granule_of("mlp.experts.gate_up_proj", (128, 2880, 5760), 32) == 32 * 5760
    assert granule_of("kv_a_proj_with_mqa.weight", (576, 7168), 128) == 576 * 7168
    assert fsdp2_padding([(10, 3), (8,)], 4) == 2 * 3
    # two tensors spanning several boundaries: S must be a multiple of lcm(400, 600)
    assert lower_bound_shard([12000, 12000], [400, 600], 64) == (1200, 1200)
    rows, _, details = run(["llama3-8b"], ["1 row"], [8])  # verifies every layout
    assert rows[0]["blocks"] == 34 and rows[0]["ours %"] < 0.1
    assert all(d["padding"] >= d["bound_padding"] for d in details)
