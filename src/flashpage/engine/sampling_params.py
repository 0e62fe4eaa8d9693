"""Sampling parameters of one request (vLLM semantics, see DESIGN.md "Engine").

Every field is validated in ``__post_init__``; an invalid value raises ``ValueError`` whose message
starts with the field name.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MAX_LOGPROBS", "SamplingParams"]

#: Largest number of top log-probabilities a request may ask for per token.
MAX_LOGPROBS = 20

# Temperatures below this are treated as greedy (argmax), as vLLM does: dividing logits by ~0
# overflows and the result is argmax anyway.
_GREEDY_EPS = 1e-5


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(float(x))


@dataclass
class SamplingParams:
    """How to sample the completion(s) of one request.

    Attributes:
        n: completions per prompt; they share the prompt's KV blocks (forked after the prefill).
        temperature: ``0`` = greedy; otherwise logits are divided by it before softmax.
        top_p: nucleus sampling: keep the smallest set of tokens whose probability mass is
            ``>= top_p`` (``1.0`` = off).
        top_k: keep the ``top_k`` most likely tokens (``-1`` or ``0`` = off).
        min_p: drop tokens whose probability is below ``min_p * p(most likely token)`` (``0`` = off).
        seed: per-request random seed; the same seed gives the same tokens whatever the batch.
        max_tokens: most new tokens per completion (``None``: until ``max_model_len``).
        stop: strings that end generation; not included in the output text.
        stop_token_ids: token ids that end generation (kept in ``token_ids``).
        ignore_eos: keep generating after the model's EOS token.
        presence_penalty: subtracted from the logit of every token already generated (``[-2, 2]``).
        frequency_penalty: subtracted once per occurrence of a token already generated (``[-2, 2]``).
        repetition_penalty: divides positive / multiplies negative logits of tokens seen in the
            prompt or the output (``1.0`` = off, ``> 1`` discourages repeats).
        logprobs: number of top log-probabilities to return per generated token (``0``: only the
            sampled token's), ``None`` = none. Log-probabilities are of the model's raw distribution.
        skip_special_tokens: leave special tokens (EOS, chat markers) out of the text.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        min_tokens: EOS, ``stop_token_ids`` and stop strings cannot end a completion before this many
            output tokens (their logits are masked to ``-inf`` until then; ``<= max_tokens``).
        logit_bias: ``{token_id: bias}`` added to the logits before sampling, biases in
            ``[-100, 100]`` (OpenAI semantics; ``str`` keys of ints are accepted as JSON sends them).
            Ids are checked against the vocabulary when the request is added.
        prompt_logprobs: number of top log-probabilities to return per prompt token (``0``: only
            the prompt token's), ``None`` = none. The first prompt token has none (``None``).
        guided_json: constrain the output to a JSON schema (a dict or its JSON text).
        guided_regex: constrain the output to a regular expression.
        guided_json_object: constrain the output to any JSON object (``response_format=json_object``).
            At most one of the three ``guided_*`` options may be set; a constrained completion ends
            when its grammar is complete (EOS is allowed only then).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_json_object: bool = False
    # Normalised forms, filled in __post_init__.
    _stop: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)
    _stop_ids: frozenset[int] = field(default=frozenset(), init=False, repr=False, compare=False)
    _bias: dict[int, float] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if not _is_num(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or a positive int, got {self.top_k!r}")
        if not _is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an int >= 1 or None, got {self.max_tokens!r}")
        stop = self.stop
        if stop is None:
            stops: tuple[str, ...] = ()
        elif isinstance(stop, str):
            stops = (stop,)
        elif isinstance(stop, list | tuple) and all(isinstance(s, str) for s in stop):
            stops = tuple(stop)
        else:
            raise ValueError(f"stop must be a string, a list of strings or None, got {stop!r}")
        if any(s == "" for s in stops):
            raise ValueError("stop must not contain the empty string")
        self._stop = stops
        ids = self.stop_token_ids
        if ids is None:
            self._stop_ids = frozenset()
        elif isinstance(ids, list | tuple | set | frozenset) and all(_is_int(t) and t >= 0 for t in ids):
            self._stop_ids = frozenset(ids)
        else:
            raise ValueError(f"stop_token_ids must be a list of non-negative ints or None, got {ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if not _is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"logprobs must be an int in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens must be a bool, got {self.skip_special_tokens!r}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(
                f"include_stop_str_in_output must be a bool, got {self.include_stop_str_in_output!r}"
            )
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        self._bias = _parse_logit_bias(self.logit_bias)
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"prompt_logprobs must be an int in [0, {MAX_LOGPROBS}] or None, got {self.prompt_logprobs!r}"
            )
        self._check_guided()

    def _check_guided(self) -> None:
        g = self.guided_json
        if g is not None:
            if isinstance(g, str):
                try:
                    parsed = json.loads(g)
                except ValueError as e:
                    raise ValueError(f"guided_json: not valid JSON ({e})") from None
                if not isinstance(parsed, dict | bool):
                    raise ValueError("guided_json: a JSON schema must be an object")
            elif isinstance(g, dict):
                try:
                    json.dumps(g)
                except (TypeError, ValueError) as e:
                    raise ValueError(f"guided_json: the schema is not JSON-serialisable ({e})") from None
            else:
                raise ValueError(
                    f"guided_json must be a JSON schema (dict or str) or None, got {type(g).__name__}"
                )
        if self.guided_regex is not None and (
            not isinstance(self.guided_regex, str) or not self.guided_regex
        ):
            raise ValueError(f"guided_regex must be a non-empty string or None, got {self.guided_regex!r}")
        if not isinstance(self.guided_json_object, bool):
            raise ValueError(f"guided_json_object must be a bool, got {self.guided_json_object!r}")
        set_ = [n for n in ("guided_json", "guided_regex") if getattr(self, n) is not None]
        set_ += ["guided_json_object"] if self.guided_json_object else []
        if len(set_) > 1:
            raise ValueError(
                f"{set_[0]}: at most one of guided_json, guided_regex, guided_json_object, got {set_}"
            )

    # ------------------------------------------------------------------ derived views

    @property
    def greedy(self) -> bool:
        """Whether tokens are chosen by argmax (temperature ~ 0)."""
        return self.temperature < _GREEDY_EPS

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple of strings (empty when none)."""
        return self._stop

    @property
    def stop_token_set(self) -> frozenset[int]:
        """``stop_token_ids`` as a frozen set."""
        return self._stop_ids

    @property
    def has_penalties(self) -> bool:
        """Whether any of the three penalties changes the logits."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def logit_bias_map(self) -> dict[int, float]:
        """``logit_bias`` with int keys and float values (empty when none)."""
        return self._bias

    @property
    def guided(self) -> tuple[str, str] | None:
        """The output constraint as ``(field name, spec)``: the schema as JSON text for
        ``guided_json``, the pattern for ``guided_regex``, ``""`` for ``guided_json_object``;
        ``None`` when unconstrained."""
        if self.guided_json is not None:
            g = self.guided_json
            return "guided_json", g if isinstance(g, str) else json.dumps(g)
        if self.guided_regex is not None:
            return "guided_regex", self.guided_regex
        if self.guided_json_object:
            return "guided_json_object", ""
        return None

    @property
    def effective_top_k(self) -> int:
        """``top_k`` with both "off" spellings mapped to ``-1``."""
        return self.top_k if self.top_k > 0 else -1


def _parse_logit_bias(bias: Any) -> dict[int, float]:
    """``logit_bias`` as ``{int: float}``; keys may be ints or strings of ints (OpenAI JSON)."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias or None, got {type(bias).__name__}")
    out: dict[int, float] = {}
    for k, v in bias.items():
        key = k
        if isinstance(k, str):
            try:
                key = int(k)
            except ValueError:
                raise ValueError(f"logit_bias: key {k!r} is not a token id") from None
        if not _is_int(key) or key < 0:
            raise ValueError(f"logit_bias: key {k!r} is not a non-negative token id")
        if not _is_num(v) or not -100.0 <= v <= 100.0:
            raise ValueError(f"logit_bias: bias of token {k!r} must be a number in [-100, 100], got {v!r}")
        out[key] = float(v)
    return out
