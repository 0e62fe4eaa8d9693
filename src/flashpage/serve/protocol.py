"""The OpenAI wire format: pydantic models of requests, responses, stream chunks and errors.

Requests accept OpenAI's fields plus the vLLM extensions users reach for (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``guided_json``,
``guided_regex``, ...). Unknown fields are ignored, as vLLM does, and reported in the server log.
Value checks that need the model (context length, vocabulary) happen in the server; the rest in
:meth:`to_sampling_params`, whose ``ValueError`` names the offending field.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from flashpage.engine.sampling_params import SamplingParams

__all__ = [
    "ChatChoice",
    "ChatChunkChoice",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatLogprobEntry",
    "ChatLogprobs",
    "ChatMessage",
    "ChatResponseMessage",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionResponse",
    "DeltaMessage",
    "ErrorBody",
    "ErrorResponse",
    "ModelCard",
    "ModelList",
    "ResponseFormat",
    "StreamOptions",
    "TopLogprob",
    "UsageInfo",
    "random_id",
]


def random_id(prefix: str) -> str:
    """An id like OpenAI's (``cmpl-...``, ``chatcmpl-...``)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaSpec(_Request):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """``{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class _SamplingFields(_Request):
    """Fields shared by both endpoints (OpenAI's, then vLLM's extensions)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None

    def _guided(self) -> dict[str, Any]:
        """The structured-output fields of :class:`SamplingParams` from ``response_format`` and the
        ``guided_*`` extensions (at most one of them)."""
        out: dict[str, Any] = {}
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            out["guided_json_object"] = True
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ValueError("response_format: type json_schema needs json_schema.schema")
            out["guided_json"] = rf.json_schema.schema_
        if self.guided_json is not None:
            out["guided_json"] = self.guided_json
        if self.guided_regex is not None:
            out["guided_regex"] = self.guided_regex
        if len(out) > 1:
            raise ValueError("response_format: give one of response_format, guided_json, guided_regex")
        return out

    def _common(self, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
        bias: dict[int, float] | None = None
        if self.logit_bias is not None:
            bias = {}
            for k, v in self.logit_bias.items():
                try:
                    bias[int(k)] = float(v)
                except ValueError:
                    raise ValueError(f"logit_bias: keys must be token ids, got {k!r}") from None
        kw: dict[str, Any] = {
            "n": self.n,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": -1 if self.top_k is None else self.top_k,
            "min_p": 0.0 if self.min_p is None else self.min_p,
            "seed": self.seed,
            "max_tokens": max_tokens,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
            "logprobs": logprobs,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "min_tokens": self.min_tokens,
            "logit_bias": bias,
        }
        kw.update(self._guided())
        return kw

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list of strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt: must not be empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        if self.suffix is not None:
            raise ValueError("suffix: is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of == n is supported")
        kw = self._common(max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:
            kw["prompt_logprobs"] = self.logprobs
        return SamplingParams(**kw)


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's text (text parts joined); other part types are refused."""
        c = self.content
        if c is None:
            return ""
        if isinstance(c, str):
            return c
        texts = []
        for part in c:
            if part.type != "text" or part.text is None:
                raise ValueError(f"messages: content part type {part.type!r} is not supported (text only)")
            texts.append(part.text)
        return "".join(texts)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    # vLLM extensions
    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def conversation(self) -> list[dict[str, str]]:
        if not self.messages:
            raise ValueError("messages: must hold at least one message")
        if self.tools:
            raise ValueError("tools: tool calling is not supported")
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs=true")
        lp = (self.top_logprobs or 0) if self.logprobs else None
        return SamplingParams(**self._common(max_tokens, lp))


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorBody


# ---------------------------------------------------------------------------- responses


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    """A ``/v1/completions`` response, and (``choices`` of one) a stream chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobEntry] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "flashpage"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
