r"""Analytic FLOP and byte counts of a decoder-only transformer, arithmetic intensity, and bounds.

Notation: ``b`` sequences, ``h`` query heads, ``hk`` KV heads (GQA group ``g = h / hk``), head dim
``d``, ``B`` bytes per element of the dtype (fp32 4, bf16/fp16 2, fp8 1; weights, activations and KV
are all taken in that dtype), ``H`` hidden, ``I`` intermediate, ``V`` vocab, ``L`` layers.
A multiply-add counts 2 FLOP. Bytes are the least traffic to device memory (each operand read once,
each result written once: the flash / ideal-cache assumption), so every time derived here is a
lower bound.

Attention (per layer, ``sq`` new query tokens per sequence over ``sk`` keys; causal, aligned
bottom-right, so the new tokens see a cached prefix of ``p = sk - sq`` tokens):

- visible (query, key) pairs per head: non-causal ``sq * sk``; causal ``sq * p + sq**2 / 2``
  (the FlashAttention benchmark convention: the causal triangle counts ``s**2 / 2``); a single query
  row (decode, ``sq == 1``) sees all ``sk`` keys.
- FLOPs ``= 4 * b * h * d * pairs`` (``Q K^T`` and ``P V``, 2 FLOP each per pair and dim).
- bytes ``= B * b * (2 * sq * h * d + 2 * sk * hk * d)`` (read Q, write O; read K and V once).

Which gives the three phases:

- prefill, ``s`` tokens, no prefix: FLOPs ``2 * 2 * b * h * d * s**2 / 2``;
  bytes ``B * b * 2 * s * d * (h + hk)``; intensity ``~ s * h / (B * (h + hk))`` grows with ``s``
  (Llama-3-8B bf16 at 4k: ~1640 FLOP/B, far above the H200 datasheet ridge of ~206).
- decode, one token over ``ctx`` cached tokens: FLOPs ``4 * b * h * d * ctx``; bytes
  ``B * b * (2 * ctx * hk * d + 2 * h * d)``; intensity ``-> 2 * g / B`` for long contexts, i.e.
  ``~ g`` FLOP/B in bf16: memory-bound on every GPU for the usual ``g <= 8``.
- chunked prefill, ``c`` new tokens after a cached prefix of ``p``: FLOPs
  ``4 * b * h * d * (c * p + c**2 / 2)``; bytes ``B * b * (2 * c * h * d + 2 * (p + c) * hk * d)``.

GEMMs (``m`` tokens times a ``k x n`` weight): FLOPs ``2 * m * k * n``, bytes ``B * (m*k + k*n + m*n)``.
Per layer: QKV ``k = H, n = (h + 2 hk) d``; O ``k = h d, n = H``; gate+up ``k = H, n = 2 I``;
down ``k = I, n = H``. Once per forward: lm_head ``k = H, n = V`` over the tokens that need logits
(the last token of each prefilled sequence, every decode token). Norms, RoPE, activations and
residual adds are left out (small, and often fused).

Roofline: ``intensity = FLOPs / bytes``; ``ridge = peak_flops(dtype) / bandwidth``; the op is
``"compute"``-bound when ``intensity >= ridge`` else ``"memory"``-bound; attainable FLOP/s
``= min(peak, intensity * bandwidth)``; least time ``= max(FLOPs / peak, bytes / bandwidth)``.

Workload bound (:func:`workload_bound`): the least time the roofline allows for a list of
``(input_len, output_len)`` requests at full batching. Prefill packs all prompt tokens, request
after request, into steps of at most ``max_batch_tokens`` tokens (a prompt cut across steps is
chunked prefill over its own prefix); decode step ``s = 0, 1, ...`` runs every request with
``output_len > s``, each attending to ``input_len + s`` cached tokens (the accounting of
``shared/bench/engine_bound.py``). Each step reads all weights once plus its activations and every
request's KV, and costs ``max(step FLOPs / peak, step bytes / bandwidth)``. Reference: the measured
bound of ``engine_bound.py`` on the H200 (real cuBLAS GEMM times, cuDNN attention rates) for 256
Llama-3-8B requests (inputs uniform[64, 1024], outputs uniform[32, 512], drawn with
``torch.Generator().manual_seed(0)``, inputs then outputs, by ``torch.randint``) is ~6.9 s
(prefill 2.6 s, decode 4.3 s); this analytic model gives ~4.9 s on the datasheet ``h200`` profile and ~6.1 s on
``h200-measured`` (see tests/roofline/test_workload.py): lower, as a pure roofline must be.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from flashpage.roofline.hardware import HardwareProfile, dtype_bytes
from flashpage.roofline.model_shapes import ModelShape

__all__ = [
    "OpCost",
    "WorkloadBound",
    "attention_chunked_prefill_cost",
    "attention_cost",
    "attention_decode_cost",
    "attention_prefill_cost",
    "bound",
    "layer_gemm_costs",
    "linear_cost",
    "lm_head_cost",
    "model_op_costs",
    "ridge",
    "workload_bound",
]


@dataclass(frozen=True)
class OpCost:
    """FLOPs and bytes of one call of an operation; ``count`` calls per forward (``layers`` for per-layer ops).

    ``detail`` describes the shape (``"b=8 q=4096 k=4096"``, ``"m=32768 k=4096 n=6144"``).
    """

    phase: str
    op: str
    flops: float
    bytes: float
    count: int = 1
    detail: str = ""

    @property
    def intensity(self) -> float:
        """FLOP per byte of memory traffic."""
        return self.flops / self.bytes

    def time_s(self, profile: HardwareProfile, dtype: Any) -> float:
        """Least seconds for one call: ``max(flops / peak, bytes / bandwidth)``."""
        return max(self.flops / profile.peak(dtype), self.bytes / profile.hbm_bandwidth)


def ridge(profile: HardwareProfile, dtype: Any = "bf16") -> float:
    """Ridge point ``peak_flops / bandwidth`` in FLOP/byte (H200 datasheet bf16: 989.4e12 / 4.8e12 = 206)."""
    return profile.ridge(dtype)


def bound(intensity: float, ridge_point: float) -> str:
    """``"compute"`` if ``intensity >= ridge_point`` else ``"memory"``."""
    return "compute" if intensity >= ridge_point else "memory"


def _check_pos(**kw: int) -> None:
    for k, v in kw.items():
        if int(v) != v or v < 1:
            raise ValueError(f"{k}: must be a positive int, got {v!r}")


def attention_cost(
    phase: str,
    *,
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    nheads: int,
    nheads_k: int,
    head_dim: int,
    dtype: Any = "bf16",
    causal: bool = True,
) -> OpCost:
    """One attention call over ``batch`` sequences of ``seqlen_q`` new queries and ``seqlen_k`` keys.

    Formulas in the module docstring. Raises ValueError naming a bad argument.
    """
    _check_pos(
        batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=nheads, nheads_k=nheads_k, head_dim=head_dim
    )
    if nheads % nheads_k:
        raise ValueError(f"nheads_k: nheads ({nheads}) must be divisible by nheads_k ({nheads_k})")
    if causal and seqlen_k < seqlen_q:
        raise ValueError(
            f"seqlen_k: causal attention needs seqlen_k >= seqlen_q, got {seqlen_k} < {seqlen_q}"
        )
    nb = dtype_bytes(dtype)
    if not causal:
        pairs = float(seqlen_q) * seqlen_k
    elif seqlen_q == 1:
        pairs = float(seqlen_k)
    else:
        pairs = float(seqlen_q) * (seqlen_k - seqlen_q) + seqlen_q * seqlen_q / 2.0
    flops = 4.0 * batch * nheads * head_dim * pairs
    nbytes = float(nb) * batch * (2 * seqlen_q * nheads * head_dim + 2 * seqlen_k * nheads_k * head_dim)
    detail = f"b={batch} q={seqlen_q} k={seqlen_k} h={nheads}/{nheads_k} d={head_dim}"
    return OpCost(phase, "attention", flops, nbytes, 1, detail)


def attention_prefill_cost(
    *,
    batch: int,
    seqlen: int,
    nheads: int,
    nheads_k: int,
    head_dim: int,
    dtype: Any = "bf16",
    causal: bool = True,
) -> OpCost:
    """Prefill attention of ``batch`` prompts of ``seqlen`` tokens (causal: ``4 b h d s^2 / 2`` FLOPs)."""
    return attention_cost(
        "prefill",
        batch=batch,
        seqlen_q=seqlen,
        seqlen_k=seqlen,
        nheads=nheads,
        nheads_k=nheads_k,
        head_dim=head_dim,
        dtype=dtype,
        causal=causal,
    )


def attention_decode_cost(
    *, batch: int, ctx: int, nheads: int, nheads_k: int, head_dim: int, dtype: Any = "bf16"
) -> OpCost:
    """Decode attention: one new token per sequence over ``ctx`` cached tokens (``4 b h d ctx`` FLOPs)."""
    return attention_cost(
        "decode",
        batch=batch,
        seqlen_q=1,
        seqlen_k=ctx,
        nheads=nheads,
        nheads_k=nheads_k,
        head_dim=head_dim,
        dtype=dtype,
    )


def attention_chunked_prefill_cost(
    *, batch: int, chunk: int, prefix: int, nheads: int, nheads_k: int, head_dim: int, dtype: Any = "bf16"
) -> OpCost:
    """Chunked prefill: ``chunk`` new tokens per sequence after a cached ``prefix`` (``prefix >= 0``)."""
    if int(prefix) != prefix or prefix < 0:
        raise ValueError(f"prefix: must be an int >= 0, got {prefix!r}")
    return attention_cost(
        "chunked_prefill",
        batch=batch,
        seqlen_q=chunk,
        seqlen_k=prefix + chunk,
        nheads=nheads,
        nheads_k=nheads_k,
        head_dim=head_dim,
        dtype=dtype,
    )


def linear_cost(
    phase: str,
    op: str,
    *,
    tokens: int,
    in_features: int,
    out_features: int,
    dtype: Any = "bf16",
    count: int = 1,
) -> OpCost:
    """``(tokens, in) @ (in, out)``: ``2 m k n`` FLOPs, ``B (m k + k n + m n)`` bytes."""
    _check_pos(tokens=tokens, in_features=in_features, out_features=out_features)
    nb = dtype_bytes(dtype)
    m, k, n = float(tokens), float(in_features), float(out_features)
    detail = f"m={tokens} k={in_features} n={out_features}"
    return OpCost(phase, op, 2.0 * m * k * n, nb * (m * k + k * n + m * n), count, detail)


def layer_gemm_costs(shape: ModelShape, phase: str, tokens: int, dtype: Any = "bf16") -> list[OpCost]:
    """The four per-layer GEMMs (qkv, o, gate_up, down) over ``tokens`` tokens, each ``count = layers``."""
    s, L = shape, shape.layers
    return [
        linear_cost(
            phase,
            "qkv",
            tokens=tokens,
            in_features=s.hidden,
            out_features=s.q_dim + 2 * s.kv_dim,
            dtype=dtype,
            count=L,
        ),
        linear_cost(
            phase, "o", tokens=tokens, in_features=s.q_dim, out_features=s.hidden, dtype=dtype, count=L
        ),
        linear_cost(
            phase,
            "gate_up",
            tokens=tokens,
            in_features=s.hidden,
            out_features=2 * s.intermediate,
            dtype=dtype,
            count=L,
        ),
        linear_cost(
            phase,
            "down",
            tokens=tokens,
            in_features=s.intermediate,
            out_features=s.hidden,
            dtype=dtype,
            count=L,
        ),
    ]


def lm_head_cost(shape: ModelShape, phase: str, tokens: int, dtype: Any = "bf16") -> OpCost:
    """lm_head over the ``tokens`` rows that need logits."""
    return linear_cost(
        phase, "lm_head", tokens=tokens, in_features=shape.hidden, out_features=shape.vocab, dtype=dtype
    )


def model_op_costs(
    shape: ModelShape, phase: str, *, batch: int, seqlen_q: int, seqlen_k: int, dtype: Any = "bf16"
) -> list[OpCost]:
    """Every op of one forward step of ``phase`` for ``batch`` sequences (attention first, lm_head last).

    ``seqlen_q`` new tokens per sequence over ``seqlen_k`` keys (prefill: equal; decode: ``seqlen_q = 1``).
    Logits are computed for the last token of each sequence only.
    """
    attn = attention_cost(
        phase,
        batch=batch,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        nheads=shape.heads,
        nheads_k=shape.kv_heads,
        head_dim=shape.head_dim,
        dtype=dtype,
    )
    attn = OpCost(attn.phase, attn.op, attn.flops, attn.bytes, shape.layers, attn.detail)
    return [
        attn,
        *layer_gemm_costs(shape, phase, batch * seqlen_q, dtype),
        lm_head_cost(shape, phase, batch, dtype),
    ]


# ---------------------------------------------------------------------------------------------------
# Workload bound
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadBound:
    """Least time the roofline allows for a request list (seconds) and the throughput it caps.

    ``useful_tokens_per_s = output_tokens / total_s`` is an upper bound on any engine's useful
    throughput for this workload on this hardware; a benchmark's fraction of it is
    :meth:`fraction_of_bound`.
    """

    prefill_s: float
    decode_s: float
    total_s: float
    useful_tokens_per_s: float
    prompt_tokens: int
    output_tokens: int
    prefill_steps: int
    decode_steps: int

    def fraction_of_bound(self, measured_tokens_per_s: float) -> float:
        """Measured useful tokens/s as a fraction of the bound (1.0 = at the physical limit)."""
        return measured_tokens_per_s / self.useful_tokens_per_s


def _validate_requests(requests: Iterable[Sequence[int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for i, r in enumerate(requests):
        if len(r) != 2:
            raise ValueError(f"requests[{i}]: expected (input_len, output_len), got {r!r}")
        a, b = int(r[0]), int(r[1])
        if a < 1 or b < 0 or a != r[0] or b != r[1]:
            raise ValueError(f"requests[{i}]: need input_len >= 1 and output_len >= 0 ints, got {r!r}")
        out.append((a, b))
    if not out:
        raise ValueError("requests: empty request list")
    return out


def workload_bound(
    shape: ModelShape,
    profile: HardwareProfile,
    requests: Iterable[Sequence[int]],
    dtype: Any = "bf16",
    max_batch_tokens: int = 8192,
) -> WorkloadBound:
    """The roofline lower bound on serving ``requests`` = ``[(input_len, output_len), ...]``.

    See the module docstring for the step model. Memory capacity is not checked (full batching is
    assumed to fit), so this is a bound on time, not a schedule.
    """
    reqs = _validate_requests(requests)
    _check_pos(max_batch_tokens=max_batch_tokens)
    nb = dtype_bytes(dtype)
    peak, bw = profile.peak(dtype), profile.hbm_bandwidth
    s, L = shape, shape.layers
    h, hk, d = s.heads, s.kv_heads, s.head_dim
    # Per token through all layers: GEMM FLOPs and activation bytes (inputs read + outputs written).
    gemm_flops_tok = 2.0 * L * s.layer_params
    act_elems_tok = L * (
        (s.hidden + s.q_dim + 2 * s.kv_dim)  # qkv in/out
        + (s.q_dim + s.hidden)  # o
        + (s.hidden + 2 * s.intermediate)  # gate_up
        + (s.intermediate + s.hidden)  # down
    )
    layer_weight_bytes = float(nb) * L * s.layer_params
    lm_weight_bytes = float(nb) * s.lm_head_params
    lm_flops_row = 2.0 * s.hidden * s.vocab
    lm_act_row = float(s.hidden + s.vocab)

    # ---- prefill: pack prompts into steps of <= max_batch_tokens tokens
    prefill_s = 0.0
    steps = 0
    tokens = 0
    attn_flops = attn_bytes = 0.0
    finished = 0

    def flush() -> float:
        f = gemm_flops_tok * tokens + lm_flops_row * finished + attn_flops
        by = layer_weight_bytes + nb * act_elems_tok * tokens + attn_bytes
        if finished:
            by += lm_weight_bytes + nb * lm_act_row * finished
        return max(f / peak, by / bw)

    for in_len, _ in reqs:
        done = 0
        while done < in_len:
            c = min(in_len - done, max_batch_tokens - tokens)
            # Attention of this piece: c new tokens over a prefix of `done` (pairs c*p + c^2/2), all layers.
            attn_flops += 4.0 * h * d * (c * done + c * c / 2.0) * L
            attn_bytes += float(nb) * (2 * c * h * d + 2 * (done + c) * hk * d) * L
            tokens += c
            done += c
            if done == in_len:
                finished += 1
            if tokens == max_batch_tokens:
                prefill_s += flush()
                steps += 1
                tokens, attn_flops, attn_bytes, finished = 0, 0.0, 0.0, 0
    if tokens:
        prefill_s += flush()
        steps += 1
    prefill_steps = steps

    # ---- decode: step s runs every request with out_len > s, over in_len + s cached tokens
    by_out = sorted(reqs, key=lambda r: r[1])
    outs = [r[1] for r in by_out]
    # suffix sums of input lengths in out-sorted order: active set at step s is by_out[first:], first = #out<=s
    suffix_in = [0] * (len(by_out) + 1)
    for i in range(len(by_out) - 1, -1, -1):
        suffix_in[i] = suffix_in[i + 1] + by_out[i][0]
    kv_tok_bytes = float(nb) * 2 * hk * d * L  # K and V of one cached token, all layers
    qo_bytes_row = float(nb) * 2 * h * d * L
    attn_flops_tok = 4.0 * h * d * L  # per (query, cached key) pair, all layers
    decode_s = 0.0
    dsteps = 0
    for step in range(max(outs)):
        first = bisect.bisect_right(outs, step)
        n = len(outs) - first
        ctx_sum = suffix_in[first] + n * step
        # Sub-steps when more requests are active than fit in one batch: weights are read once per
        # sub-step; KV and FLOPs split proportionally.
        nsub = -(-n // max_batch_tokens)
        f = (gemm_flops_tok + lm_flops_row) * n + attn_flops_tok * ctx_sum
        by = (
            nsub * (layer_weight_bytes + lm_weight_bytes)
            + nb * (act_elems_tok + lm_act_row) * n
            + kv_tok_bytes * ctx_sum
            + qo_bytes_row * n
        )
        decode_s += max(f / peak, by / bw)
        dsteps += nsub
    total = prefill_s + decode_s
    out_tokens = sum(outs)
    return WorkloadBound(
        prefill_s=prefill_s,
        decode_s=decode_s,
        total_s=total,
        useful_tokens_per_s=out_tokens / total if total > 0 else float("inf"),
        prompt_tokens=sum(r[0] for r in reqs),
        output_tokens=out_tokens,
        prefill_steps=prefill_steps,
        decode_steps=dsteps,
    )
