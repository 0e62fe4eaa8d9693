"""Public FlashAttention API, drop-in for flash-attn 2.x: ``flash_attn_func``, ``flash_attn_varlen_func``
and the packed variants ``flash_attn_(varlen_)qkvpacked_func`` / ``flash_attn_(varlen_)kvpacked_func``.

Head dims 8-256 (the kernels pad the head-dim block to a power of two, at least 32, and mask the
padding). Argument errors are :class:`~flashpage.ops.flash_args.FlashAttnError` (a ``RuntimeError``,
as flash-attn raises, and a ``ValueError``) naming the argument; ``window_size`` is any pair of ints,
a 2-element tensor included.

Backends (``FLASHPAGE_BACKEND``, read at every call via :func:`flashpage.ops.backend.resolve_backend`):

* ``triton`` — the kernels of :mod:`flashpage.ops.flash_fwd` / :mod:`flashpage.ops.flash_bwd`, wrapped
  in the custom ops ``flashpage::flash_attn_forward`` / ``flashpage::flash_attn_backward``
  (``torch.library.custom_op`` with fake implementations and ``register_autograd``), so they are
  differentiable and trace under ``torch.compile`` as opaque nodes.
* ``torch`` — :mod:`flashpage.ops.reference` in float32 (``upcast=True``), cast back to the input
  dtype; autograd comes from PyTorch.
* ``auto`` (default) — ``triton`` for CUDA tensors, ``torch`` otherwise.

Dropout: the Triton path draws a 62-bit philox seed from torch's default (CPU) generator at every
forward (no device sync), so results are reproducible under ``torch.manual_seed``; the seed is saved
for the backward. The torch path draws a boolean keep mask with ``torch.rand`` on the inputs' device.

``return_attn_probs=True`` returns ``(out, softmax_lse, S_dmask)``: ``softmax_lse`` float32 natural log
(``(batch, nheads, seqlen_q)``, varlen ``(nheads, total_q)``), ``S_dmask`` float32
``(batch, nheads, seqlen_q, seqlen_k)`` (varlen: ``max_seqlen_q/k``, zero padded) holding the softmax
probabilities, with the dropout pattern in the sign as in flash-attn (``torch.signbit`` set = dropped).
It is materialised by a separate kernel and is meant for tests at small sizes.

``flash_attn_varlen_func(..., block_table=...)`` (flash-attn >= 2.6) attends packed queries over a
paged KV cache with the paged prefill kernel (:mod:`flashpage.ops.paged_prefill`; custom op
``flashpage::paged_varlen_attention`` under ``torch.compile``), forward only: as in flash-attn it runs
on inputs that require grad and a backward through its output raises.

``flash_attn_varlen_fwd`` is the engine's no-autograd prefill entry (``(out, lse)``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from flashpage.ops.backend import resolve_backend
from flashpage.ops.flash_args import FlashAttnError, flash_attn_errors, window_pair
from flashpage.ops.flash_bwd import flash_bwd
from flashpage.ops.flash_fwd import AttnProblem, attention_probs, check_attention_inputs, flash_fwd
from flashpage.ops.paged_launch import check_paged_cache, check_paged_values
from flashpage.ops.paged_prefill import _check_cu_values as check_cu_values
from flashpage.ops.paged_prefill import check_cu_seqlens, kv_attention_config, paged_prefill
from flashpage.ops.reference import attention_ref, gather_paged_kv, varlen_attention_ref

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_fwd",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
]

_SEED_HIGH = 1 << 62


def _draw_seed() -> int:
    """A philox seed from torch's default CPU generator (follows ``torch.manual_seed``; no GPU sync)."""
    return int(torch.randint(0, _SEED_HIGH, (1,), dtype=torch.int64).item())


# ----------------------------------------------------------------------------------------------
# Custom ops (Triton backend)
# ----------------------------------------------------------------------------------------------
def _forward_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor | None,
    cu_seqlens_k: Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Tensor | None,
    deterministic: bool,
    return_probs: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns ``(out, lse, rng_state, probs)``; ``rng_state`` is a CPU int64 ``(1,)`` seed,
    ``probs`` is empty unless ``return_probs``. ``deterministic`` only matters to the backward."""
    rest = (
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
        window_left, window_right, softcap, alibi_slopes, deterministic, return_probs,
    )  # fmt: skip
    out, lse, seed, probs = _forward_core(None, q, k, v, rest)
    return out, lse, torch.tensor([seed], dtype=torch.int64), probs


# The op's arguments after q, k, v as one tuple: what the eager autograd Function carries.
_Rest = tuple[
    Tensor | None, Tensor | None, int, int, float, float, bool, int, int, float, Tensor | None, bool, bool
]


def _forward_core(
    prob: AttnProblem | None, q: Tensor, k: Tensor, v: Tensor, rest: _Rest
) -> tuple[Tensor, Tensor, int, Tensor]:
    """``(out, lse, dropout seed, probs)`` (probs empty unless ``return_probs``). ``rest``: the
    op's arguments after ``q, k, v``; ``prob``: their validated problem when the caller has it
    (else :func:`flash_fwd` checks them again)."""
    cu_q, cu_k, max_sq, max_sk, dropout_p, scale, causal, wl, wr, softcap, alibi, _det, return_probs = rest
    varlen = cu_q is not None
    seed = _draw_seed() if dropout_p > 0 else 0
    kw = {
        "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k,
        "max_seqlen_q": max_sq if varlen else None, "max_seqlen_k": max_sk if varlen else None,
        "softmax_scale": scale, "causal": causal, "window_size": (wl, wr), "softcap": softcap,
        "alibi_slopes": alibi, "dropout_p": dropout_p,
    }  # fmt: skip
    out, lse = flash_fwd(q, k, v, seed=seed, validate=False, problem=prob, **kw)  # type: ignore[arg-type]
    if not return_probs:
        return out, lse, seed, q.new_empty((0,), dtype=torch.float32)
    if prob is None:
        prob = check_attention_inputs(q, k, v, validate=False, **kw)  # type: ignore[arg-type]
    probs = attention_probs(
        q, k, lse, prob, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, alibi_slopes=alibi, seed=seed
    )
    return out, lse, seed, probs


_flash_attn_forward = torch.library.custom_op("flashpage::flash_attn_forward", _forward_impl, mutates_args=())


@_flash_attn_forward.register_fake
def _flash_attn_forward_fake(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool,
    window_left: int, window_right: int, softcap: float, alibi_slopes: Tensor | None,
    deterministic: bool, return_probs: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    if cu_seqlens_q is not None:
        h, batch, sq, sk = q.shape[1], cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k
        lse = q.new_empty((h, q.shape[0]), dtype=torch.float32)
    else:
        batch, sq, h, sk = q.shape[0], q.shape[1], q.shape[2], k.shape[1]
        lse = q.new_empty((batch, h, sq), dtype=torch.float32)
    shape = (batch, h, sq, sk) if return_probs else (0,)
    probs = q.new_empty(shape, dtype=torch.float32)
    return q.new_empty(q.shape), lse, torch.empty((1,), dtype=torch.int64, device="cpu"), probs


def _backward_impl(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    rng_state: Tensor,
    cu_seqlens_q: Tensor | None,
    cu_seqlens_k: Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Tensor | None,
    deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of :func:`_flash_attn_forward`."""
    rest = (
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
        window_left, window_right, softcap, alibi_slopes, deterministic, False,
    )  # fmt: skip
    return _backward_core(None, dout, q, k, v, out, lse, int(rng_state[0].item()), rest)


def _backward_core(
    prob: AttnProblem | None,
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, seed: int, rest: _Rest,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``(dq, dk, dv)``; ``rest``: the forward op's arguments after ``q, k, v``; ``prob``: their
    validated problem when the caller has it."""
    cu_q, cu_k, max_sq, max_sk, dropout_p, scale, causal, wl, wr, softcap, alibi, det, _probs = rest
    varlen = cu_q is not None
    return flash_bwd(
        dout, q, k, v, out, lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        max_seqlen_q=max_sq if varlen else None, max_seqlen_k=max_sk if varlen else None,
        softmax_scale=scale, causal=causal, window_size=(wl, wr), softcap=softcap, alibi_slopes=alibi,
        dropout_p=dropout_p, seed=seed, deterministic=det, validate=False, problem=prob,
    )  # fmt: skip


_flash_attn_backward = torch.library.custom_op(
    "flashpage::flash_attn_backward", _backward_impl, mutates_args=()
)


@_flash_attn_backward.register_fake
def _flash_attn_backward_fake(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, rng_state: Tensor,
    cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None, max_seqlen_q: int, max_seqlen_k: int,
    dropout_p: float, softmax_scale: float, causal: bool, window_left: int, window_right: int,
    softcap: float, alibi_slopes: Tensor | None, deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    q, k, v, cu_q, cu_k, max_sq, max_sk, p, scale, causal, wl, wr, cap, alibi, det, _probs = inputs
    out, lse, rng, _ = output
    ctx.save_for_backward(q, k, v, out, lse, rng, cu_q, cu_k, alibi)  # type: ignore[attr-defined]
    ctx.args = (max_sq, max_sk, p, scale, causal, wl, wr, cap, det)  # type: ignore[attr-defined]


def _backward(ctx: torch.autograd.function.FunctionCtx, dout: Tensor, *_unused: Tensor) -> tuple:
    """Gradients of every forward input (``None`` for the non-tensor ones) from what
    :func:`_setup_context` saved (:func:`flash_bwd` copies a ``dout`` without a unit last-dim
    stride itself)."""
    q, k, v, out, lse, rng, cu_q, cu_k, alibi = ctx.saved_tensors  # type: ignore[attr-defined]
    max_sq, max_sk, p, scale, causal, wl, wr, cap, det = ctx.args  # type: ignore[attr-defined]
    dq, dk, dv = _flash_attn_backward(
        dout, q, k, v, out, lse, rng, cu_q, cu_k, max_sq, max_sk, p, scale, causal, wl, wr, cap, alibi, det
    )
    return (dq, dk, dv) + (None,) * 13


torch.library.register_autograd("flashpage::flash_attn_forward", _backward, setup_context=_setup_context)


class _FlashAttnFunction(torch.autograd.Function):
    """Eager autograd of the same forward/backward implementations as the custom ops.

    The custom-op dispatch costs ~100 us of Python per call (argument normalisation), which is the
    whole kernel time of a 1k-token causal forward; eager calls therefore take this path and only
    ``torch.compile`` traces the custom ops. ``apply`` gets five arguments (``q, k, v``, the other
    13 forward arguments as one tuple, the validated problem): its per-argument bookkeeping cost
    about 20 us per call with all 16 (CPU measurement).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        rest: _Rest,
        prob: AttnProblem,
    ) -> tuple[Tensor, Tensor, Tensor]:
        out, lse, seed, probs = _forward_core(prob, q, k, v, rest)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.rest, ctx.seed, ctx.prob = rest, seed, prob  # type: ignore[attr-defined]
        ctx.mark_non_differentiable(lse, probs)
        return out, lse, probs

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dout: Tensor, *_unused: Tensor) -> tuple:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors  # type: ignore[attr-defined]
        dq, dk, dv = _backward_core(ctx.prob, dout, q, k, v, out, lse, ctx.seed, ctx.rest)  # type: ignore[attr-defined]
        return dq, dk, dv, None, None


def _triton_forward(prob: AttnProblem, *args: object) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, lse, probs)`` of the Triton forward with autograd: the custom op under
    ``torch.compile``, else the eager Function (or the bare implementation when nothing needs a
    gradient). ``args`` are the custom op's; ``prob`` is their validated problem."""
    if torch.compiler.is_compiling():
        out, lse, _rng, probs = _flash_attn_forward(*args)
        return out, lse, probs
    q, k, v = args[0], args[1], args[2]
    needs_grad = torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in (q, k, v))
    if needs_grad:
        return _FlashAttnFunction.apply(q, k, v, args[3:], prob)  # type: ignore[no-any-return]
    out, lse, _seed, probs = _forward_core(prob, q, k, v, args[3:])  # type: ignore[arg-type]
    return out, lse, probs


# ----------------------------------------------------------------------------------------------
# Torch (reference) backend
# ----------------------------------------------------------------------------------------------
def _sign_encoded(probs: Tensor, keep: Tensor | None) -> Tensor:
    return probs if keep is None else torch.where(keep, probs, -probs)


def _torch_attn(
    q: Tensor, k: Tensor, v: Tensor, dropout_p: float, scale: float, causal: bool,
    window_size: tuple[int, int], softcap: float, alibi_slopes: Tensor | None, want_probs: bool = True,
) -> tuple[Tensor, Tensor, Tensor | None]:  # fmt: skip
    """One padded batch through the float32 reference: (out in q.dtype, lse, S_dmask or None)."""
    b, sq, h, _ = q.shape
    sk = k.shape[1]
    keep = torch.rand(b, h, sq, sk, device=q.device) >= dropout_p if dropout_p > 0 else None
    kw = {"softmax_scale": scale, "causal": causal, "window_size": window_size, "softcap": softcap,
          "alibi_slopes": alibi_slopes}  # fmt: skip
    out, lse = attention_ref(q, k, v, dropout_p=dropout_p, dropout_mask=keep, **kw)[:2]  # type: ignore[arg-type]
    if not want_probs:
        return out.to(q.dtype), lse, None
    with torch.no_grad():
        probs = attention_ref(q.detach(), k.detach(), v.detach(), return_probs=True, **kw)[2]  # type: ignore[arg-type]
    return out.to(q.dtype), lse, _sign_encoded(probs, keep)


def _torch_varlen(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_sq: int, max_sk: int,
    dropout_p: float, scale: float, causal: bool, window_size: tuple[int, int], softcap: float,
    alibi_slopes: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Varlen through the reference, one sequence at a time (differentiable)."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    batch, h = len(cq) - 1, q.shape[1]
    lse = torch.full((h, q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    probs = torch.zeros(batch, h, max_sq, max_sk, dtype=torch.float32, device=q.device)
    pieces: list[Tensor] = []
    for i in range(batch):
        n_q, n_k = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        if n_q == 0:
            continue
        qi, ki, vi = q[cq[i] : cq[i + 1]], k[ck[i] : ck[i + 1]], v[ck[i] : ck[i + 1]]
        a = alibi_slopes[i] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        o_i, l_i, p_i = _torch_attn(
            qi.unsqueeze(0),
            ki.unsqueeze(0),
            vi.unsqueeze(0),
            dropout_p,
            scale,
            causal,
            window_size,
            softcap,
            a,
        )
        pieces.append(o_i[0])
        lse[:, cq[i] : cq[i + 1]] = l_i[0]
        probs[i, :, :n_q, :n_k] = p_i[0]  # type: ignore[index]
    pieces.append(q.new_zeros((q.shape[0] - cq[-1], *q.shape[1:])))  # packed padding rows
    return torch.cat(pieces, dim=0), lse, probs


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def _scale(q: Tensor, softmax_scale: float | None) -> float:
    return float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])


@flash_attn_errors
def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """flash-attn 2.x ``flash_attn_func``: differentiable attention on padded batches.

    Args:
        q: ``(batch, seqlen_q, nheads, d)``; k, v: ``(batch, seqlen_k, nheads_k, d)``, nheads % nheads_k == 0.
        dropout_p: dropout probability (kept entries scaled by ``1/(1-p)``).
        softmax_scale: default ``d ** -0.5``.
        causal, window_size: bottom-right aligned causal mask / sliding window ``(left, right)``, -1 = unbounded.
        softcap: ``scores = softcap * tanh(scores / softcap)`` before masking (0 = off).
        alibi_slopes: ``(nheads,)`` or ``(batch, nheads)`` float32.
        deterministic: bit-identical gradients run to run (no atomics in the backward).
        return_attn_probs: also return ``softmax_lse`` and ``S_dmask`` (see the module doc).

    Returns:
        ``out (batch, seqlen_q, nheads, d)``, or ``(out, softmax_lse, S_dmask)``.

    Raises:
        FlashAttnError: a bad argument (a ``RuntimeError`` and a ``ValueError``, naming it).
    """
    window_size = window_pair(window_size)
    backend = resolve_backend(q.device if isinstance(q, Tensor) else None)
    validate = not torch.compiler.is_compiling()
    prob = check_attention_inputs(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, dropout_p=dropout_p, validate=validate, kernel_device=backend == "triton",
    )  # fmt: skip
    scale = _scale(q, softmax_scale)
    if backend == "torch":
        out, lse, probs = _torch_attn(  # type: ignore[assignment]
            q, k, v, dropout_p, scale, causal, tuple(window_size), softcap, alibi_slopes, return_attn_probs
        )
    else:
        out, lse, probs = _triton_forward(
            prob, q, k, v, None, None, 0, 0, float(dropout_p), scale, bool(causal), int(window_size[0]),
            int(window_size[1]), float(softcap), alibi_slopes, bool(deterministic), bool(return_attn_probs),
        )  # fmt: skip
    return (out, lse, probs) if return_attn_probs else out


@flash_attn_errors
def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """flash-attn 2.x ``flash_attn_varlen_func`` on packed sequences (differentiable).

    Args:
        q: ``(total_q, nheads, d)``; k, v: ``(total_k, nheads_k, d)``.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)`` prefix sums of the sequence lengths.
        max_seqlen_q, max_seqlen_k: the longest query / key sequence.
        block_table: ``(batch, max_blocks_per_seq)`` int32 for a paged KV cache (flash-attn >= 2.6):
            ``k``/``v`` are then the caches ``(num_blocks, block_size, nheads_k, d)`` (any power-of-two
            block size 8-256, q's dtype or fp8 e4m3 read with unit scales), ``cu_seqlens_k`` the
            prefix sums of each sequence's keys in the cache, whose queries are its last ones
            (bottom-right alignment, as chunked prefill over a cached prefix needs). Forward only,
            as flash-attn: inputs may require grad, but a backward through ``out`` raises; no
            dropout.
        Other arguments: as :func:`flash_attn_func`; a ``(batch, nheads)`` alibi is per sequence.

    Returns:
        ``out (total_q, nheads, d)``, or ``(out, softmax_lse (nheads, total_q), S_dmask)``.

    Raises:
        FlashAttnError: a bad argument (a ``RuntimeError`` and a ``ValueError``, naming it); with
            ``block_table``, also raised by a backward through ``out``.
    """
    window_size = window_pair(window_size)
    if block_table is not None:
        return _paged_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
            causal, window_size, softcap, alibi_slopes, return_attn_probs,
        )  # fmt: skip
    backend = resolve_backend(q.device if isinstance(q, Tensor) else None)
    validate = not torch.compiler.is_compiling()
    max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
    prob = check_attention_inputs(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, validate=validate,
        kernel_device=backend == "triton",
    )  # fmt: skip
    scale = _scale(q, softmax_scale)
    if backend == "torch":
        out, lse, probs = _torch_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, scale, causal,
            tuple(window_size), softcap, alibi_slopes,
        )  # fmt: skip
    else:
        out, lse, probs = _triton_forward(
            prob, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, float(dropout_p), scale,
            bool(causal), int(window_size[0]), int(window_size[1]), float(softcap), alibi_slopes,
            bool(deterministic), bool(return_attn_probs),
        )  # fmt: skip
    return (out, lse, probs) if return_attn_probs else out


# ----------------------------------------------------------------------------------------------
# Packed variants (flash-attn 2.x): views into the packed tensor, so gradients flow back into it.
# ----------------------------------------------------------------------------------------------
def _unpack(name: str, x: Tensor, n: int, dim: int) -> tuple[Tensor, ...]:
    """The ``n`` tensors stacked on ``dim`` of a packed ``x``, as views."""
    want = 5 if dim == 2 else 4
    if not isinstance(x, Tensor) or x.dim() != want or x.shape[dim] != n:
        layout = "(batch, seqlen" if dim == 2 else "(total"
        raise FlashAttnError(
            f"{name}: must be {layout}, {n}, nheads, d), got {tuple(getattr(x, 'shape', ())) or type(x).__name__}"
        )
    return x.unbind(dim)


@flash_attn_errors
def flash_attn_qkvpacked_func(
    qkv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """flash-attn 2.x ``flash_attn_qkvpacked_func``: :func:`flash_attn_func` on ``qkv (batch,
    seqlen, 3, nheads, d)``; the gradient is ``dqkv`` of the same shape."""
    q, k, v = _unpack("qkv", qkv, 3, 2)
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs,
    )  # fmt: skip


@flash_attn_errors
def flash_attn_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """flash-attn 2.x ``flash_attn_kvpacked_func``: :func:`flash_attn_func` with ``q (batch,
    seqlen_q, nheads, d)`` and ``kv (batch, seqlen_k, 2, nheads_k, d)`` (GQA/MQA as unpacked)."""
    k, v = _unpack("kv", kv, 2, 2)
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs,
    )  # fmt: skip


@flash_attn_errors
def flash_attn_varlen_qkvpacked_func(
    qkv: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """flash-attn 2.x ``flash_attn_varlen_qkvpacked_func``: :func:`flash_attn_varlen_func` on
    ``qkv (total, 3, nheads, d)`` with one ``cu_seqlens`` / ``max_seqlen`` for queries and keys."""
    q, k, v = _unpack("qkv", qkv, 3, 1)
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
    )  # fmt: skip


@flash_attn_errors
def flash_attn_varlen_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """flash-attn 2.x ``flash_attn_varlen_kvpacked_func``: :func:`flash_attn_varlen_func` with
    ``q (total_q, nheads, d)`` and ``kv (total_k, 2, nheads_k, d)``."""
    k, v = _unpack("kv", kv, 2, 1)
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
    )  # fmt: skip


def _paged_varlen(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, block_table: Tensor,
    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float | None, causal: bool,
    window_size: tuple[int, int], softcap: float, alibi_slopes: Tensor | None, return_attn_probs: bool,
) -> Tensor | tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """:func:`flash_attn_varlen_func` over a paged cache: the paged prefill kernel (Triton backend) or
    the reference over the gathered keys (torch backend)."""
    if dropout_p:
        raise ValueError(
            f"dropout_p={dropout_p}: dropout is not supported with a paged KV cache (block_table)"
        )
    inputs = (q, k_cache, v_cache)
    if torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in inputs):
        with torch.no_grad():
            res = _paged_varlen(
                q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_table, max_seqlen_q, max_seqlen_k,
                dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
            )  # fmt: skip
        if isinstance(res, Tensor):
            return _NoPagedBackward.apply(res, *inputs)  # type: ignore[no-any-return]
        return (_NoPagedBackward.apply(res[0], *inputs), *res[1:])  # type: ignore[return-value]
    if not isinstance(q, Tensor) or q.dim() != 3:
        raise ValueError(f"q must be packed (total_q, nheads, d), got {getattr(q, 'shape', q)}")
    if not isinstance(block_table, Tensor) or block_table.dim() != 2:
        raise ValueError(
            f"block_table must be (batch, max_blocks_per_seq) int32, got {getattr(block_table, 'shape', block_table)}"
        )
    batch = block_table.shape[0]
    check_cu_seqlens(cu_seqlens_k, batch, -1, q.device, name="cu_seqlens_k")
    seqlens_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
    max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
    check_paged_cache(
        q, k_cache, v_cache, block_table, seqlens_k, batch=batch, seqlens_name="cu_seqlens_k's lengths",
        alibi_slopes=alibi_slopes,
    )  # fmt: skip
    check_cu_seqlens(cu_seqlens_q, batch, q.shape[0], q.device)
    compiling = torch.compiler.is_compiling()
    if not compiling:  # value checks read the device: eager only
        # Only the differences reach the kernel; a prefix sum not starting at 0 is a caller's mistake.
        if batch and int(cu_seqlens_k[0]) != 0:
            raise ValueError(f"cu_seqlens_k must start at 0, got {int(cu_seqlens_k[0])}")
        check_cu_values(cu_seqlens_q, q.shape[0], max_seqlen_q)
        # A sequence may have more queries than keys (its first queries then see no key), as in flash-attn.
        check_paged_values(
            block_table, seqlens_k, k_cache.shape[0], k_cache.shape[1], seqlens_name="cu_seqlens_k's lengths"
        )
    scale = _scale(q, softmax_scale)
    wl, wr = int(window_size[0]), int(window_size[1])

    def packed(return_probs: bool) -> Tensor | tuple[Tensor, Tensor, Tensor]:
        """The same attention over the keys gathered into flash-attn's packed layout (host reads:
        for the reference backend and for ``S_dmask``, both meant for small sizes)."""
        kp, vp = (_gather_pages(c, block_table, seqlens_k).to(q.dtype) for c in (k_cache, v_cache))
        return flash_attn_varlen_func(
            q, kp, vp, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, scale, causal, (wl, wr),
            softcap, alibi_slopes, return_attn_probs=return_probs,
        )  # fmt: skip

    if resolve_backend(q.device) == "torch":
        return packed(return_attn_probs)
    run = _paged_varlen_op if compiling else _paged_varlen_impl
    out, lse = run(
        q, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_table, max_seqlen_q, max_seqlen_k, scale, bool(causal),
        wl, wr, float(softcap), alibi_slopes, False,
    )  # fmt: skip
    return (out, lse, packed(True)[2]) if return_attn_probs else out


class _NoPagedBackward(torch.autograd.Function):
    """Identity on a paged varlen ``out`` whose backward raises: flash-attn runs this forward on
    inputs that require grad and has no backward for it, so neither does flashpage."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, out: Tensor, *_inputs: Tensor) -> Tensor:  # type: ignore[override]
        return out.detach()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, *_grads: Tensor) -> tuple:  # type: ignore[override]
        raise FlashAttnError(
            "block_table: flash_attn_varlen_func over a paged KV cache has no backward (as in flash-attn); "
            "call it on tensors that do not require grad, or without block_table"
        )


def _gather_pages(cache: Tensor, block_table: Tensor, seqlens: Tensor) -> Tensor:
    """The first ``seqlens[b]`` tokens of each sequence of a paged ``cache`` packed as
    ``(sum(seqlens), nheads_k, d)`` (reads the lengths on the host; fp8 stays fp8, unscaled)."""
    pieces = [gather_paged_kv(cache, block_table, n, b) for b, n in enumerate(seqlens.tolist())]
    return torch.cat(pieces) if pieces else cache.new_empty((0, *cache.shape[2:]))


def _paged_varlen_impl(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cu_seqlens_q: Tensor,
    seqlens_k: Tensor,
    block_table: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Tensor | None,
    validate: bool,
) -> tuple[Tensor, Tensor]:
    """``(out (total_q, nheads, d), lse (nheads, total_q) float32)`` of the paged prefill kernel,
    with the decode tiles where every sequence has few queries (a decode batch through this API)."""
    config = kv_attention_config(q, k_cache, max_seqlen_q)
    return paged_prefill(  # type: ignore[return-value]
        q, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_table, max_seqlen_q, softmax_scale=softmax_scale,
        causal=causal, window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
        num_splits=0, max_seqlen_k=max(max_seqlen_k, 1), config=config, return_lse=True, validate=validate,
    )  # fmt: skip


_paged_varlen_op = torch.library.custom_op(
    "flashpage::paged_varlen_attention", _paged_varlen_impl, mutates_args=()
)


@_paged_varlen_op.register_fake
def _paged_varlen_fake(q: Tensor, *_args: object) -> tuple[Tensor, Tensor]:
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def flash_attn_varlen_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    alibi_slopes: Tensor | None,
    *,
    validate: bool = True,
) -> tuple[Tensor, Tensor]:
    """Varlen forward without autograd (the engine's prefill call): ``(out, lse (nheads, total_q))``.

    Runs the Triton kernel unless ``FLASHPAGE_BACKEND`` resolves to ``torch`` for q's device.
    ``validate=False`` skips the host sync that checks cu_seqlens values (CUDA-graph / hot path).
    """
    if resolve_backend(q.device) == "torch":
        out, lse = varlen_attention_ref(
            q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=softmax_scale, causal=causal,
            window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
        )  # fmt: skip
        return out.to(q.dtype), lse
    return flash_fwd(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=int(max_seqlen_q),
        max_seqlen_k=int(max_seqlen_k), softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, alibi_slopes=alibi_slopes, validate=validate,
    )  # fmt: skip
