"""Per-request and per-completion state of the engine (host side).

A :class:`Request` holds ``n`` :class:`Sequence` objects, one per completion. Only completion 0 exists
until its prompt prefill is done; the others are then forked from it (sharing every prompt block).
A sequence's KV cache covers ``token_ids[:num_computed_tokens]``; the scheduler moves it between
``WAITING`` (no blocks), ``RUNNING`` (holds a block table) and the finished states.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flashpage.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from flashpage.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from flashpage.engine.detokenizer import IncrementalDetokenizer

__all__ = ["Request", "Sequence", "SequenceStatus"]


class SequenceStatus(enum.Enum):
    """Life cycle of a sequence."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self in (
            SequenceStatus.FINISHED_STOPPED,
            SequenceStatus.FINISHED_LENGTH,
            SequenceStatus.FINISHED_ABORTED,
        )


@dataclass(eq=False)
class Sequence:
    """One completion being generated.

    Attributes:
        seq_id: engine-wide unique id (the block manager's key).
        request: the owning request.
        index: completion index within the request.
        token_ids: prompt followed by the generated tokens.
        num_prompt_tokens: prompt length.
        num_computed_tokens: leading tokens whose K/V are in the cache.
        status: scheduling state.
        generator: per-completion RNG on the engine's device when the request has a seed.
        block_table: cached copy of the block manager's table (refreshed when it changes).
        num_committed_blocks: full blocks already registered in the prefix cache.
        num_preemptions: times this sequence was preempted.
        tokens_at_preemption: ``len(token_ids)`` when last preempted; the sequence is protected from
            another preemption until it has generated a token since (no-thrash policy).
        pending_forks: completions still to fork from this one when its prefill finishes.
        detok: incremental detokenizer (``None`` without a tokenizer).
        logprobs: per generated token ``{token_id: Logprob}`` (when requested).
        cumulative_logprob: sum of the sampled tokens' log-probabilities (when logprobs requested).
        matcher: the structured-output grammar matcher (constrained requests), else ``None``.
        kv_write_from: tokens below this position are computed but their K/V not written (they sit in
            shared prefix-cache blocks); set when a request needs prompt logits despite a cache hit.
        finish_reason / stop_reason: why it ended.
        token_times: when each output token was sampled.
        sent_tokens: output tokens already reported to a streaming caller.
    """

    seq_id: int
    request: Request
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    generator: torch.Generator | None = None
    block_table: list[int] = field(default_factory=list)
    num_committed_blocks: int = 0
    num_preemptions: int = 0
    tokens_at_preemption: int = -1
    pending_forks: int = 0
    detok: IncrementalDetokenizer | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    matcher: Any = None
    kv_write_from: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_times: list[float] = field(default_factory=list)
    sent_tokens: int = 0

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether prompt log-probabilities are requested and not all collected yet."""
        lps = self.request.prompt_logprobs
        return self.index == 0 and lps is not None and len(lps) < self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V still have to be computed (1 for a decode)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def preemptible(self) -> bool:
        """False right after a preemption until the sequence has generated a new token."""
        return self.num_preemptions == 0 or len(self.token_ids) > self.tokens_at_preemption

    @property
    def sort_key(self) -> tuple[int, int]:
        """Arrival order (FCFS priority; the latest-arrived is preempted first)."""
        return (self.request.arrival_order, self.index)

    @property
    def text(self) -> str:
        return self.detok.text if self.detok is not None else ""


@dataclass(eq=False)
class Request:
    """One request: a prompt, its sampling parameters and its ``n`` completions.

    Attributes:
        request_id: caller's id (unique among unfinished requests).
        prompt: prompt text (``None`` for token-id prompts).
        prompt_token_ids: prompt tokens.
        params: sampling parameters.
        arrival_order: engine-wide arrival counter (FCFS order).
        metrics: timing and counters.
        stream: report an output every step with new tokens (else only when finished).
        seqs: completions created so far, by index.
        tokenizer: for the per-completion detokenizers (``None``: no text).
        grammar: the compiled structured-output constraint (``None``: unconstrained).
        prompt_logprobs: per prompt token collected so far (the first is ``None``), when requested.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_order: int
    metrics: RequestMetrics
    stream: bool = False
    seqs: list[Sequence] = field(default_factory=list)
    tokenizer: Any = None
    grammar: Any = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)

    def make_output(self, final: bool) -> RequestOutput:
        """Snapshot for the caller; the deltas are what changed since the previous snapshot."""
        outs: list[CompletionOutput] = []
        for s in self.seqs:
            done = s.is_finished
            out_ids = s.output_token_ids
            delta_ids = out_ids[s.sent_tokens :]
            s.sent_tokens = len(out_ids)
            if s.detok is not None:
                delta = s.detok.take_delta(final=done or final)
                text = s.detok.emitted_text
            else:
                delta, text = "", ""
            outs.append(
                CompletionOutput(
                    index=s.index,
                    text=text,
                    token_ids=list(out_ids),
                    finish_reason=s.finish_reason,
                    logprobs=list(s.logprobs) if s.logprobs is not None else None,
                    stop_reason=s.stop_reason,
                    delta_text=delta,
                    delta_token_ids=delta_ids,
                    cumulative_logprob=s.cumulative_logprob,
                )
            )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outs,
            finished=self.finished,
            metrics=self.metrics,
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
        )
