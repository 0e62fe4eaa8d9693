"""What the engine returns: ``RequestOutput`` with one ``CompletionOutput`` per sample (DESIGN.md).

Times are ``time.perf_counter()`` seconds (one clock for arrival, scheduling and token times).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

__all__ = ["CompletionOutput", "Logprob", "RequestMetrics", "RequestOutput"]


class Logprob(float):
    """A log-probability that is also a ``float`` (its value), shaped like vLLM's ``Logprob``.

    Attributes:
        logprob: the log-probability (``float(self)``), of the model's raw distribution.
        rank: 1-based rank of the token in that distribution (``1`` = most likely; tokens with an
            equal log-probability share a rank), ``None`` when unknown.
        decoded_token: the token's text (``None`` without a tokenizer).
    Subclassing ``float`` keeps ``{token_id: float}`` users working: ``lp + 1.0``, comparisons and
    ``math`` functions see the value.
    """

    __slots__ = ("decoded_token", "rank")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> Logprob:
        obj = super().__new__(cls, logprob)
        obj.rank = rank
        obj.decoded_token = decoded_token
        return obj

    @property
    def logprob(self) -> float:
        return float(self)

    def __reduce__(self) -> tuple[type, tuple[float, int | None, str | None]]:
        return (Logprob, (float(self), self.rank, self.decoded_token))

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


@dataclass
class CompletionOutput:
    """One completion of a request.

    Attributes:
        index: position among the request's ``n`` completions.
        text: generated text (stop string cut off; while streaming, text that might still turn into
            a stop string is held back).
        token_ids: generated token ids (a stop token id or EOS that ended generation is included).
        finish_reason: ``"stop"`` (EOS, stop token or stop string), ``"length"`` (``max_tokens`` or
            ``max_model_len``), or ``None`` while running.
        logprobs: per generated token, ``{token_id: Logprob}`` holding the sampled token and the top
            ``SamplingParams.logprobs`` tokens (``None`` when not requested).
        stop_reason: the stop string or stop token id that ended generation (``None`` for EOS/length).
        delta_text: text added since the previous output of this request (streaming).
        delta_token_ids: token ids added since the previous output of this request (streaming).
        cumulative_logprob: sum of the sampled tokens' log-probabilities (``None`` unless
            ``SamplingParams.logprobs`` is set).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    stop_reason: str | int | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        """Whether this completion is done."""
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timing of one request (``time.perf_counter()`` seconds).

    Attributes:
        arrival_time: when the request was added.
        first_scheduled_time: when its first prompt chunk was scheduled.
        first_token_time: when its first output token was sampled.
        last_token_time: when its latest output token was sampled.
        finished_time: when its last completion finished.
        num_prompt_tokens: prompt length.
        num_generation_tokens: tokens generated over all completions.
        num_cached_tokens: prompt tokens served from the prefix cache at its first admission.
        num_preemptions: times any of its sequences was preempted (recomputed).
        token_times: when each output token of completion 0 was sampled (for inter-token latency).
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        """Time to first token in seconds (``None`` before it)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_in_queue(self) -> float | None:
        """Seconds from arrival to first scheduling."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        """Seconds from arrival to the end of the request."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        """Gaps between consecutive output tokens of completion 0 (seconds)."""
        t = self.token_times
        return [b - a for a, b in pairwise(t)]


@dataclass
class RequestOutput:
    """The state of one request: final after ``finished``, a snapshot while streaming.

    Attributes:
        request_id: the caller's id.
        prompt: prompt text (``None`` when given as token ids without a tokenizer).
        prompt_token_ids: prompt token ids.
        outputs: one :class:`CompletionOutput` per completion (``n``), ordered by index.
        finished: every completion is done.
        metrics: timing and counters of the request.
        prompt_logprobs: per prompt token ``{token_id: Logprob}`` holding that token and the top
            ``SamplingParams.prompt_logprobs`` tokens; the first entry is ``None`` (nothing predicts
            it). ``None`` when not requested.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
