"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Gemma 2/3) as a pure forward over a
token batch.

The model sees one engine step: the flattened new tokens of every sequence ``(T,)``, their positions
``(T,)``, the per-layer paged KV caches and the step's :class:`~flashpage.ops.metadata.AttentionMetadata`.
Each attention layer projects q/k/v, applies RoPE at the given positions and hands everything to
:func:`flashpage.ops.dispatch.attention`, which writes the new K/V into the cache and attends — the one
dispatch point between models and kernels. No state lives in the model between steps.

Numerics follow Hugging Face ``transformers`` (so greedy outputs match it): RMSNorm in float32 and cast
back before the weight multiply (Gemma: multiplied by ``1 + weight`` in float32, then cast), residual
adds in the model dtype, RoPE in the non-interleaved "rotate_half" convention with a float32 cos/sin
table cast to the activation dtype.

The architectures differ only in options of :class:`~flashpage.models.config.ModelConfig`, each
applied where transformers applies it: q/k RMSNorm per head before RoPE (Qwen3, Gemma 3), per-layer
sliding window and RoPE base (Gemma 2/3, mixed Qwen), attention-logit softcap and the
``query_pre_attn_scalar`` softmax scale (passed to the dispatch point per layer), GeGLU, Gemma's
sandwich norms, scaled embeddings and final-logit softcap.

Parameter layout (names differ from HF, see :meth:`LlamaForCausalLM.load_weights`):
Q/K/V are one fused ``qkv_proj`` ``(q_size + 2 kv_size, hidden)`` and gate/up one ``gate_up_proj``
``(2 intermediate, hidden)``, so each layer runs 4 GEMMs instead of 7.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashpage.models.config import ModelConfig
from flashpage.ops.backend import resolve_backend
from flashpage.ops.dispatch import attention
from flashpage.ops.fused_ops import rms_norm, rope_qk, silu_and_mul
from flashpage.ops.metadata import AttentionMetadata

__all__ = ["LlamaForCausalLM", "apply_rope", "rope_cos_sin", "rope_inv_freq"]


# ----------------------------------------------------------------------------------------------------------
# RoPE
# ----------------------------------------------------------------------------------------------------------


def rope_inv_freq(config: ModelConfig, device: torch.device | str | None = None) -> tuple[Tensor, float]:
    """Inverse frequencies ``(head_dim // 2,)`` float32 and the cos/sin scale (YaRN's attention factor).

    Mirrors ``transformers.modeling_rope_utils`` for the default, linear, llama3 and yarn types.
    """
    dim = config.head_dim
    base = config.rope_theta
    # Same expression as HF (int64 arange cast to float, then a float32 power).
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (base**exponents)
    rs = config.rope_scaling
    if rs is None:
        return inv_freq, 1.0
    kind = rs["rope_type"]
    if kind == "linear":
        return inv_freq / rs["factor"], 1.0
    if kind == "freq_factors":
        return inv_freq / torch.tensor(rs["factors"], dtype=torch.float32, device=device), 1.0
    if kind == "llama3":
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_ctx = rs["original_max_position_embeddings"]
        low_freq_wavelen, high_freq_wavelen = old_ctx / lo, old_ctx / hi
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(config, device)
    raise ValueError(f"rope_scaling: unsupported rope_type {kind!r}")  # config validation prevents this


def _yarn_inv_freq(config: ModelConfig, device: torch.device | str | None) -> tuple[Tensor, float]:
    """YaRN (arXiv 2309.00071) as in transformers 5: ramp between interpolated and extrapolated freqs."""
    rs = config.rope_scaling
    assert rs is not None
    dim, base, factor = config.head_dim, config.rope_theta, float(rs["factor"])
    orig = rs.get("original_max_position_embeddings") or config.max_position_embeddings

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp(
        (torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1
    )
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: keep the original (extrapolated) frequency
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def rope_cos_sin(config: ModelConfig, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """Float32 ``cos``/``sin`` tables ``(max_position_embeddings, head_dim // 2)`` (scaled for YaRN)."""
    inv_freq, scale = rope_inv_freq(config, device)
    t = torch.arange(config.max_position_embeddings, device=device, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)
    return freqs.cos() * scale, freqs.sin() * scale


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x (T, heads, d)`` by ``cos``/``sin`` ``(T, d // 2)`` (non-interleaved halves, HF convention).

    Equals HF's ``x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)`` element for element.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


# ----------------------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------------------


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str | None) -> nn.Parameter:
    """An uninitialised parameter: the loaders (or :meth:`LlamaForCausalLM.init_random_`) fill it."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, normalised in float32 (as HF does), over the last dim.

    With ``offset`` (Gemma: 1.0) the scale is ``offset + weight`` and the multiply happens in float32
    before the cast back, as Gemma's norm in transformers does; the fused kernel is Llama's form only.
    """

    def __init__(
        self,
        hidden: int,
        eps: float,
        dtype: torch.dtype,
        device: torch.device | str | None,
        offset: float = 0.0,
    ) -> None:
        super().__init__()
        self.weight = _param(hidden, dtype=dtype, device=device)
        self.eps = eps
        self.offset = offset

    def forward(self, x: Tensor, residual: Tensor | None = None, fused: bool = False) -> Any:
        """``x (..., hidden)`` -> same shape in x's dtype; with ``residual``, normalises
        ``h = residual + x`` and returns ``(norm(h), h)``. ``fused``: one Triton kernel (CUDA; Llama's
        form only, ``offset == 0``)."""
        if fused and self.offset == 0.0:
            if x.dim() == 2:
                return rms_norm(x, self.weight, self.eps, residual)
            if residual is None:  # per-head q/k norm: rows of head_dim (a copy when x is strided)
                return rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        if residual is not None:
            h = residual + x
            return self.forward(h), h
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


class LlamaAttention(nn.Module):
    """Fused QKV projection, optional per-head q/k RMSNorm, RoPE, paged attention through the dispatch
    point (with this layer's window, softcap and scale), output projection."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str | None, layer: int = 0
    ) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size, self.kv_size = c.q_size, c.kv_size
        self.softmax_scale = c.softmax_scale
        self.window_size = c.layer_window(layer)
        self.softcap = c.attn_logit_softcapping or 0.0
        # Gemma 3's sliding layers rotate with their own RoPE base (the model holds both tables).
        self.local_rope = c.rope_local_theta is not None and c.is_sliding_layer(layer)
        self.q_norm = self.k_norm = None
        if c.qk_norm:
            off = c.norm_weight_offset or 0.0
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, device, off)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, device, off)
        self.qkv_weight = _param(c.q_size + 2 * c.kv_size, c.hidden_size, dtype=dtype, device=device)
        self.qkv_bias = (
            _param(c.q_size + 2 * c.kv_size, dtype=dtype, device=device) if c.attention_bias else None
        )
        self.o_weight = _param(c.hidden_size, c.q_size, dtype=dtype, device=device)
        self.o_bias = _param(c.hidden_size, dtype=dtype, device=device) if c.attention_out_bias else None
        self.tp: Any = None  # a flashpage.distributed.tensor_parallel.TensorParallel once sharded

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        kv_cache: tuple[Tensor, Tensor],
        meta: AttentionMetadata,
        fused: bool = False,
    ) -> Tensor:
        """``x (T, hidden)``, ``cos``/``sin`` ``(T, head_dim // 2)`` -> ``(T, hidden)``."""
        t = x.shape[0]
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q, fused=fused), self.k_norm(k, fused=fused)
        if fused:
            q, k = rope_qk(q, k, cos, sin)
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.view(t, self.num_kv_heads, self.head_dim)  # strided view of qkv: the cache write copies it
        k_cache, v_cache = kv_cache
        o = attention(
            q, k, v, k_cache, v_cache, meta,
            softmax_scale=self.softmax_scale, window_size=self.window_size, softcap=self.softcap,
        )  # fmt: skip
        if self.tp is not None:  # row-parallel: one all-reduce of the partial products
            return self.tp.row_parallel_linear(o.reshape(t, self.q_size), self.o_weight, self.o_bias)
        return F.linear(o.reshape(t, self.q_size), self.o_weight, self.o_bias)


class LlamaMLP(nn.Module):
    """SwiGLU ``down(silu(gate(x)) * up(x))`` or GeGLU (``gelu_pytorch_tanh``, Gemma) with gate and up
    fused into one GEMM."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"
        self.gate_up_weight = _param(
            2 * config.intermediate_size, config.hidden_size, dtype=dtype, device=device
        )
        self.down_weight = _param(config.hidden_size, config.intermediate_size, dtype=dtype, device=device)
        self.tp: Any = None  # a flashpage.distributed.tensor_parallel.TensorParallel once sharded

    def forward(self, x: Tensor, fused: bool = False) -> Tensor:
        """``x (T, hidden)`` -> ``(T, hidden)``."""
        gate_up = F.linear(x, self.gate_up_weight)
        if fused and not self.gelu:
            act = silu_and_mul(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            act = (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up
        if self.tp is not None:  # row-parallel: one all-reduce of the partial products
            return self.tp.row_parallel_linear(act, self.down_weight)
        return F.linear(act, self.down_weight)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``; with
    ``sandwich_norm`` (Gemma) ``x + post_attention_norm(attn(norm(x)))`` then
    ``x + post_feedforward_norm(mlp(pre_feedforward_norm(x)))``.

    The names follow HF: ``post_attention_layernorm`` is the pre-MLP norm in Llama and the norm of the
    attention output in Gemma, whose pre-MLP norm is ``pre_feedforward_layernorm``.
    """

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str | None, layer: int = 0
    ) -> None:
        super().__init__()
        c = config
        off = c.norm_weight_offset or 0.0

        def norm() -> RMSNorm:
            return RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device, off)

        self.input_layernorm = norm()
        self.self_attn = LlamaAttention(config, dtype, device, layer)
        self.post_attention_layernorm = norm()
        self.mlp = LlamaMLP(config, dtype, device)
        self.sandwich = bool(c.sandwich_norm)
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def forward(
        self,
        x: Tensor,
        residual: Tensor | None,
        cos: Tensor,
        sin: Tensor,
        kv_cache: tuple[Tensor, Tensor],
        meta: AttentionMetadata,
        fused: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """``(x, residual)`` -> ``(mlp output, residual)``: the residual stream is ``residual + x``,
        added inside the next norm (one fused kernel on CUDA). ``residual=None`` for the first layer."""
        if residual is None:
            h, residual = self.input_layernorm(x, fused=fused), x
        else:
            h, residual = self.input_layernorm(x, residual, fused=fused)
        a = self.self_attn(h, cos, sin, kv_cache, meta, fused=fused)
        if self.sandwich:
            residual = residual + self.post_attention_layernorm(a)
            h = self.pre_feedforward_layernorm(residual)
            return self.post_feedforward_layernorm(self.mlp(h, fused=fused)), residual
        h, residual = self.post_attention_layernorm(a, residual, fused=fused)
        return self.mlp(h, fused=fused), residual


# ----------------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------------


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a flattened token batch with a paged KV cache.

    The constructor allocates every parameter on ``device`` in ``dtype`` (no CPU detour) and, unless
    ``empty=True``, fills them with random weights (``init_random_(0.02, seed)``). The loaders pass
    ``empty=True`` and then :meth:`load_weights`. Parameters have ``requires_grad=False`` (inference).

    Args:
        config: the model config.
        dtype: parameter and activation dtype (the RoPE table stays float32).
        device: where to allocate.
        empty: leave the weights uninitialised (they must be loaded before use).
        seed: seed of the random init.

    Attributes:
        fused_ops: ``None`` (default): the fused Triton RMSNorm / RoPE / SiLU kernels of
            :mod:`flashpage.ops.fused_ops` on CUDA with the Triton backend, PyTorch ops otherwise;
            ``True`` / ``False`` forces one path (tests run the fused one under the interpreter).
    """

    fused_ops: bool | None = None

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        *,
        empty: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config: must be a ModelConfig, got {type(config).__name__}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype: must be a floating torch.dtype, got {dtype!r}")
        self.config = config
        self.dtype = dtype
        c = config
        self.embed_tokens = _param(c.vocab_size, c.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(c, dtype, device, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device, c.norm_weight_offset or 0.0)
        self.lm_head = (
            None if c.tie_word_embeddings else _param(c.vocab_size, c.hidden_size, dtype=dtype, device=device)
        )
        # Gemma scales the embeddings by sqrt(hidden) rounded to the model dtype (HF casts the factor).
        self.embed_scale = (
            float(torch.tensor(c.hidden_size**0.5, dtype=dtype)) if c.scale_embeddings else None
        )
        self.final_softcap = c.final_logit_softcapping
        # Tensor parallelism (flashpage.distributed.tensor_parallel.shard_model_): this rank's shard of
        # the heads, MLP columns and vocabulary, and its collectives; None when unsharded.
        self.tp: Any = None
        self._set_rope_tables(c)
        if not empty:
            self.init_random_(0.02, seed)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @property
    def lm_head_weight(self) -> Tensor:
        """``(vocab, hidden)``: the embedding matrix when tied."""
        return self.embed_tokens if self.lm_head is None else self.lm_head

    @torch.no_grad()
    def init_random_(self, std: float = 0.02, seed: int = 0) -> None:
        """Fill weights and biases from ``N(0, std^2)`` and norm weights with 1, on their own device.

        One generator on the parameters' device, so an 8B model initialises in well under a second on GPU.
        """
        gen = torch.Generator(device=self.device).manual_seed(seed)
        unit = 1.0 - (self.config.norm_weight_offset or 0.0)  # norms start as the identity scale
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(unit)
            else:
                p.normal_(0.0, std, generator=gen)

    def _set_rope_tables(self, config: ModelConfig) -> None:
        """(Re)compute the float32 cos/sin tables: ``rope_cos``/``rope_sin`` of every layer, and
        ``rope_local_cos``/``rope_local_sin`` of the sliding layers when they have their own base."""
        cos, sin = rope_cos_sin(config, device=self.embed_tokens.device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if config.rope_local_theta is not None:
            local = config.replace(rope_theta=config.rope_local_theta, rope_scaling=None)
            cos, sin = rope_cos_sin(local, device=self.embed_tokens.device)
        self.register_buffer("rope_local_cos", cos, persistent=False)
        self.register_buffer("rope_local_sin", sin, persistent=False)

    def set_rope_config(self, config: ModelConfig) -> None:
        """Swap in a config that differs only in RoPE fields and recompute the cos/sin tables."""
        self.config = config
        self._set_rope_tables(config)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[tuple[Tensor, Tensor]],
        meta: AttentionMetadata,
    ) -> Tensor:
        """One step over the flattened new tokens of every sequence.

        Args:
            input_ids: ``(T,)`` int64 token ids.
            positions: ``(T,)`` int64 position of each token in its sequence (``< max_position_embeddings``).
            kv_caches: per layer ``(k_cache, v_cache)``, each ``(num_blocks, block_size, num_kv_heads,
                head_dim)``; this step's K/V are written at ``meta.slot_mapping``.
            meta: the step's attention metadata (shared by all layers).
        Returns:
            ``(T, hidden)`` hidden states after the final norm (feed the rows to sample to
            :meth:`compute_logits`).
        """
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids/positions: must both be (T,), got {tuple(input_ids.shape)} and {tuple(positions.shape)}"
            )
        if len(kv_caches) != len(self.layers):
            raise ValueError(
                f"kv_caches: need one (k, v) pair per layer ({len(self.layers)}), got {len(kv_caches)}"
            )
        # Derived per-step tensors memoised by the attention path live for one forward only (a captured
        # CUDA-graph step reuses its metadata object with new buffer contents).
        meta.begin_forward()
        c = self.config
        k0 = kv_caches[0][0]
        kv_heads = self.layers[0].self_attn.num_kv_heads if len(self.layers) else c.num_kv_heads
        if k0.dim() != 4 or k0.shape[2] != kv_heads or k0.shape[3] != c.head_dim:
            raise ValueError(
                f"kv_caches: expected (num_blocks, block_size, {kv_heads}, {c.head_dim}), got {tuple(k0.shape)}"
            )
        # Gathered and cast to the activation dtype once per step (as HF casts cos/sin), shared by all layers.
        cos, sin = self.rope_cos[positions].to(self.dtype), self.rope_sin[positions].to(self.dtype)
        local = (cos, sin)
        if c.rope_local_theta is not None:
            local = (
                self.rope_local_cos[positions].to(self.dtype),
                self.rope_local_sin[positions].to(self.dtype),
            )
        # Fused Triton element-wise kernels on CUDA with the Triton backend; PyTorch ops otherwise
        # (the CPU path stays op-for-op the Hugging Face formulation, for exact parity).
        fused = self.fused_ops
        if fused is None:
            fused = input_ids.is_cuda and resolve_backend(input_ids.device) == "triton"
        if self.tp is not None:  # vocab-parallel: masked lookup + one all-reduce
            h = self.tp.vocab_parallel_embedding(input_ids, self.embed_tokens, c.vocab_size)
        else:
            h = F.embedding(input_ids, self.embed_tokens)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        residual: Tensor | None = None
        for layer, kv in zip(self.layers, kv_caches):
            lc, ls = local if layer.self_attn.local_rope else (cos, sin)
            h, residual = layer(h, residual, lc, ls, kv, meta, fused=fused)
        if residual is None:  # no layers
            return self.norm(h, fused=fused)
        return self.norm(h, residual, fused=fused)[0]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """``(N, hidden)`` -> ``(N, vocab)`` float32 logits (softcapped in float32 when the config says so).

        Tensor-parallel: a collective; the full logits come back on rank 0, the other ranks get ``(0, vocab)``.
        """
        if self.tp is not None:
            logits = self.tp.vocab_parallel_logits(hidden, self.lm_head_weight, self.config.vocab_size)
        else:
            logits = F.linear(hidden, self.lm_head_weight).float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    # ------------------------------------------------------------------------------------------------------
    # Weights in Hugging Face names
    # ------------------------------------------------------------------------------------------------------

    def _hf_targets(self) -> dict[str, tuple[Tensor, int, int]]:
        """HF tensor name -> (our parameter, row start, row end) for every tensor a checkpoint holds."""
        c = self.config
        q, kv, i = c.q_size, c.kv_size, c.intermediate_size
        out: dict[str, tuple[Tensor, int, int]] = {
            "model.embed_tokens.weight": (self.embed_tokens, 0, c.vocab_size),
            "model.norm.weight": (self.norm.weight, 0, c.hidden_size),
        }
        if self.lm_head is not None:
            out["lm_head.weight"] = (self.lm_head, 0, c.vocab_size)
        for n, layer in enumerate(self.layers):
            p = f"model.layers.{n}."
            a, m = layer.self_attn, layer.mlp
            norms = ["input_layernorm", "post_attention_layernorm"]
            if layer.sandwich:
                norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
            for norm in norms:
                out[p + f"{norm}.weight"] = (getattr(layer, norm).weight, 0, c.hidden_size)
            if a.q_norm is not None and a.k_norm is not None:
                out[p + "self_attn.q_norm.weight"] = (a.q_norm.weight, 0, c.head_dim)
                out[p + "self_attn.k_norm.weight"] = (a.k_norm.weight, 0, c.head_dim)
            for suffix, t in (("weight", a.qkv_weight), ("bias", a.qkv_bias)):
                if t is not None:
                    out[p + f"self_attn.q_proj.{suffix}"] = (t, 0, q)
                    out[p + f"self_attn.k_proj.{suffix}"] = (t, q, q + kv)
                    out[p + f"self_attn.v_proj.{suffix}"] = (t, q + kv, q + 2 * kv)
            out[p + "self_attn.o_proj.weight"] = (a.o_weight, 0, c.hidden_size)
            if a.o_bias is not None:
                out[p + "self_attn.o_proj.bias"] = (a.o_bias, 0, c.hidden_size)
            out[p + "mlp.gate_proj.weight"] = (m.gate_up_weight, 0, i)
            out[p + "mlp.up_proj.weight"] = (m.gate_up_weight, i, 2 * i)
            out[p + "mlp.down_proj.weight"] = (m.down_weight, 0, c.hidden_size)
        return out

    def weight_slots(self) -> dict[str, Tensor]:
        """HF tensor name -> the view of our parameter it fills (for loaders that write in place)."""
        return {name: param[lo:hi] for name, (param, lo, hi) in self._hf_targets().items()}

    def hf_weight_names(self) -> list[str]:
        """Every Hugging Face tensor name this model needs (without the tied ``lm_head.weight``)."""
        return list(self._hf_targets())

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Tensor]], *, strict: bool = True) -> set[str]:
        """Copy tensors given in Hugging Face names into the fused parameters (cast to dtype, moved to device).

        Args:
            weights: ``(hf_name, tensor)`` pairs, e.g. from safetensors; ``rotary_emb.inv_freq`` and a tied
                ``lm_head.weight`` are skipped.
            strict: raise if a name is unknown or a needed tensor is missing.
        Returns:
            The HF names loaded.
        Raises:
            ValueError: unknown name, wrong shape, or (strict) missing tensors.
        """
        targets = self._hf_targets()
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.lm_head is None):
                continue
            if name not in targets:
                if strict:
                    raise ValueError(
                        f"weights: unexpected tensor {name!r} for a {self.config.architecture} model"
                    )
                continue
            param, lo, hi = targets[name]
            want = (hi - lo, *param.shape[1:])
            if tuple(tensor.shape) != want:
                raise ValueError(f"weights: {name!r} has shape {tuple(tensor.shape)}, expected {want}")
            param[lo:hi].copy_(tensor)
            loaded.add(name)
        if strict:
            missing = [n for n in targets if n not in loaded]
            if missing:
                more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
                raise ValueError(f"weights: missing tensors {missing[:5]}{more}")
        return loaded

    def hf_state_dict(self) -> Iterator[tuple[str, Tensor]]:
        """``(hf_name, tensor)`` views of the weights in Hugging Face layout (the inverse of :meth:`load_weights`)."""
        for name, (param, lo, hi) in self._hf_targets().items():
            yield name, param[lo:hi]
