"""GGUF: header parser vs gguf.GGUFReader, dequantisation vs gguf.quants, and whole tiny GGUF files
written with gguf.GGUFWriter the way llama.cpp does (Q/K rows permuted) loading to the right logits."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from flashpage.models.config import ModelConfig
from flashpage.models.gguf_loader import config_from_gguf, dequantize, read_gguf, unpermute_qk
from flashpage.models.llama import LlamaForCausalLM
from flashpage.models.loader import embedded_model_path, load_model
from tests.models.test_llama import TINY, full_logits

os.environ.setdefault("HF_HUB_OFFLINE", "1")
Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def embedded() -> str:
    return embedded_model_path("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def reader(embedded: str) -> gguf.GGUFReader:
    """gguf's own reader of the embedded file (slow: ~3 s, so parsed once)."""
    return gguf.GGUFReader(embedded)


def test_parser_matches_gguf_reader(embedded: str, reader: gguf.GGUFReader) -> None:
    gf = read_gguf(embedded)
    ref = reader
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert list(gf.metadata) == keys
    for k in keys:
        want = ref.fields[k].contents()
        got = gf.metadata[k]
        if isinstance(want, float):
            assert got == pytest.approx(want, rel=1e-7), k
        else:
            assert got == want, k
    assert len(gf.tensors) == len(ref.tensors) == 272
    for t in ref.tensors:
        info = gf.tensors[t.name]
        assert info.shape == tuple(int(d) for d in reversed(t.shape.tolist())), t.name
        assert info.ggml_type == int(t.tensor_type) and info.offset == int(t.data_offset), t.name
        assert info.nbytes == int(t.n_bytes), t.name
    assert gf.tensors["token_embd.weight"].type_name == "Q8_0"
    assert gf.tensors["blk.0.attn_q.weight"].type_name == "Q4_1"


def test_dequantize_real_tensors_match_gguf(embedded: str, reader: gguf.GGUFReader) -> None:
    gf = read_gguf(embedded)
    ref = {t.name: t for t in reader.tensors}
    for name in (
        "blk.3.attn_k.weight",
        "blk.0.ffn_down.weight",
        "token_embd.weight",
        "blk.0.attn_norm.weight",
    ):
        info = gf.tensors[name]
        ours = dequantize(gf.raw(name), info.ggml_type, info.shape, torch.float32)
        want = torch.from_numpy(np.array(gguf.quants.dequantize(ref[name].data, ref[name].tensor_type)))
        assert ours.shape == want.shape == info.shape, name
        assert torch.equal(ours, want.float()), name


@pytest.mark.parametrize(
    "qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0]
)  # Q5_0: numpy fallback
def test_dequantize_formats(qtype: Q) -> None:
    x = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32)
    stored = gguf.quants.quantize(x, qtype)
    want = torch.from_numpy(gguf.quants.dequantize(stored, qtype).astype(np.float32))
    raw = torch.from_numpy(np.ascontiguousarray(stored).view(np.uint8).reshape(-1))
    ours = dequantize(raw, int(qtype), (6, 64), torch.float32)
    assert torch.equal(ours, want)
    assert (ours - torch.from_numpy(x)).abs().max() < 0.5  # a real approximation of x
    assert dequantize(raw, int(qtype), (6, 64), torch.bfloat16).dtype == torch.bfloat16


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (HF rotate-half rows -> llama.cpp interleaved rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = torch.randn(4 * 32, 8)
    assert torch.equal(unpermute_qk(torch.from_numpy(llama_cpp_permute(w.numpy(), 4)), 4), w)
    assert not torch.equal(torch.from_numpy(llama_cpp_permute(w.numpy(), 4)), w)


_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}  # fmt: skip


def write_gguf(path: Path, cfg: ModelConfig, weights: dict[str, torch.Tensor], arch: str, qtype: Q) -> dict:
    """Write ``weights`` (HF names) as llama.cpp would: GGUF names, Q/K permuted for llama, 2-D
    matrices in ``qtype``. Returns the HF-layout weights the file holds (after quantisation)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test model")
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    stored = {}
    for hf, t in weights.items():
        x = t.float().numpy()
        if hf == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif hf == "model.norm.weight":
            name = "output_norm.weight"
        elif hf == "lm_head.weight":
            name = "output.weight"
        else:
            layer, rest = hf.removeprefix("model.layers.").split(".", 1)
            name = f"blk.{layer}.{_GGUF_NAMES[rest]}"
        # ggml quantises each row on its own, so quantising then permuting rows equals permuting then
        # quantising: the expected weights need no un-permute (the loader's own is not used here).
        stored[hf] = (
            torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(x, qtype), qtype).astype(np.float32))
            if x.ndim == 2
            else t.float()
        )
        if arch == "llama" and name.endswith("attn_q.weight"):
            x = llama_cpp_permute(x, cfg.num_heads)
        elif arch == "llama" and name.endswith("attn_k.weight"):
            x = llama_cpp_permute(x, cfg.num_kv_heads)
        if x.ndim == 2:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


@pytest.mark.parametrize(
    ("arch", "changes", "qtype"),
    [
        pytest.param("llama", {}, Q.Q8_0, id="llama-q8_0-untied"),
        pytest.param("llama", {"tie_word_embeddings": True}, Q.Q4_0, id="llama-q4_0-tied"),
        pytest.param("qwen2", {"architecture": "qwen2", "attention_bias": True}, Q.F16, id="qwen2-f16-bias"),
    ],
)
def test_tiny_gguf_loads_to_same_logits(tmp_path: Path, arch: str, changes: dict, qtype: Q) -> None:
    cfg = ModelConfig(**{"architecture": "llama", **TINY, **changes})
    src = LlamaForCausalLM(cfg, seed=5)
    with torch.no_grad():
        for name, p in src.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif "bias" in name:
                p.normal_(0, 0.3)
    path = tmp_path / "tiny.gguf"
    stored = write_gguf(path, cfg, dict(src.hf_state_dict()), arch, qtype)
    # The reference: the same (quantised) weights loaded directly in HF layout.
    ref_model = LlamaForCausalLM(cfg, empty=True)
    ref_model.load_weights(stored.items())
    threads = torch.get_num_threads()
    loaded = load_model(str(path))
    assert torch.get_num_threads() == threads  # the single-thread dequantisation restores the setting
    # GGUF stores eps as float32.
    eps = float(np.float32(cfg.rms_norm_eps))
    assert loaded.config == cfg.replace(bos_token_id=1, eos_token_ids=(2,), rms_norm_eps=eps)
    assert loaded.tokenizer is None and loaded.source == str(path)
    ids = torch.randint(0, cfg.vocab_size, (11,))
    torch.testing.assert_close(
        full_logits(loaded.model, ids), full_logits(ref_model, ids), rtol=1e-5, atol=1e-5
    )
    if arch == "llama":
        # Skipping the un-permute would give different logits: the test sees the permutation.
        q = loaded.model.layers[0].self_attn.qkv_weight[: cfg.q_size]
        assert not torch.allclose(q, torch.from_numpy(llama_cpp_permute(q.numpy(), cfg.num_heads)))


def test_unsupported_architecture_and_bad_files(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"architecture 'gpt2' is not supported; supported: llama, qwen2"):
        load_model(str(tmp_path / "gpt2.gguf"))
    (tmp_path / "junk.gguf").write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(str(tmp_path / "junk.gguf"))
    good = (tmp_path / "gpt2.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(good[: len(good) - 64])
    with pytest.raises(ValueError, match=r"past the end|truncated"):
        read_gguf(str(tmp_path / "cut.gguf"))


def test_rope_freqs_tensor_becomes_freq_factors(tmp_path: Path) -> None:
    cfg = ModelConfig(architecture="llama", **TINY)
    path = tmp_path / "rf.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for method, value in (("add_block_count", 1), ("add_embedding_length", cfg.hidden_size),
                          ("add_feed_forward_length", 96), ("add_head_count", 4), ("add_key_length", 32)):  # fmt: skip
        getattr(w, method)(value)
    factors = np.linspace(1.0, 8.0, cfg.head_dim // 2).astype(np.float32)
    w.add_tensor("rope_freqs.weight", factors)
    w.add_tensor("token_embd.weight", np.zeros((cfg.vocab_size, cfg.hidden_size), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got = config_from_gguf(read_gguf(str(path)))
    assert got.rope_scaling is not None and got.rope_scaling["rope_type"] == "freq_factors"
    np.testing.assert_allclose(got.rope_scaling["factors"], factors)
    assert got.num_kv_heads == 4 and got.tie_word_embeddings
