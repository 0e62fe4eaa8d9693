"""Communication in the roofline: when ring attention hides its K/V transfer, and what share of a
tensor-parallel decode step the all-reduces take (``flashpage roofline --world N --link NAME``).

Ring attention (per rank, per step, ``n`` tokens per rank, ``b`` sequences, ``h``/``h_k`` heads,
head dim ``d``, ``B`` bytes per element, peak ``P`` FLOP/s, link bandwidth ``W`` and latency ``l``):

* forward: the block's attention ``4 b h d n^2`` FLOPs (half with a causal mask in the zigzag layout,
  where every step does half a block) against sending the next K/V block, ``2 b n h_k d B`` bytes;
* backward: ``10 b h d n^2`` FLOPs (2.5x the forward's matmuls) against the K/V block plus the
  float32 dK/dV accumulators that travel with it, ``2 b n h_k d (B + 4)`` bytes.

The transfer hides when ``flops / P >= l + bytes / W``: a quadratic in ``n`` whose positive root is
the smallest per-rank block that hides it. Compute runs at the datasheet peak here: a real kernel
is slower, which only makes hiding easier, so the block is an upper bound on the one needed.

Tensor parallelism (Megatron-style, ``N`` ranks): every layer all-reduces the attention output and
the MLP output, ``b * hidden * B`` bytes each, with a ring all-reduce costing
``2 (N - 1) l + 2 (N - 1) / N * bytes / W``; the rest of the decode step is the single-GPU roofline
time of every op divided by ``N``. The step is communication-bound when the all-reduces take more
than half of it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from flashpage.roofline.hardware import HardwareProfile, dtype_bytes, normalize_dtype
from flashpage.roofline.intensity import model_op_costs
from flashpage.roofline.links import LinkProfile
from flashpage.roofline.model_shapes import ModelShape

__all__ = [
    "RingStep",
    "TPDecode",
    "distributed_json",
    "format_distributed",
    "min_hidden_block",
    "ring_allreduce_time",
    "ring_step",
    "tp_decode",
]

_FWD, _BWD = 4.0, 10.0  # attention FLOPs per (query, key, head, dim) pair, forward / backward
_GRAD_BYTES = 4  # dK/dV travel in float32


def _ring_coeffs(
    shape: ModelShape, batch: int, dtype: Any, causal: bool, backward: bool
) -> tuple[float, float]:
    """``(flops per n^2, bytes per n)`` of one ring step."""
    nb = dtype_bytes(dtype)
    flops = (_BWD if backward else _FWD) * batch * shape.heads * shape.head_dim * (0.5 if causal else 1.0)
    nbytes = 2.0 * batch * shape.kv_heads * shape.head_dim * (nb + (_GRAD_BYTES if backward else 0))
    return flops, nbytes


def min_hidden_block(
    shape: ModelShape,
    profile: HardwareProfile,
    link: LinkProfile,
    *,
    batch: int = 1,
    dtype: Any = "bf16",
    causal: bool = False,
    backward: bool = False,
) -> int:
    """Smallest per-rank block ``n`` (tokens) with ``compute(n) >= transfer(n)`` for one ring step."""
    fc, bc = _ring_coeffs(shape, batch, dtype, causal, backward)
    a = fc / profile.peak(dtype)  # seconds per n^2
    c = bc / link.bandwidth  # seconds per n
    n = (c + math.sqrt(c * c + 4.0 * a * link.latency)) / (2.0 * a)
    return max(1, math.ceil(n - 1e-9))


@dataclass(frozen=True)
class RingStep:
    """One ring-attention step at ``block`` tokens per rank: compute vs transfer, and the least block
    that hides the transfer."""

    pass_: str
    causal: bool
    block: int
    compute_s: float
    transfer_s: float
    min_block: int

    @property
    def hidden(self) -> bool:
        return self.compute_s >= self.transfer_s

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["pass"] = d.pop("pass_")
        return {**d, "hidden": self.hidden}


def ring_step(
    shape: ModelShape,
    profile: HardwareProfile,
    link: LinkProfile,
    *,
    block: int,
    batch: int = 1,
    dtype: Any = "bf16",
    causal: bool = False,
    backward: bool = False,
) -> RingStep:
    """Compute and transfer seconds of one ring step with ``block`` tokens per rank."""
    if block < 1:
        raise ValueError(f"block: must be >= 1 token, got {block}")
    fc, bc = _ring_coeffs(shape, batch, dtype, causal, backward)
    return RingStep(
        "bwd" if backward else "fwd",
        causal,
        block,
        fc * block * block / profile.peak(dtype),
        link.transfer_time(bc * block),
        min_hidden_block(shape, profile, link, batch=batch, dtype=dtype, causal=causal, backward=backward),
    )


def ring_allreduce_time(nbytes: float, world: int, link: LinkProfile) -> float:
    """Ring all-reduce of ``nbytes`` over ``world`` ranks: ``2 (N-1) l + 2 (N-1)/N * bytes / W``."""
    if world < 2:
        return 0.0
    return 2 * (world - 1) * link.latency + 2 * (world - 1) / world * nbytes / link.bandwidth


@dataclass(frozen=True)
class TPDecode:
    """One tensor-parallel decode step: per-rank compute, all-reduce time and its share."""

    world: int
    batch: int
    ctx: int
    compute_s: float
    allreduce_s: float

    @property
    def share(self) -> float:
        return self.allreduce_s / (self.allreduce_s + self.compute_s)

    @property
    def comm_bound(self) -> bool:
        return self.allreduce_s > self.compute_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "share": self.share, "comm_bound": self.comm_bound}


def tp_decode(
    shape: ModelShape,
    profile: HardwareProfile,
    link: LinkProfile,
    *,
    world: int,
    batch: int,
    ctx: int,
    dtype: Any = "bf16",
) -> TPDecode:
    """The decode step of ``batch`` sequences at context ``ctx`` split over ``world`` ranks."""
    if world < 1:
        raise ValueError(f"world: must be >= 1, got {world}")
    costs = model_op_costs(shape, "decode", batch=batch, seqlen_q=1, seqlen_k=ctx, dtype=dtype)
    compute = sum(c.time_s(profile, dtype) * c.count for c in costs) / world
    per_call = ring_allreduce_time(batch * shape.hidden * dtype_bytes(dtype), world, link)
    return TPDecode(world, batch, ctx, compute, 2 * shape.layers * per_call)


def distributed_json(
    shape: ModelShape,
    profile: HardwareProfile,
    link: LinkProfile,
    *,
    world: int,
    batch: int,
    seq: int,
    dtype: Any = "bf16",
) -> dict[str, Any]:
    """The ``"distributed"`` object of ``flashpage roofline --world N --link NAME --json``: ring
    steps (``seq`` split over ``world`` ranks; forward and backward, causal and not), the TP decode
    step (``batch`` sequences at context ``seq``) and ``warnings`` for communication-bound cases."""
    if world < 2:
        raise ValueError(f"world: must be >= 2 ranks, got {world}")
    key = normalize_dtype(dtype)
    block = math.ceil(seq / world)
    steps = [
        ring_step(shape, profile, link, block=block, batch=1, dtype=key, causal=c, backward=bw)
        for bw in (False, True)
        for c in (False, True)
    ]
    tp = tp_decode(shape, profile, link, world=world, batch=batch, ctx=seq, dtype=key)
    warnings = []
    for s in steps:
        if not s.hidden:
            mask = "causal (zigzag)" if s.causal else "non-causal"
            warnings.append(
                f"ring attention {s.pass_} {mask} is communication-bound over {link.name}: {block} tokens per "
                f"rank transfer in {s.transfer_s * 1e6:.1f} us but compute in {s.compute_s * 1e6:.1f} us; "
                f"needs >= {s.min_block} tokens per rank (seq >= {s.min_block * world})"
            )
    if tp.comm_bound:
        warnings.append(
            f"tensor-parallel decode is communication-bound over {link.name}: all-reduces take "
            f"{tp.share:.0%} of the step at batch {batch}"
        )
    return {
        "world": world,
        "link": link.to_dict(),
        "dtype": key,
        "ring": {"seq": seq, "block_tokens": block, "batch": 1, "steps": [s.to_dict() for s in steps]},
        "tp_decode": tp.to_dict(),
        "warnings": warnings,
    }


def format_distributed(d: dict[str, Any]) -> str:
    """Text of :func:`distributed_json`'s object, for the roofline table."""
    link = d["link"]
    lines = [
        "",
        f"distributed: world {d['world']} over {link['name']} ({link['bandwidth'] / 1e9:.4g} GB/s per direction, "
        f"{link['latency'] * 1e6:.3g} us)",
        f"  ring attention, seq {d['ring']['seq']} = {d['ring']['block_tokens']} tokens per rank:",
        f"    {'pass':<5} {'mask':<10} {'compute us':>11} {'K/V send us':>12} {'min block':>10}  hidden",
    ]
    for s in d["ring"]["steps"]:
        mask = "causal" if s["causal"] else "full"
        lines.append(
            f"    {s['pass']:<5} {mask:<10} {s['compute_s'] * 1e6:>11.1f} {s['transfer_s'] * 1e6:>12.1f} "
            f"{s['min_block']:>10} {'yes' if s['hidden'] else 'NO':>7}"
        )
    tp = d["tp_decode"]
    lines.append(
        f"  tensor-parallel decode, batch {tp['batch']} ctx {tp['ctx']}: compute {tp['compute_s'] * 1e3:.3f} ms "
        f"+ all-reduce {tp['allreduce_s'] * 1e3:.3f} ms per rank ({tp['share']:.0%} communication)"
    )
    lines += [f"WARNING: {w}" for w in d["warnings"]]
    return "\n".join(lines) + "\n"
