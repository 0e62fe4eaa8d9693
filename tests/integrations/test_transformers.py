"""transformers integration: a tiny Llama-shaped model with attn_implementation="flashpage" trains and
generates like the sdpa implementation (flashpage's Triton kernels under the interpreter on CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import flashpage.integrations.transformers as fp_hf
from tests.ops.test_flash_fwd import on_device  # noqa: F401 (autouse fixture: tensors on the test device)
from tests.tolerance import assert_close_to_ref

_VOCAB = 96


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHPAGE_BACKEND", "triton")


def _config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip


def _models(device: str) -> dict[str, torch.nn.Module]:
    """flashpage and sdpa models in float32 and an sdpa float64 reference, all with one set of
    weights, on ``device`` (CUDA when present, else CPU, where the kernels run under the interpreter)."""
    torch.manual_seed(0)
    models = {
        "flashpage": AutoModelForCausalLM.from_config(_config(), attn_implementation="flashpage"),
        "sdpa": AutoModelForCausalLM.from_config(_config(), attn_implementation="sdpa"),
        "ref": AutoModelForCausalLM.from_config(_config(), attn_implementation="sdpa").double(),
    }
    state = models["flashpage"].state_dict()
    for m in models.values():
        m.load_state_dict(state)
        m.to(device)
    assert models["flashpage"].config._attn_implementation == "flashpage"
    return models


def _padded_batch(device: str) -> tuple[Tensor, Tensor, Tensor]:
    """ids, attention mask (row 0 right-padded, row 1 left-padded) and labels (-100 on padding)."""
    ids = torch.randint(0, _VOCAB, (3, 9), device=device)
    mask = torch.ones(3, 9, dtype=torch.long, device=device)
    mask[0, 6:] = 0
    mask[1, :4] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def test_training_step_logits_and_grads_within_sdpa_tolerance(
    monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    models = _models(device)
    ids, mask, labels = _padded_batch(device)
    res = {}
    for name, m in models.items():
        m.train()
        out = m(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        grads = {n: p.grad for n, p in m.named_parameters()}
        res[name] = (out.logits[mask.bool()].detach(), grads)
    ref_logits, ref_grads = res["ref"]
    # a NaN in the baselines would make the tolerance bound infinite
    assert torch.isfinite(ref_logits).all() and torch.isfinite(res["sdpa"][0]).all()
    assert_close_to_ref(res["flashpage"][0], ref_logits, res["sdpa"][0], name="logits")
    for n, g in res["flashpage"][1].items():
        assert torch.isfinite(ref_grads[n]).all() and torch.isfinite(res["sdpa"][1][n]).all(), n
        assert_close_to_ref(g, ref_grads[n], res["sdpa"][1][n], name=n)
    # The flashpage implementation really runs: a bad backend name fails inside it.
    monkeypatch.setenv("FLASHPAGE_BACKEND", "no-such-backend")
    with pytest.raises(ValueError, match="FLASHPAGE_BACKEND"):
        models["flashpage"](input_ids=ids, attention_mask=mask)


def test_greedy_generation_from_pretrained_left_padded_matches_sdpa(tmp_path: Path, device: str) -> None:
    models = _models(device)
    models["sdpa"].save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="flashpage").to(device)
    assert loaded.config._attn_implementation == "flashpage"
    ids = torch.randint(0, _VOCAB, (2, 6), device=device)
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]], device=device)
    kw = {"attention_mask": mask, "max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        tokens = loaded.generate(ids, **kw)
        expected = models["sdpa"].generate(ids, **kw)
    assert torch.equal(tokens, expected)


class _Attn(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2


def test_attention_function_padding_window_and_packed_sequences() -> None:
    """The registered function against transformers' sdpa one: a 2-D padding mask with a KV cache
    (keys longer than queries), a sliding window, and packed sequences of a batch of one."""
    q = torch.randn(2, 4, 3, 16)
    k, v = torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16)
    mask2d = torch.tensor([[1] * 7, [0, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    keep = torch.ones(3, 7, dtype=torch.bool).tril(4)
    for window in (None, 3):
        visible = keep & ~torch.ones(3, 7, dtype=torch.bool).tril(4 - window) if window else keep
        mask4d = (mask2d[:, None, None, :] & visible).expand(2, 1, 3, 7)
        out, _ = fp_hf.flashpage_attention_forward(_Attn(), q, k, v, mask2d, sliding_window=window)
        ref, _ = sdpa_attention_forward(_Attn(), q, k, v, mask4d)
        assert_close_to_ref(out, ref, ref)
    # packed: two sequences (3 and 4 tokens) in one row == each alone
    qp, kp, vp = torch.randn(1, 4, 7, 16), torch.randn(1, 2, 7, 16), torch.randn(1, 2, 7, 16)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    out, _ = fp_hf.flashpage_attention_forward(_Attn(), qp, kp, vp, None, position_ids=pos)
    for sl in (slice(0, 3), slice(3, 7)):
        alone, _ = fp_hf.flashpage_attention_forward(_Attn(), qp[:, :, sl], kp[:, :, sl], vp[:, :, sl], None)
        assert_close_to_ref(out[:, sl], alone, alone)
    with pytest.raises(ValueError, match="attention_mask"):
        fp_hf.flashpage_attention_forward(_Attn(), q, k, v, mask4d)


def test_register_is_idempotent_and_keeps_other_flash_names() -> None:
    from transformers import AttentionInterface
    from transformers import modeling_flash_attention_utils as fa_utils

    before = fa_utils._lazy_imports
    fp_hf.register()
    assert fa_utils._lazy_imports is before
    assert AttentionInterface._global_mapping["flashpage"] is fp_hf.flashpage_attention_forward
    assert fa_utils._lazy_imports("flashpage")[1] is fp_hf.flash_attn_varlen_func
