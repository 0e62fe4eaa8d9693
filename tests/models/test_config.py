"""ModelConfig: validation, Hugging Face config conversion, built-ins, and RoPE scaling numbers vs transformers."""

from __future__ import annotations

import os

import pytest
import torch

from flashpage.models.config import BUILTIN_CONFIGS, ModelConfig, get_builtin_config
from flashpage.models.llama import rope_cos_sin, rope_inv_freq

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BASE = {
    "architecture": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
    "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
}  # fmt: skip

LLAMA3 = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}  # fmt: skip


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"architecture": "gpt2"}, "architecture"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"num_layers": 2.0}, "num_layers"),
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"head_dim": 15}, "head_dim"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
        ({"rope_theta": float("nan")}, "rope_theta"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling"),
        ({"rope_scaling": {"rope_type": "longrope"}}, "rope_scaling"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "rope_scaling"),
        ({"rope_scaling": {"rope_type": "freq_factors", "factors": (1.0, 2.0)}}, "rope_scaling"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"tie_word_embeddings": 1}, "tie_word_embeddings"),
        ({"bos_token_id": 100}, "bos_token_id"),
        ({"eos_token_ids": (5, 1000)}, "eos_token_ids"),
    ],
)
def test_validation_names_the_field(changes: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ModelConfig(**{**BASE, **changes})


def test_normalisation_and_hash() -> None:
    cfg = ModelConfig(**BASE, rope_scaling={"type": "linear", "factor": 2}, eos_token_ids=[3, 4])  # type: ignore[arg-type]
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2}
    assert cfg.eos_token_ids == (3, 4)
    assert ModelConfig(**BASE, rope_scaling={"rope_type": "default"}).rope_scaling is None
    assert hash(cfg) == hash(
        ModelConfig(**BASE, rope_scaling={"rope_type": "linear", "factor": 2}, eos_token_ids=(3, 4))
    )
    assert cfg.window_size == (-1, -1)
    assert cfg.replace(sliding_window=8).window_size == (7, 0)
    with pytest.raises(ValueError, match="num_heads"):
        cfg.replace(num_heads=3)


def test_from_hf_config_llama31_and_round_trip() -> None:
    hf = {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "rope_scaling": LLAMA3, "max_position_embeddings": 131072,
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "tie_word_embeddings": False,
    }  # fmt: skip
    cfg = ModelConfig.from_hf_config(hf)
    assert cfg == BUILTIN_CONFIGS["llama-3.1-8b"]
    assert cfg.head_dim == 128 and cfg.rope_scaling == LLAMA3
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg


def test_from_hf_config_transformers5_rope_parameters() -> None:
    hf = {
        "model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 32,
        "rope_parameters": {"rope_theta": 1234.0, "rope_type": "linear", "factor": 4.0},
    }  # fmt: skip
    cfg = ModelConfig.from_hf_config(hf)
    assert cfg.rope_theta == 1234.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert cfg.num_kv_heads == 4 and cfg.head_dim == 32 and cfg.q_size == 128


def test_from_hf_config_qwen2_and_mistral() -> None:
    qwen = {
        "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
        "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 32768, "tie_word_embeddings": True,
        "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 21,
        "bos_token_id": 151643, "eos_token_id": [151643, 151645],
    }  # fmt: skip
    cfg = ModelConfig.from_hf_config(qwen)
    assert cfg == BUILTIN_CONFIGS["qwen2-0.5b"]
    assert cfg.attention_bias and not cfg.attention_out_bias and cfg.sliding_window is None
    mixed = ModelConfig.from_hf_config({**qwen, "use_sliding_window": True})  # layers >= 21 slide
    assert mixed.sliding_window == 32768 and mixed.layer_types is not None
    assert [mixed.is_sliding_layer(i) for i in (0, 20, 21, 23)] == [False, False, True, True]
    assert mixed.layer_window(23) == (32767, 0) and mixed.layer_window(0) == (-1, -1)
    mistral = BUILTIN_CONFIGS["mistral-7b"].to_hf_config()
    assert mistral["sliding_window"] == 4096
    assert ModelConfig.from_hf_config(mistral) == BUILTIN_CONFIGS["mistral-7b"]


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"model_type": "gpt2"}, "supported model_type: llama, mistral, qwen2"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ],
)
def test_from_hf_config_rejects_unsupported(changes: dict, match: str) -> None:
    hf = BUILTIN_CONFIGS["smollm2-135m"].to_hf_config()
    hf.update(changes)
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config(hf)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelConfig.from_hf_config({"model_type": "llama", "vocab_size": 1, "hidden_size": 1, "intermediate_size": 1,
                                    "num_attention_heads": 1})  # fmt: skip


def test_builtins() -> None:
    for name in ("smollm2-135m", "llama-3-8b", "llama-3-70b", "mistral-7b", "qwen2-0.5b"):
        assert name in BUILTIN_CONFIGS
    assert get_builtin_config("SmolLM2-135M-Instruct") is BUILTIN_CONFIGS["smollm2-135m"]
    # Llama-3-8B: 8.03 B parameters.
    assert 8.0e9 < BUILTIN_CONFIGS["llama-3-8b"].num_params() < 8.1e9
    assert 134e6 < BUILTIN_CONFIGS["smollm2-135m"].num_params() < 136e6
    with pytest.raises(ValueError, match=r"built-in: .*llama-3-8b"):
        get_builtin_config("gpt-5")


@pytest.mark.parametrize(
    "rope_scaling",
    [
        pytest.param(LLAMA3, id="llama3"),
        pytest.param({"rope_type": "linear", "factor": 4.0}, id="linear"),
        pytest.param(
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}, id="yarn"
        ),
        pytest.param(
            {
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 2048,
                "beta_fast": 16,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
            },
            id="yarn-mscale",
        ),
    ],
)
def test_rope_scaling_matches_transformers(rope_scaling: dict) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = ModelConfig(**{**BASE, "head_dim": 128, "num_heads": 4, "hidden_size": 512}, rope_theta=500000.0,
                      rope_scaling=rope_scaling, max_position_embeddings=16384)  # fmt: skip
    hf_cfg = LlamaConfig(**{k: v for k, v in cfg.to_hf_config().items() if k != "model_type"})
    ref, ref_scale = ROPE_INIT_FUNCTIONS[rope_scaling["rope_type"]](hf_cfg, torch.device("cpu"))
    ours, scale = rope_inv_freq(cfg)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale)
    # The scaling changes the low frequencies (so the comparison is not vacuous).
    plain, _ = rope_inv_freq(cfg.replace(rope_scaling=None))
    assert not torch.allclose(plain, ours)
    cos, _sin = rope_cos_sin(cfg)
    assert cos.shape == (16384, 64) and torch.allclose(cos[0], torch.full((64,), scale))


def test_rope_freq_factors_divide_inv_freq() -> None:
    cfg = ModelConfig(**BASE)
    factors = tuple(float(i + 1) for i in range(cfg.head_dim // 2))
    scaled, _ = rope_inv_freq(cfg.replace(rope_scaling={"rope_type": "freq_factors", "factors": factors}))
    plain, _ = rope_inv_freq(cfg)
    torch.testing.assert_close(scaled, plain / torch.tensor(factors))


def test_new_builtins_match_their_hf_configs() -> None:
    """Qwen3-0.6B and Gemma 3 1B as their config.json files read; sizes as published (0.6B, 1.0B)."""
    from flashpage.roofline.model_shapes import get_model_shape

    qwen3 = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 40960,
        "max_window_layers": 28, "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
        "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936,
    }  # fmt: skip
    cfg = ModelConfig.from_hf_config(qwen3)
    assert cfg == get_builtin_config("qwen3-0.6b").replace(eos_token_ids=(151645,))
    assert cfg.qk_norm and 0.59e9 < cfg.num_params() < 0.60e9
    shape = get_model_shape("qwen3-0.6b")
    assert (shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.head_dim) == (1024, 28, 16, 8, 128)
    gemma3 = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
        "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": [1, 106],
        "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 1152, "intermediate_size": 6912, "max_position_embeddings": 32768,
        "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
        "vocab_size": 262144,
    }  # fmt: skip
    g = ModelConfig.from_hf_config(gemma3)
    assert g == get_builtin_config("gemma-3-1b-it")
    assert [i for i in range(26) if not g.is_sliding_layer(i)] == [5, 11, 17, 23]
    assert 0.99e9 < g.num_params() < 1.01e9
    assert 2.6e9 < get_builtin_config("gemma-2-2b").num_params() < 2.7e9
