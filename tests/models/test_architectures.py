"""Every supported architecture against ``transformers`` on a tiny random model (float32, CPU).

Each model is built by transformers itself (Llama 3.x with ``llama3`` RoPE scaling, Mistral, Qwen2,
Qwen3, Gemma 2, Gemma 3), saved with ``save_pretrained`` as a HF safetensors directory and loaded by
flashpage's loader. Checked: the logits of a prompt longer than the sliding window, greedy generation
through :class:`~flashpage.LLM` (chunked prefill, paged decode) against ``generate``, GGUF files written
the way llama.cpp's converter writes them (names from ``gguf``'s own tensor map, Gemma norms stored as
``1 + w``) loading to the same logits, and that each Gemma/Qwen3 feature really changes the output.

Tolerance: both sides run in float32 and differ only in operation order (one fused QKV GEMM against
three, SDPA against eager softmax), so the logits agree to float32 rounding: ``rtol=1e-4, atol=1e-5``
on logits of order 1 (the existing Llama tests' bound).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from flashpage.engine.llm import LLM
from flashpage.engine.sampling_params import SamplingParams
from flashpage.models.config import ModelConfig
from flashpage.models.loader import LoadedModel, load_model
from tests.models.test_llama import full_logits, make_caches, step_meta

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WINDOW = 8
COMMON = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
    "initializer_range": 0.1, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
}  # fmt: skip


def hf_config(arch: str) -> Any:
    """The transformers config of the tiny ``arch`` model (no eos, so generation runs its full length)."""
    import transformers as tf

    if arch == "llama3":
        rope = {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16, "rope_theta": 500000.0,
        }  # fmt: skip
        return tf.LlamaConfig(num_hidden_layers=2, rope_parameters=rope, **COMMON)
    if arch == "mistral":
        return tf.MistralConfig(num_hidden_layers=2, sliding_window=WINDOW, **COMMON)
    if arch == "qwen2":
        return tf.Qwen2Config(num_hidden_layers=2, tie_word_embeddings=True, **COMMON)
    if arch == "qwen3":
        return tf.Qwen3Config(num_hidden_layers=2, **COMMON)
    if arch == "gemma2":  # layer 0 slides, layer 1 is global; softcaps small enough to bite
        return tf.Gemma2Config(
            num_hidden_layers=2, sliding_window=WINDOW, query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0, final_logit_softcapping=3.0, **COMMON,
        )  # fmt: skip
    if arch == "gemma3":  # Gemma 3's pattern (global every 6th layer) cut to one global layer in 3;
        # query_pre_attn_scalar = head_dim as in every Gemma 3 but the 27B (the scale GGUF files imply)
        rope = {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        }
        types = ["sliding_attention", "sliding_attention", "full_attention"]
        return tf.Gemma3TextConfig(
            num_hidden_layers=3, sliding_window=WINDOW, layer_types=types, rope_parameters=rope,
            query_pre_attn_scalar=COMMON["head_dim"], **COMMON,
        )  # fmt: skip
    raise AssertionError(arch)


ARCHS = ["llama3", "mistral", "qwen2", "qwen3", "gemma2", "gemma3"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    """arch -> (transformers model, its save_pretrained directory); norms and biases away from init."""
    from transformers import AutoModelForCausalLM

    out = {}
    for i, arch in enumerate(ARCHS):
        torch.manual_seed(100 + i)
        hf = AutoModelForCausalLM.from_config(
            hf_config(arch), attn_implementation="eager", dtype=torch.float32
        )
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    p.add_(torch.randn_like(p) * 0.3)
        path = tmp_path_factory.mktemp(arch)
        hf.eval().save_pretrained(path, safe_serialization=True)
        out[arch] = (hf, path)
    return out


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def hf_logits(hf: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids[None]).logits[0].float()


@pytest.mark.parametrize("arch", ARCHS)
def test_safetensors_logits_match_transformers(checkpoints: dict, arch: str) -> None:
    hf, path = checkpoints[arch]
    lm = load_model(str(path))
    expect = {"llama3": "llama", "mistral": "mistral", "qwen2": "qwen2"}.get(arch, arch)
    assert lm.config.architecture == expect
    ids = prompt(3 * WINDOW, 1)  # longer than the window: the sliding layers see only part of it
    torch.testing.assert_close(
        full_logits(lm.model, ids, block_size=8), hf_logits(hf, ids), rtol=1e-4, atol=1e-5
    )


# Each feature of the new architectures, removed from the loaded config: the logits must move well
# outside the tolerance above, so the parity test above cannot pass with the feature ignored.
FEATURE_OFF = [
    ("qwen3", {"qk_norm": False}),
    ("gemma2", {"attn_logit_softcapping": None}),
    ("gemma2", {"final_logit_softcapping": None}),
    ("gemma2", {"layer_types": None, "sliding_window": None}),
    ("gemma2", {"query_pre_attn_scalar": None}),
    ("gemma2", {"scale_embeddings": False}),
    ("gemma2", {"hidden_act": "silu"}),
    ("gemma3", {"rope_local_theta": 1_000_000.0}),
    ("gemma3", {"layer_types": ("sliding_attention",) * 3}),
]


@pytest.mark.parametrize(("arch", "off"), FEATURE_OFF, ids=[f"{a}-{next(iter(o))}" for a, o in FEATURE_OFF])
def test_each_feature_changes_the_logits(checkpoints: dict, arch: str, off: dict) -> None:
    hf, path = checkpoints[arch]
    cfg = load_model(str(path)).config
    if "qk_norm" in off:  # the checkpoint's q/k norm tensors have no place without the norm: drop them
        lm = load_model(str(path), load_format="dummy", config=cfg.replace(**off))
        src = load_model(str(path)).model
        lm.model.load_weights(((n, t) for n, t in src.hf_state_dict() if "_norm." not in n))
    else:
        lm = load_model(str(path), config=cfg.replace(**off))
    ids = prompt(3 * WINDOW, 2)
    diff = (full_logits(lm.model, ids, block_size=8) - hf_logits(hf, ids)).abs().max()
    assert diff > 1e-3, f"{arch} without {off}: logits still within {float(diff):.1e}"


@pytest.fixture(scope="module")
def greedy_refs(checkpoints: dict) -> dict[str, list[list[int]]]:
    """transformers' greedy continuation of two prompts (one longer than the window) per architecture."""
    refs = {}
    for arch, (hf, _) in checkpoints.items():
        refs[arch] = []
        for ids in (prompt(5, 3), prompt(3 * WINDOW + 5, 4)):
            with torch.no_grad():
                # An explicit mask: generate would otherwise mask every prompt token equal to pad_token_id.
                mask = torch.ones(1, ids.numel(), dtype=torch.long)
                out = hf.generate(
                    ids[None], attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0
                )
            refs[arch].append(out[0, ids.numel() :].tolist())
    return refs


@pytest.mark.parametrize("arch", ARCHS)
def test_llm_greedy_matches_generate(checkpoints: dict, greedy_refs: dict, arch: str) -> None:
    """``LLM(model=dir)``: both prompts in one batch, prefill chunked in 16-token steps over 8-token
    blocks (the long prompt's chunks attend to cached blocks), then 15 paged decode steps."""
    _, path = checkpoints[arch]
    # float32 on the CPU also on a GPU machine: token parity with float32 transformers needs equal precision.
    llm = LLM(
        model=str(path), dtype="float32", device="cpu", block_size=8, max_num_batched_tokens=16,
        kv_cache_bytes=1 << 20,
    )  # fmt: skip
    prompts = [
        {"prompt_token_ids": prompt(5, 3).tolist()},
        {"prompt_token_ids": prompt(3 * WINDOW + 5, 4).tolist()},
    ]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == greedy_refs[arch]


# ---------------------------------------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------------------------------------

GGUF_ARCH = {
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "gemma2": gguf.MODEL_ARCH.GEMMA2,
    "gemma3": gguf.MODEL_ARCH.GEMMA3,
}


def write_gguf(path: Path, arch: str, hf: Any) -> None:
    """Write the transformers model as llama.cpp's ``convert_hf_to_gguf.py`` would (float32 tensors):
    names from gguf's tensor map, no Q/K permutation (NEOX RoPE), Gemma norm weights stored as 1 + w."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    if arch == "gemma3":
        full, local = c.rope_parameters["full_attention"], c.rope_parameters["sliding_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
        w.add_rope_freq_base_swa(local["rope_theta"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    else:
        w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(c.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_attention_scale(c.query_pre_attn_scalar**-0.5)  # llama.cpp's f_attention_scale
    names = gguf.get_tensor_name_map(GGUF_ARCH[arch], c.num_hidden_layers)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        x = t.float().numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            x = x + 1.0
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), np.ascontiguousarray(x))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", list(GGUF_ARCH))
def test_gguf_logits_match_transformers(checkpoints: dict, tmp_path: Path, arch: str) -> None:
    hf, path = checkpoints[arch]
    write_gguf(tmp_path / f"{arch}.gguf", arch, hf)
    lm = load_model(str(tmp_path / f"{arch}.gguf"))
    ref_cfg = load_model(str(path)).config
    # GGUF stores eps and the attention scale as float32 (gemma2's scalar comes back through the scale).
    eps = float(np.float32(ref_cfg.rms_norm_eps))
    got = lm.config.replace(rms_norm_eps=eps)
    if arch == "gemma2":
        assert lm.config.query_pre_attn_scalar == pytest.approx(24.0, rel=1e-6)
        got = got.replace(query_pre_attn_scalar=ref_cfg.query_pre_attn_scalar)
    assert got == ref_cfg.replace(rms_norm_eps=eps)
    ids = prompt(3 * WINDOW, 5)
    torch.testing.assert_close(
        full_logits(lm.model, ids, block_size=8), hf_logits(hf, ids), rtol=1e-4, atol=1e-5
    )


# ---------------------------------------------------------------------------------------------------------
# The Triton path (interpreter on CPU): per-layer window / softcap through the kernels, fused q/k norm
# ---------------------------------------------------------------------------------------------------------


def decode_steps(lm: LoadedModel, ids: torch.Tensor, prefill: int, dev: str) -> torch.Tensor:
    """Prefill ``prefill`` tokens, then decode the rest one step at a time, over shuffled blocks."""
    model, ids = lm.model.to(dev), ids.to(dev)
    table = [5, 2, 7, 1]
    caches = make_caches(lm.config, 8, 8, dev)
    out = []
    with torch.no_grad():
        meta, pos = step_meta([(0, prefill)], [table], 8, dev)
        out.append(model.compute_logits(model(ids[:prefill], pos, caches, meta)))
        for t in range(prefill, ids.numel()):
            meta, pos = step_meta([(t, 1)], [table], 8, dev)
            out.append(model.compute_logits(model(ids[t : t + 1], pos, caches, meta)))
    return torch.cat(out).cpu()


@pytest.mark.parametrize("arch", ["gemma2", "qwen3"])
def test_triton_kernels_and_fused_ops(checkpoints: dict, arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 2 (a softcapped sliding layer and a softcapped global one) and Qwen3 (fused per-head q/k
    RMSNorm) through the Triton kernels: chunk prefill, then decode past the window."""
    hf, path = checkpoints[arch]
    lm = load_model(str(path))
    ids = prompt(2 * WINDOW + 3, 6)
    ref = hf_logits(hf, ids)
    monkeypatch.setenv("FLASHPAGE_BACKEND", "triton")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    lm.model.fused_ops = True
    tol = 2e-3 if dev == "cuda" else 1e-4
    torch.testing.assert_close(decode_steps(lm, ids, 2 * WINDOW, dev), ref, rtol=tol, atol=tol / 10)


def test_gemma_defaults_from_config_and_hf() -> None:
    """ModelConfig fills each architecture's fixed options; HF configs without layer_types get
    transformers' default pattern (Gemma 3: 5 sliding : 1 global; Gemma 2: alternating)."""
    base = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "num_kv_heads": 1,
            "head_dim": 16}  # fmt: skip
    g3 = ModelConfig(
        architecture="gemma3",
        num_layers=12,
        sliding_window=4,
        rope_local_theta=1e4,
        query_pre_attn_scalar=16,
        **base,
    )
    assert g3.qk_norm and g3.sandwich_norm and g3.scale_embeddings and g3.norm_weight_offset == 1.0
    assert g3.hidden_act == "gelu_pytorch_tanh"
    assert [i for i in range(12) if not g3.is_sliding_layer(i)] == [5, 11]
    assert ModelConfig.from_hf_config(g3.to_hf_config()) == g3
    q3 = ModelConfig(architecture="qwen3", num_layers=2, **base)
    assert q3.qk_norm and not q3.sandwich_norm and q3.hidden_act == "silu"
    assert ModelConfig.from_hf_config(q3.to_hf_config()) == q3
    g2 = ModelConfig.from_hf_config(
        {"model_type": "gemma2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
         "sliding_window": 4096, "rope_theta": 10000.0}
    )  # fmt: skip
    assert g2.layer_types == ("sliding_attention", "full_attention") * 2
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping, g2.query_pre_attn_scalar) == (
        50.0,
        30.0,
        256,
    )
    assert g2.tie_word_embeddings and not g2.qk_norm
    with pytest.raises(ValueError, match="layer_types"):
        g3.replace(layer_types=("full_attention",))
    with pytest.raises(ValueError, match="hidden_act"):
        q3.replace(hidden_act="relu")
    with pytest.raises(ValueError, match="qk_norm"):
        q3.replace(qk_norm=False).to_hf_config()
    with pytest.raises(ValueError, match="text_config"):
        ModelConfig.from_hf_config({"model_type": "gemma3"})


def test_gemma3_multimodal_checkpoint_loads_its_language_model(tmp_path: Path) -> None:
    """Gemma 3 4B+ ship as Gemma3ForConditionalGeneration: text_config listing only non-default keys,
    weights under ``language_model.model.*`` beside a vision tower. The text logits must match."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(7)
    text = {k: v for k, v in COMMON.items() if not k.endswith("token_id")}
    text.update(num_hidden_layers=2, sliding_window=WINDOW, query_pre_attn_scalar=32, vocab_size=300)
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14}  # fmt: skip
    cfg = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=297,
        eoi_token_index=298, image_token_index=299, eos_token_id=[1, 106],
    )  # fmt: skip
    hf = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    lm = load_model(str(tmp_path))
    assert lm.config.architecture == "gemma3" and lm.config.eos_token_ids == (1, 106)
    assert lm.config.max_position_embeddings == 128 and lm.config.rope_local_theta == 10_000.0
    ids = prompt(3 * WINDOW, 8)
    torch.testing.assert_close(
        full_logits(lm.model, ids, block_size=8), hf_logits(hf, ids), rtol=1e-4, atol=1e-5
    )
