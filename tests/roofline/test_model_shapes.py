"""Built-in model shapes and HF config.json loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashpage.roofline.model_shapes import ModelShape, get_model_shape, known_model_names


def test_builtin_shapes() -> None:
    s = get_model_shape("smollm2-135m")
    assert (
        s.hidden,
        s.intermediate,
        s.layers,
        s.heads,
        s.kv_heads,
        s.head_dim,
        s.vocab,
        s.tied_embeddings,
    ) == (576, 1536, 30, 9, 3, 64, 49152, True)
    assert get_model_shape("smollm2-135m-instruct") == s
    l8 = get_model_shape("llama-3-8b")
    assert (l8.hidden, l8.intermediate, l8.layers, l8.heads, l8.kv_heads, l8.head_dim, l8.vocab) == (
        4096,
        14336,
        32,
        32,
        8,
        128,
        128256,
    )
    assert get_model_shape("llama-3-70b").layers == 80
    assert get_model_shape("mistral-7b").vocab == 32000
    assert l8.group == 4


def test_parameter_counts_match_published_totals() -> None:
    # Published parameter counts include the RMSNorm weights: 2 per layer + the final norm.
    l8 = get_model_shape("llama-3-8b")
    assert l8.weight_elements + (2 * l8.layers + 1) * l8.hidden == 8_030_261_248
    sm = get_model_shape("smollm2-135m")  # tied: one embedding matrix
    assert sm.weight_elements + (2 * sm.layers + 1) * sm.hidden == 134_515_008
    # Llama-3-8B bf16 KV cache: 128 KiB per token
    assert l8.kv_bytes_per_token(2) == 131072


def test_hf_config_file_and_dir(tmp_path: Path) -> None:
    cfg = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
        "tie_word_embeddings": True,
    }
    d = tmp_path / "tiny-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    s = get_model_shape(d / "config.json")
    assert s == ModelShape("tiny-model", 64, 128, 2, 4, 2, 16, 100, True)
    assert get_model_shape(d) == s
    del cfg["vocab_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="vocab_size"):
        get_model_shape(d / "config.json")


def test_unknown_model_lists_known_names() -> None:
    with pytest.raises(ValueError) as e:
        get_model_shape("gpt-17")
    for n in known_model_names():
        assert n in str(e.value)
    assert set(known_model_names()) >= {"smollm2-135m", "llama-3-8b", "llama-3-70b", "mistral-7b"}


def test_shape_validation() -> None:
    with pytest.raises(ValueError, match="kv_heads"):
        ModelShape("x", 64, 64, 1, 6, 4, 16, 10)
    with pytest.raises(ValueError, match="layers"):
        ModelShape("x", 64, 64, 0, 4, 4, 16, 10)
