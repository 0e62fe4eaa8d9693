"""The embedded SmolLM2-135M-Instruct GGUF against Hugging Face transformers loading the same file.

transformers dequantises the GGUF itself (``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``,
float32), so this checks our parser, dequantisers, Q/K un-permutation, config, RoPE and forward
independently. Loading the HF model takes ~15 s on 2 cores, so it is loaded once per module.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from flashpage.models.loader import LoadedModel, load_model, save_hf_checkpoint
from tests.models.test_llama import full_logits, step_meta

os.environ["HF_HUB_OFFLINE"] = "1"  # never reach for the hub

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
]
CHAT = [{"role": "user", "content": "What is 2 + 2? Answer briefly."}]


@pytest.fixture(scope="module")
def ours() -> LoadedModel:
    t0 = time.perf_counter()
    lm = load_model("smollm2-135m-instruct")
    print(
        f"\nflashpage load of the embedded GGUF (parse + dequant + tokenizer): {time.perf_counter() - t0:.2f} s"
    )
    return lm


@pytest.fixture(scope="module")
def hf(ours: LoadedModel) -> Any:
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(ours.source), gguf_file=os.path.basename(ours.source), dtype=torch.float32,
        local_files_only=True,
    ).eval()  # fmt: skip
    print(f"\ntransformers load of the same GGUF: {time.perf_counter() - t0:.2f} s")
    return model


def prompt_ids(lm: LoadedModel) -> list[torch.Tensor]:
    tok = lm.tokenizer
    texts = [*PROMPTS, tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)]
    return [torch.tensor(tok(t, add_special_tokens=False).input_ids) for t in texts]


def assert_logits_match(ours: torch.Tensor, ref: torch.Tensor) -> None:
    scale = ref.abs().max()
    assert (ours - ref).abs().max() <= 1e-3 * scale, float((ours - ref).abs().max() / scale)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_load_time_and_config(ours: LoadedModel) -> None:
    assert ours.load_seconds < 20.0  # a few seconds on an idle machine; generous for a busy CI box
    c = ours.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.eos_token_ids == (2,)
    assert ours.chat_template is not None and "<|im_start|>" in ours.chat_template


def test_full_sequence_logits_match_transformers(ours: LoadedModel, hf: Any) -> None:
    for ids in prompt_ids(ours):
        got = full_logits(ours.model, ids, block_size=16)
        with torch.no_grad():
            ref = hf(ids[None]).logits[0].float()
        assert_logits_match(got, ref)


def test_incremental_decode_matches_full_forward(ours: LoadedModel, hf: Any) -> None:
    """Prefill, then 3 greedy single-token steps through the paged cache; compare with full forwards."""
    model, cfg = ours.model, ours.config
    ids = prompt_ids(ours)[0]
    bs = 16
    table = [3, 0, 2]  # 48 slots, out of order
    shape = (4, bs, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
    n = ids.numel()
    with torch.no_grad():
        meta, pos = step_meta([(0, n)], [table], bs)
        steps = [model.compute_logits(model(ids, pos, caches, meta))[-1:]]
        seq = ids
        for _ in range(3):
            nxt = steps[-1].argmax(-1)
            meta, pos = step_meta([(seq.numel(), 1)], [table], bs)
            steps.append(model.compute_logits(model(nxt, pos, caches, meta)))
            seq = torch.cat([seq, nxt])
        ref_full = full_logits(model, seq)
        ref_hf = hf(seq[None]).logits[0].float()
    got = torch.cat(steps)  # logits at positions n-1 .. n+2
    torch.testing.assert_close(got, ref_full[n - 1 :], rtol=1e-4, atol=1e-4)
    assert_logits_match(got, ref_hf[n - 1 :])


def test_tokenizer_matches_transformers_gguf_tokenizer(ours: LoadedModel) -> None:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(
        os.path.dirname(ours.source), gguf_file=os.path.basename(ours.source), local_files_only=True
    )
    tok = ours.tokenizer
    for text in [*PROMPTS, "  leading spaces\n\n<|im_start|>user\nünïcödé 日本 12345<|im_end|>"]:
        assert tok(text).input_ids == ref(text).input_ids
    assert tok.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True
    ) == ref.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert (tok.bos_token_id, tok.eos_token_id, len(tok)) == (ref.bos_token_id, ref.eos_token_id, len(ref))
    assert tok.decode(tok("Hello, world!").input_ids) == "Hello, world!"


def test_safetensors_round_trip_of_gguf_weights(ours: LoadedModel, tmp_path: Path) -> None:
    save_hf_checkpoint(ours.model, str(tmp_path), tokenizer=ours.tokenizer)
    lm = load_model(str(tmp_path), load_format="auto")
    assert lm.config == ours.config
    assert lm.tokenizer is not None and lm.chat_template == ours.chat_template
    ids = prompt_ids(ours)[1]
    assert lm.tokenizer(PROMPTS[1], add_special_tokens=False).input_ids == ids.tolist()
    assert torch.equal(full_logits(lm.model, ids), full_logits(ours.model, ids))
