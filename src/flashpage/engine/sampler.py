"""Token sampling on the engine's device, batched over the step's sequences (vLLM semantics).

Order of operations on the ``(N, V)`` float32 logits of one step:

1. raw log-probabilities for requests that asked for ``logprobs`` (``log_softmax`` of the model's
   logits, before any processing, as vLLM v1 reports by default), with each token's rank;
2. logit processors: ``logit_bias`` added, the row's ``banned`` tokens (EOS and stop ids while below
   ``min_tokens``) set to ``-inf``, and the structured-output token bitmask applied (disallowed
   tokens ``-inf``);
3. penalties: repetition (tokens seen in prompt or output: positive logits divided by the penalty,
   negative ones multiplied), then frequency (``- f * count``) and presence (``- p * [count > 0]``)
   over the output tokens;
4. greedy rows (temperature 0) take the argmax here;
5. temperature, top-k, top-p (nucleus, on the top-k-renormalised distribution), min-p;
6. sampling by the exponential race ``argmax(probs / E)``, ``E ~ Exp(1)`` i.i.d., which draws from
   ``probs`` exactly. Rows of seeded requests draw ``E`` from their own ``torch.Generator``, so a
   seed gives the same tokens whatever else is in the batch; other rows share the engine's generator.

Only the features some row uses are computed (an all-greedy batch is one argmax).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from torch import Tensor

from flashpage.engine.outputs import Logprob
from flashpage.engine.sampling_params import SamplingParams

__all__ = [
    "SampleRow",
    "Sampler",
    "SamplerOutput",
    "apply_min_p",
    "apply_penalties",
    "apply_token_bitmask",
    "apply_top_k_top_p",
    "build_logprob_dict",
    "logprobs_with_ranks",
]


@dataclass
class SampleRow:
    """What the sampler needs from one sequence.

    Attributes:
        params: the request's sampling parameters.
        prompt_token_ids / output_token_ids: the sequence's tokens (penalties only).
        generator: the sequence's RNG (seeded requests), else ``None``.
        banned: token ids whose logits are set to ``-inf`` (EOS and stop ids below ``min_tokens``).
    """

    params: SamplingParams
    prompt_token_ids: Seq[int]
    output_token_ids: Seq[int]
    generator: torch.Generator | None = None
    banned: Seq[int] = ()


@dataclass
class SamplerOutput:
    """Sampled tokens (host ints) and, per row, ``{token: Logprob}`` (with ranks) or ``None``."""

    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None] | None


def _padded_ids(lists: Seq[Seq[int]], pad: int, device: torch.device) -> Tensor:
    width = max((len(x) for x in lists), default=0)
    rows = [list(x) + [pad] * (width - len(x)) for x in lists]
    return torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True).reshape(len(lists), width)


def apply_penalties(
    logits: Tensor,
    prompt_ids: Tensor,
    output_ids: Tensor,
    presence: Tensor,
    frequency: Tensor,
    repetition: Tensor,
) -> Tensor:
    """Apply the three penalties in place and return ``logits``.

    Args:
        logits: ``(N, V)`` float32.
        prompt_ids, output_ids: ``(N, Lp)`` / ``(N, Lo)`` int64 token ids, padded with ``V``.
        presence, frequency, repetition: ``(N,)`` float32 penalties (0, 0, 1 = off).
    """
    n, v = logits.shape
    counts = torch.zeros(n, v + 1, dtype=logits.dtype, device=logits.device)
    if output_ids.numel():
        counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=logits.dtype))
    counts = counts[:, :v]
    seen = torch.zeros(n, v + 1, dtype=torch.bool, device=logits.device)
    if prompt_ids.numel():
        seen.scatter_(1, prompt_ids, True)
    seen = seen[:, :v] | (counts > 0)
    rep = repetition.view(n, 1).expand(n, v)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits -= frequency.view(n, 1) * counts
    logits -= presence.view(n, 1) * (counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """Mask (to ``-inf``) tokens outside each row's top-k and nucleus; returns new logits.

    Args:
        logits: ``(N, V)`` float32 (already temperature-scaled).
        top_k: ``(N,)`` int64 in ``[1, V]`` (``V`` = off) or ``None``.
        top_p: ``(N,)`` float32 in ``(0, 1]`` (``1`` = off) or ``None``.
    Ties at the top-k threshold are all kept. At least one token always survives.
    """
    if top_k is None and top_p is None:
        return logits
    v = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        thresh = sorted_logits.gather(1, (v - top_k).clamp(0, v - 1).view(-1, 1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < thresh, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1)
        drop = cum <= (1.0 - top_p).view(-1, 1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_token_bitmask(logits: Tensor, bitmask: Tensor) -> Tensor:
    """Set to ``-inf`` (in place) every token whose bit is 0; returns ``logits``.

    Args:
        logits: ``(N, V)`` float32.
        bitmask: ``(N, ceil(V / 32))`` int32 on the logits' device, xgrammar's layout: bit ``j % 32``
            of word ``j // 32`` allows token ``j`` (an all-ones row, ``-1`` words, leaves a row as is).
    """
    n, v = logits.shape
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask.to(torch.int32).unsqueeze(-1) >> shifts) & 1).reshape(n, -1)[:, :v]
    return logits.masked_fill_(allowed == 0, float("-inf"))


def logprobs_with_ranks(
    logprobs: Tensor, token_ids: Tensor, k: int
) -> tuple[list[float], list[int], list[list[float]], list[list[int]]]:
    """Log-probabilities of chosen tokens and of the top-``k``, with 1-based ranks.

    Args:
        logprobs: ``(N, V)`` float32 log-probabilities; token_ids: ``(N,)`` int64 chosen tokens.
        k: how many top tokens per row (``0``: none).
    Returns:
        ``(chosen, chosen_rank, top_values, top_ids)`` as host lists; a rank is ``1 +`` the number of
        tokens strictly more likely (so top tokens' ranks are their positions among distinct values).
    """
    chosen_t = logprobs.gather(1, token_ids.view(-1, 1))
    rank = (logprobs > chosen_t).sum(dim=-1) + 1
    top_v: list[list[float]] = [[] for _ in range(logprobs.shape[0])]
    top_i: list[list[int]] = [[] for _ in range(logprobs.shape[0])]
    if k > 0:
        tv, ti = logprobs.topk(k, dim=-1)
        top_v, top_i = tv.tolist(), ti.tolist()
    return chosen_t.squeeze(1).tolist(), rank.tolist(), top_v, top_i


def build_logprob_dict(
    chosen_id: int, chosen: float, chosen_rank: int, top_v: Seq[float], top_i: Seq[int]
) -> dict[int, Logprob]:
    """``{token: Logprob}``: the top tokens (rank = 1 + tokens strictly above) and the chosen one."""
    d: dict[int, Logprob] = {}
    rank = 0
    prev = None
    for j, (t, lp) in enumerate(zip(top_i, top_v)):
        if lp != prev:
            rank, prev = j + 1, lp
        d[int(t)] = Logprob(float(lp), rank)
    d[int(chosen_id)] = Logprob(float(chosen), int(chosen_rank))
    return d


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Mask tokens whose probability is below ``min_p * max probability`` of their row.

    Args:
        logits: ``(N, V)`` float32; min_p: ``(N,)`` float32 in ``[0, 1]``.
    """
    probs = logits.softmax(dim=-1)
    top = probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < min_p.view(-1, 1) * top, float("-inf"))


class Sampler:
    """Samples one token per row of a logits batch.

    Args:
        device: where logits live.
        seed: seed of the generator used by rows without a per-request seed.
    """

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def make_generator(self, seed: int) -> torch.Generator:
        """A per-request generator on the sampling device."""
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g

    @torch.inference_mode()
    def sample(self, logits: Tensor, rows: Seq[SampleRow], bitmask: Tensor | None = None) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: ``(N, V)`` float32 on ``device``, row ``i`` for ``rows[i]``.
            rows: per-row parameters.
            bitmask: structured-output masks, ``(N, ceil(V / 32))`` int32 on ``device`` (see
                :func:`apply_token_bitmask`; all-ones rows are unconstrained), or ``None``.
        """
        n, v = logits.shape
        if n != len(rows):
            raise ValueError(f"logits has {n} rows but {len(rows)} sample rows were given")
        if n == 0:
            return SamplerOutput([], None)
        params = [r.params for r in rows]
        logits = logits.float()
        want_lp = [p.logprobs for p in params]
        raw_logprobs = logits.log_softmax(dim=-1) if any(k is not None for k in want_lp) else None
        logits = self._apply_processors(logits, rows, bitmask)

        if any(p.has_penalties for p in params):
            dev = logits.device
            rep_rows = [p.repetition_penalty != 1.0 for p in params]
            prompt_ids = _padded_ids(
                [r.prompt_token_ids if f else () for r, f in zip(rows, rep_rows)], v, dev
            )
            output_ids = _padded_ids([r.output_token_ids if p.has_penalties else () for r, p in zip(rows, params)], v, dev)  # fmt: skip
            pen = torch.tensor(
                [[p.presence_penalty, p.frequency_penalty, p.repetition_penalty] for p in params],
                dtype=torch.float32,
            ).to(dev, non_blocking=True)
            logits = apply_penalties(logits.clone(), prompt_ids, output_ids, pen[:, 0], pen[:, 1], pen[:, 2])

        greedy = [p.greedy for p in params]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample_random(logits, rows, params, greedy)
        token_list = tokens.tolist()
        logprobs = None
        if raw_logprobs is not None:
            logprobs = self._gather_logprobs(raw_logprobs, tokens, want_lp)
        return SamplerOutput(token_list, logprobs)

    @staticmethod
    def _apply_processors(logits: Tensor, rows: Seq[SampleRow], bitmask: Tensor | None) -> Tensor:
        """``logit_bias``, ``banned`` tokens and the grammar bitmask (on a copy of ``logits``)."""
        v = logits.shape[1]
        bias_r: list[int] = []
        bias_t: list[int] = []
        bias_v: list[float] = []
        ban_r: list[int] = []
        ban_t: list[int] = []
        for i, r in enumerate(rows):
            for t, b in r.params.logit_bias_map.items():
                bias_r.append(i)
                bias_t.append(t)
                bias_v.append(b)
            for t in r.banned:
                if t < v:
                    ban_r.append(i)
                    ban_t.append(t)
        if not (bias_r or ban_r or bitmask is not None):
            return logits
        logits = logits.clone()
        dev = logits.device
        if bias_r:
            idx = torch.tensor([bias_r, bias_t], dtype=torch.long).to(dev, non_blocking=True)
            vals = torch.tensor(bias_v, dtype=logits.dtype).to(dev, non_blocking=True)
            logits.index_put_((idx[0], idx[1]), vals, accumulate=True)
        if ban_r:
            idx = torch.tensor([ban_r, ban_t], dtype=torch.long).to(dev, non_blocking=True)
            logits.index_put_((idx[0], idx[1]), torch.tensor(float("-inf"), device=dev))
        if bitmask is not None:
            apply_token_bitmask(logits, bitmask)
        return logits

    def _sample_random(
        self, logits: Tensor, rows: Seq[SampleRow], params: list[SamplingParams], greedy: list[bool]
    ) -> Tensor:
        n, v = logits.shape
        dev = logits.device
        argmax = logits.argmax(dim=-1) if any(greedy) else None
        temps = torch.tensor(
            [1.0 if g else p.temperature for p, g in zip(params, greedy)], dtype=torch.float32
        )
        x = logits / temps.to(dev, non_blocking=True).view(n, 1)
        top_k = top_p = None
        if any(p.effective_top_k > 0 for p in params):
            top_k = torch.tensor([p.effective_top_k if p.effective_top_k > 0 else v for p in params])
            top_k = top_k.clamp(1, v).to(dev, non_blocking=True)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32).to(dev, non_blocking=True)
        x = apply_top_k_top_p(x, top_k, top_p)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32).to(dev, non_blocking=True)
            x = apply_min_p(x, min_p)
        probs = x.softmax(dim=-1)
        noise = torch.empty_like(probs)
        noise.exponential_(generator=self.generator)
        for i, r in enumerate(rows):
            if r.generator is not None and not greedy[i]:
                noise[i].exponential_(generator=r.generator)
        sampled = (probs / noise).argmax(dim=-1)
        if argmax is not None:
            sampled = torch.where(torch.tensor(greedy, device=dev), argmax, sampled)
        return sampled

    @staticmethod
    def _gather_logprobs(
        raw: Tensor, tokens: Tensor, want: list[int | None]
    ) -> list[dict[int, Logprob] | None]:
        kmax = max(k for k in want if k is not None)
        chosen, ranks, top_v, top_i = logprobs_with_ranks(raw, tokens, kmax)
        token_list = tokens.tolist()
        return [
            None
            if k is None
            else build_logprob_dict(token_list[i], chosen[i], ranks[i], top_v[i][:k], top_i[i][:k])
            for i, k in enumerate(want)
        ]
