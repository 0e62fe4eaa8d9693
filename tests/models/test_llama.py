"""LlamaForCausalLM on tiny configs: logits equal transformers' Llama/Mistral/Qwen2 on the same weights,
incremental decode through a (shuffled) paged cache equals the full forward, a mixed batch equals the
sequences run alone, and the loader's weight mapping round-trips.
"""

from __future__ import annotations

import os

import pytest
import torch

from flashpage.models.config import ModelConfig
from flashpage.models.llama import LlamaForCausalLM, apply_rope, rope_cos_sin
from flashpage.ops.metadata import AttentionMetadata

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY = {
    "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_layers": 2, "num_heads": 4,
    "num_kv_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 64,
}  # fmt: skip


def tiny_config(**changes: object) -> ModelConfig:
    d = {"architecture": "llama", **TINY}
    d.update(changes)
    return ModelConfig(**d)


def make_caches(
    cfg: ModelConfig, num_blocks: int, block_size: int, device: str = "cpu"
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [
        (torch.zeros(shape, device=device), torch.zeros(shape, device=device)) for _ in range(cfg.num_layers)
    ]


def step_meta(
    seqs: list[tuple[int, int]], block_tables: list[list[int]], block_size: int, device: str = "cpu"
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata for one step: ``seqs[b] = (cached tokens before the step, new tokens)``; also the positions."""
    slots, positions = [], []
    for (ctx, new), table in zip(seqs, block_tables):
        for p in range(ctx, ctx + new):
            slots.append(table[p // block_size] * block_size + p % block_size)
            positions.append(p)
    width = max(len(t) for t in block_tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
    q_lens = [n for _, n in seqs]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seqlens_k = [c + n for c, n in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_table=bt.to(device),
        seqlens_k=torch.tensor(seqlens_k, dtype=torch.int32, device=device),
        cu_seqlens_q=cu.to(device),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(seqlens_k),
        decode_only=all(n == 1 for n in q_lens),
        prefix_free=all(c == 0 for c, _ in seqs),
    )
    return meta, torch.tensor(positions, dtype=torch.int64, device=device)


def full_logits(model: LlamaForCausalLM, ids: torch.Tensor, block_size: int = 16) -> torch.Tensor:
    """Logits of one whole sequence in a single prefill step over a contiguous block table."""
    n = ids.numel()
    nb = (n + block_size - 1) // block_size
    meta, pos = step_meta([(0, n)], [list(range(nb))], block_size)
    with torch.no_grad():
        return model.compute_logits(model(ids, pos, make_caches(model.config, nb, block_size), meta))


def hf_model(cfg: ModelConfig, model: LlamaForCausalLM):  # -> transformers PreTrainedModel
    """The transformers model of the same architecture holding ``model``'s weights (fp32, eager attention)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = cfg.to_hf_config()
    model_type = d.pop("model_type")
    hf_cfg = AutoConfig.for_model(model_type, **d)
    hf = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager", dtype=torch.float32)
    missing, unexpected = hf.load_state_dict(dict(model.hf_state_dict()), strict=False)
    assert not unexpected
    assert all(k == "lm_head.weight" for k in missing), missing  # tied head
    return hf.eval()


@pytest.mark.parametrize(
    "changes",
    [
        pytest.param({}, id="llama-untied"),
        pytest.param({"tie_word_embeddings": True}, id="llama-tied"),
        pytest.param(
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                }
            },
            id="llama3-rope",
        ),
        pytest.param({"architecture": "mistral", "sliding_window": 5}, id="mistral-window"),
        pytest.param(
            {"architecture": "qwen2", "attention_bias": True, "tie_word_embeddings": True}, id="qwen2-bias"
        ),
    ],
)
def test_logits_match_transformers(changes: dict) -> None:
    cfg = tiny_config(**changes)
    model = LlamaForCausalLM(cfg, seed=1)
    # Norm weights and biases away from their init, so a mix-up of them cannot cancel out.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in name else 0.0))
    ids = torch.randint(0, cfg.vocab_size, (13,))
    ours = full_logits(model, ids, block_size=8)
    with torch.no_grad():
        ref = hf_model(cfg, model)(ids[None]).logits[0].float()
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_qwen2_bias_shapes_and_use() -> None:
    cfg = tiny_config(architecture="qwen2", attention_bias=True)
    model = LlamaForCausalLM(cfg)
    attn = model.layers[0].self_attn
    assert attn.qkv_bias is not None and attn.qkv_bias.shape == (cfg.q_size + 2 * cfg.kv_size,)
    assert attn.o_bias is None
    assert "model.layers.0.self_attn.k_proj.bias" in model.hf_weight_names()
    ids = torch.randint(0, cfg.vocab_size, (5,))
    before = full_logits(model, ids)
    with torch.no_grad():
        attn.qkv_bias[cfg.q_size + cfg.kv_size :] += 1.0  # the V bias must change the output
    assert not torch.allclose(before, full_logits(model, ids))
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())


BACKENDS = ["torch", "triton"]


def backend_device(backend: str) -> tuple[str, float]:
    """Where a backend's variant runs and its tolerance: the Triton kernels run on CUDA when there is a
    GPU (fp32 dots may use TF32 there), else on CPU tensors under the interpreter."""
    if backend == "triton" and torch.cuda.is_available():
        return "cuda", 2e-3
    return "cpu", 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [None, 3])
def test_incremental_decode_matches_full_forward(
    window: int | None, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill 17 tokens, then 3 decode steps, through a cache whose blocks are out of order.

    The reference is the torch-path full forward; ``triton`` runs the steps through the Triton kernels
    (the interpreter on CPU), so the model is checked against both attention paths.
    """
    cfg = tiny_config(architecture="mistral" if window else "llama", sliding_window=window)
    model = LlamaForCausalLM(cfg, seed=2)
    ids = torch.randint(0, cfg.vocab_size, (20,))
    ref = full_logits(model, ids)
    monkeypatch.setenv("FLASHPAGE_BACKEND", backend)
    dev, tol = backend_device(backend)
    model, ids = model.to(dev), ids.to(dev)
    bs = 8  # the smallest block size the paged kernels take
    table = [5, 2, 7]  # physical blocks of the sequence, deliberately not 0, 1, 2
    caches = make_caches(cfg, 8, bs, dev)
    got = []
    with torch.no_grad():
        meta, pos = step_meta([(0, 17)], [table], bs, dev)
        got.append(model.compute_logits(model(ids[:17], pos, caches, meta)))
        for t in range(17, 20):
            meta, pos = step_meta([(t, 1)], [table], bs, dev)
            assert meta.decode_only
            got.append(model.compute_logits(model(ids[t : t + 1], pos, caches, meta)))
    torch.testing.assert_close(torch.cat(got).cpu(), ref, rtol=tol, atol=tol / 10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_batch_matches_sequences_alone(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One step with a decode, a chunk continuing a cached prefix and a fresh prefill, all at once."""
    cfg = tiny_config()
    model = LlamaForCausalLM(cfg, seed=3)
    bs = 8
    a, b, c = (torch.randint(0, cfg.vocab_size, (n,)) for n in (11, 20, 6))
    refs = [full_logits(model, x) for x in (a, b, c)]
    monkeypatch.setenv("FLASHPAGE_BACKEND", backend)
    dev, tol = backend_device(backend)
    model, a, b, c = model.to(dev), a.to(dev), b.to(dev), c.to(dev)
    caches = make_caches(cfg, 12, bs, dev)
    tables = [[0, 1], [4, 3, 9], [6]]
    with torch.no_grad():
        # Step 1: cache a[:10] and b[:9].
        meta, pos = step_meta([(0, 10), (0, 9)], tables[:2], bs, dev)
        model(torch.cat([a[:10], b[:9]]), pos, caches, meta)
        # Step 2: a decodes token 10, b prefills 9..19 on top of its cached prefix, c prefills whole.
        meta, pos = step_meta([(10, 1), (9, 11), (0, 6)], tables, bs, dev)
        out = model.compute_logits(model(torch.cat([a[10:], b[9:], c]), pos, caches, meta)).cpu()
    torch.testing.assert_close(out[0:1], refs[0][10:], rtol=tol, atol=tol / 10)
    torch.testing.assert_close(out[1:12], refs[1][9:], rtol=tol, atol=tol / 10)
    torch.testing.assert_close(out[12:], refs[2], rtol=tol, atol=tol / 10)


def test_apply_rope_equals_hf_rotate_half() -> None:
    cfg = tiny_config(rope_theta=500.0)
    cos, sin = rope_cos_sin(cfg)
    pos = torch.tensor([0, 3, 17, 63])
    x = torch.randn(4, 3, cfg.head_dim)
    c = torch.cat([cos[pos], cos[pos]], -1)[:, None]
    s = torch.cat([sin[pos], sin[pos]], -1)[:, None]
    half = cfg.head_dim // 2
    rotate_half = torch.cat([-x[..., half:], x[..., :half]], -1)
    torch.testing.assert_close(apply_rope(x, cos[pos], sin[pos]), x * c + rotate_half * s)
    torch.testing.assert_close(apply_rope(x, cos[:1].expand(4, -1), sin[:1].expand(4, -1)), x)  # position 0


def test_forward_validates_inputs() -> None:
    cfg = tiny_config()
    model = LlamaForCausalLM(cfg)
    meta, pos = step_meta([(0, 3)], [[0]], 4)
    ids = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="kv_caches"):
        model(ids, pos, make_caches(cfg, 1, 4)[:1], meta)
    with pytest.raises(ValueError, match="positions"):
        model(ids, pos[:2], make_caches(cfg, 1, 4), meta)
    bad = [(torch.zeros(1, 4, 3, cfg.head_dim), torch.zeros(1, 4, 3, cfg.head_dim))] * cfg.num_layers
    with pytest.raises(ValueError, match="kv_caches"):
        model(ids, pos, bad, meta)
    with pytest.raises(TypeError, match="dtype"):
        LlamaForCausalLM(cfg, dtype=torch.int32)


def test_load_weights_errors_and_round_trip() -> None:
    cfg = tiny_config()
    src, dst = LlamaForCausalLM(cfg, seed=4), LlamaForCausalLM(cfg, empty=True)
    weights = dict(src.hf_state_dict())
    dst.load_weights(weights.items())
    for (n1, p1), (n2, p2) in zip(src.named_parameters(), dst.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    with pytest.raises(ValueError, match="missing"):
        dst.load_weights([(k, v) for k, v in weights.items() if "up_proj" not in k])
    with pytest.raises(ValueError, match="unexpected"):
        dst.load_weights([*weights.items(), ("model.layers.0.mlp.extra.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        dst.load_weights([("model.norm.weight", torch.zeros(3))], strict=False)


def test_random_init_is_seeded_and_on_device() -> None:
    cfg = tiny_config()
    a, b, c = LlamaForCausalLM(cfg, seed=7), LlamaForCausalLM(cfg, seed=7), LlamaForCausalLM(cfg, seed=8)
    assert torch.equal(a.embed_tokens, b.embed_tokens) and not torch.equal(a.embed_tokens, c.embed_tokens)
    assert torch.all(a.norm.weight == 1)
    assert abs(float(a.layers[0].mlp.down_weight.std()) - 0.02) < 0.003
    half = LlamaForCausalLM(cfg, dtype=torch.bfloat16)
    assert half.embed_tokens.dtype == torch.bfloat16 and half.rope_cos.dtype == torch.float32
