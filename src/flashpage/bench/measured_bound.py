"""The measured bound of an offline workload on the device it runs on (``bench throughput``'s yardstick).

The analytic bound (:func:`flashpage.roofline.intensity.workload_bound`) divides FLOPs and bytes by
the roofline's ceilings; this one times what the workload cannot avoid, on this GPU, in this run:

* every linear layer (qkv, o, gate+up, down per layer; the lm head once per sequence) as a plain
  ``F.linear`` (cuBLAS) over the workload's tokens: prompts in chunks of ``max_batch_tokens``, and each
  decode step at its exact active batch (the requests whose output is longer than the step index);
* attention at measured kernel rates: prefill FLOPs (causal, per request) at SDPA's causal TFLOP/s
  (cuDNN where it runs), decode KV reads (prompt + generated tokens of every active request) at
  SDPA's decode TB/s on a contiguous cache.

Anything an engine adds (scheduling, sampling, input building, kernel gaps) comes on top, so the
workload's output tokens over this time bound any engine's useful throughput here; an engine's
``frac_of_measured_bound`` is its tokens/s over that. The method is ``shared/bench/engine_bound.py``'s
made generic over the model shape; on CPU it runs at tiny sizes (wall-clock timer) for tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from flashpage.roofline.model_shapes import ModelShape

__all__ = ["MeasuredBound", "default_timer", "measure_workload_bound"]

Timer = Callable[[Callable[[], Any]], float]


def default_timer(device: torch.device) -> Timer:
    """Median milliseconds of a call (:func:`flashpage.bench.common.make_timer`): 10 ms warm-up and
    50 ms of repetitions on CUDA (the GEMMs are short and there are hundreds of batch sizes)."""
    from flashpage.bench.common import make_timer

    return make_timer(device, 10, 50)


@dataclass(frozen=True)
class MeasuredBound:
    """Least seconds of a workload from measured GEMM and attention rates.

    Attributes:
        prefill_s, decode_s, total_s: the bound's seconds (``total_s = prefill_s + decode_s``).
        useful_tokens_per_s: output tokens / ``total_s``.
        prefill_attn_tflops: the causal prefill attention rate used (measured here).
        decode_kv_tbps: the decode KV read rate used (measured here).
        decode_batches: distinct active batch sizes timed.
    """

    prefill_s: float
    decode_s: float
    total_s: float
    useful_tokens_per_s: float
    prefill_attn_tflops: float
    decode_kv_tbps: float
    decode_batches: int
    details: dict[str, Any] = field(default_factory=dict, compare=False)

    def fraction_of_bound(self, measured_tokens_per_s: float) -> float:
        """Measured useful tokens/s over the bound's (1.0 = as fast as the unavoidable work)."""
        return measured_tokens_per_s / self.useful_tokens_per_s

    def to_env(self) -> dict[str, Any]:
        """JSON-ready figures for a result's ``env["measured_bound"]``."""
        return {
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "total_s": self.total_s,
            "useful_tokens_per_s": self.useful_tokens_per_s,
            "prefill_attn_tflops": self.prefill_attn_tflops,
            "decode_kv_tbps": self.decode_kv_tbps,
            "decode_batches": self.decode_batches,
        }


class _Linears:
    """Random weights of one layer's linears and the lm head, and the timed calls over ``m`` tokens."""

    def __init__(self, shape: ModelShape, device: torch.device, dtype: torch.dtype, time_ms: Timer) -> None:
        h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim

        def w(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, device=device, dtype=dtype) * 0.02

        self.qkv, self.o = w(q + 2 * kv, h), w(h, q)
        self.gate_up, self.down = w(2 * shape.intermediate, h), w(h, shape.intermediate)
        self.lm = w(shape.vocab, h)
        self.shape, self.device, self.dtype, self.time_ms = shape, device, dtype, time_ms
        self._layer: dict[int, float] = {}
        self._lm: dict[int, float] = {}

    def _x(self, m: int, width: int) -> torch.Tensor:
        return torch.randn(m, width, device=self.device, dtype=self.dtype)

    def layer_ms(self, m: int) -> float:
        """Milliseconds of one layer's four linears over ``m`` tokens (memoised per ``m``)."""
        if m not in self._layer:
            s = self.shape
            x, a, hmid = self._x(m, s.hidden), self._x(m, s.heads * s.head_dim), self._x(m, s.intermediate)

            def f() -> None:
                F.linear(x, self.qkv)
                F.linear(a, self.o)
                F.linear(x, self.gate_up)
                F.linear(hmid, self.down)

            self._layer[m] = self.time_ms(f)
        return self._layer[m]

    def lm_ms(self, m: int) -> float:
        """Milliseconds of the lm head over ``m`` tokens (memoised per ``m``)."""
        if m not in self._lm:
            x = self._x(m, self.shape.hidden)
            self._lm[m] = self.time_ms(lambda: F.linear(x, self.lm))
        return self._lm[m]


def _sdpa_best(fn: Callable[[], Any], time_ms: Timer) -> float:
    """Milliseconds of ``fn`` under cuDNN SDPA on CUDA (flash if cuDNN cannot run it); plain SDPA on CPU."""
    if not torch.cuda.is_available():
        return time_ms(fn)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for be in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
        if not hasattr(SDPBackend, be):
            continue
        try:
            with sdpa_kernel(getattr(SDPBackend, be)):
                fn()
                return time_ms(fn)
        except RuntimeError:
            continue
    return time_ms(fn)


def attention_rates(
    shape: ModelShape, device: torch.device, dtype: torch.dtype, time_ms: Timer, tiny: bool = False
) -> tuple[float, float]:
    """``(prefill causal attention TFLOP/s, decode KV read TB/s)`` measured with SDPA on this device,
    at the model's head geometry: prefill 8 x 2048 tokens causal, decode 64 sequences x 4096 cached
    tokens (``tiny``: 2 x 64 and 2 x 64, for CPU tests)."""
    nh, nkv, d = shape.heads, shape.kv_heads, shape.head_dim
    b, s = (2, 64) if tiny else (8, 2048)
    q = torch.randn(b, nh, s, d, device=device, dtype=dtype)
    k, v = torch.randn_like(q), torch.randn_like(q)
    ms = _sdpa_best(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), time_ms)
    prefill_tflops = 4 * b * nh * s * s * d / 2 / ms / 1e9
    bd, ctx = (2, 64) if tiny else (64, 4096)
    qd = torch.randn(bd, nh, 1, d, device=device, dtype=dtype)
    kd = torch.randn(bd, nkv, ctx, d, device=device, dtype=dtype)
    vd = torch.randn_like(kd)
    gqa = {"enable_gqa": True} if nh != nkv else {}
    ms = _sdpa_best(lambda: F.scaled_dot_product_attention(qd, kd, vd, **gqa), time_ms)
    decode_tbps = 2 * kd.numel() * kd.element_size() / ms / 1e9
    return prefill_tflops, decode_tbps


def measure_workload_bound(
    shape: ModelShape,
    input_lens: Sequence[int],
    output_lens: Sequence[int],
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    max_batch_tokens: int = 8192,
    time_ms: Timer | None = None,
    tiny_attention: bool = False,
) -> MeasuredBound:
    """The measured bound of the requests ``(input_lens[i], output_lens[i])`` (see the module doc).

        Prefill: the prompt tokens through every layer's linears in chunks of ``max_batch_tokens`` (the
        engine's default step budget), the lm head over one token per request, causal attention per
        request at the measured prefill rate. Decode step ``s`` (0-based): the requests with
        ``output_lens[i] > s`` run every linear and the lm head at that exact batch, and read their KV
        (``input_lens[i] + s`` tokens, all layers) at the measured decode rate. The first output token
        comes from prefill's lm head, so there are ``max(output_lens) - 1`` decode steps (the shared
    script ran ``max(output_lens)``, counting each request's first token twice).

        Raises:
            ValueError: naming the argument (length mismatch, empty, non-positive lengths).
    """
    if len(input_lens) != len(output_lens):
        raise ValueError(f"output_lens: {len(output_lens)} lengths for {len(input_lens)} inputs")
    if not input_lens:
        raise ValueError("input_lens: empty workload")
    if min(input_lens) < 1 or min(output_lens) < 1:
        raise ValueError("input_lens/output_lens: every length must be >= 1")
    if max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens: must be >= 1, got {max_batch_tokens}")
    dev = torch.device(device)
    timer = time_ms or default_timer(dev)
    t0 = time.perf_counter()
    with torch.inference_mode():
        lin = _Linears(shape, dev, dtype, timer)
        prefill_tflops, decode_tbps = attention_rates(shape, dev, dtype, timer, tiny=tiny_attention)
        layers, nh, nkv, d = shape.layers, shape.heads, shape.kv_heads, shape.head_dim
        prompt = sum(input_lens)
        full, rest = divmod(prompt, max_batch_tokens)
        lin_ms = full * layers * lin.layer_ms(max_batch_tokens) + (
            layers * lin.layer_ms(rest) if rest else 0.0
        )
        attn_flops = layers * sum(4 * nh * d * n * n / 2 for n in input_lens)
        prefill_ms = lin_ms + attn_flops / prefill_tflops / 1e9 + lin.lm_ms(len(input_lens))
        kv_token_bytes = 2 * layers * nkv * d * torch.empty((), dtype=dtype).element_size()
        decode_ms = 0.0
        batches: set[int] = set()
        order = sorted(range(len(output_lens)), key=lambda i: output_lens[i])
        active = list(order)
        for s in range(1, max(output_lens)):
            while active and output_lens[active[0]] <= s:
                active.pop(0)
            m = len(active)
            batches.add(m)
            kv = sum(input_lens[i] + s for i in active) * kv_token_bytes
            decode_ms += layers * lin.layer_ms(m) + lin.lm_ms(m) + kv / decode_tbps / 1e9
    total = (prefill_ms + decode_ms) / 1e3
    return MeasuredBound(
        prefill_s=prefill_ms / 1e3,
        decode_s=decode_ms / 1e3,
        total_s=total,
        useful_tokens_per_s=sum(output_lens) / total,
        prefill_attn_tflops=prefill_tflops,
        decode_kv_tbps=decode_tbps,
        decode_batches=len(batches),
        details={"measure_s": time.perf_counter() - t0, "max_batch_tokens": max_batch_tokens},
    )
