"""``flashpage serve``: an OpenAI-compatible HTTP server over :class:`~flashpage.engine.async_llm.AsyncLLM`.

Routes (DESIGN.md "Server"): ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (``stream: true`` as server-sent events ending in ``data: [DONE]``),
``GET /health``, ``GET /metrics`` (Prometheus), ``GET /stats`` (the page's live JSON) and the page
at ``/``.

Guarantees:

* Binds 127.0.0.1 unless told otherwise. With an API key every ``/v1`` route needs
  ``Authorization: Bearer KEY`` (compared in constant time); anything else is a 401.
* Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for bad input
  (naming the field), 401, 404 (unknown model or route), 413 (body too large), 429 with
  ``Retry-After`` when the waiting queue is full, 503 while draining, 500 without a stack trace.
* A client that disconnects has its requests aborted and their KV blocks freed.
* SIGTERM drains: new connections are refused, running requests get ``graceful_shutdown_s`` to
  finish and are then aborted, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import re
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from flashpage.engine.async_llm import AsyncLLM, EngineDeadError, EngineStepError, RequestStream
from flashpage.engine.outputs import RequestOutput
from flashpage.engine.sampling_params import SamplingParams
from flashpage.serve import protocol as P
from flashpage.serve.metrics import CONTENT_TYPE, ServerMetrics

__all__ = ["ApiError", "ServerConfig", "build_app", "run_server"]

log = logging.getLogger("flashpage.serve")


@dataclass
class ServerConfig:
    """Options of the HTTP layer (the engine has its own).

    Attributes:
        host: address to bind; loopback by default so nothing is exposed by accident.
        port: TCP port.
        api_key: when set, every ``/v1`` route needs ``Authorization: Bearer <api_key>``.
        served_model_names: names clients may ask for (default: the engine's model name).
        max_queue: most requests waiting for a slot in the batch before new ones get a 429.
        max_tokens_limit: most ``max_tokens`` a request may ask for (default: the context length).
        max_n: most completions per prompt (``n``) and most prompts per completion request.
        max_body_bytes: largest request body accepted (413 above).
        graceful_shutdown_s: how long running requests may go on after SIGTERM.
        retry_after_s: the ``Retry-After`` of a 429.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_names: tuple[str, ...] = ()
    max_queue: int = 256
    max_tokens_limit: int | None = None
    max_n: int = 16
    max_body_bytes: int = 4 * 1024 * 1024
    graceful_shutdown_s: float = 30.0
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        for name in ("port", "max_queue", "max_n", "max_body_bytes", "retry_after_s"):
            v = getattr(self, name)
            lo = 0 if name == "port" else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        if self.port > 65535:
            raise ValueError(f"port must be <= 65535, got {self.port}")
        if self.max_tokens_limit is not None and (
            isinstance(self.max_tokens_limit, bool)
            or not isinstance(self.max_tokens_limit, int)
            or self.max_tokens_limit < 1
        ):
            raise ValueError(f"max_tokens_limit must be an int >= 1 or None, got {self.max_tokens_limit!r}")
        if not self.graceful_shutdown_s >= 0:
            raise ValueError(f"graceful_shutdown_s must be >= 0, got {self.graceful_shutdown_s!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = P.ErrorResponse(error=P.ErrorBody(message=message, type=type, param=param, code=code))
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(self.body.model_dump(), status_code=self.status, headers=self.headers)

    @classmethod
    def bad_request(cls, err: ValueError) -> ApiError:
        """A 400 from a ``ValueError`` whose message starts with the field name."""
        msg = str(err)
        head = re.match(r"[A-Za-z_][\w.\[\]]*", msg)
        return cls(400, msg, param=head.group(0) if head else None)


@dataclass
class _ServerState:
    engine: AsyncLLM
    config: ServerConfig
    metrics: ServerMetrics
    names: tuple[str, ...]
    draining: bool = False
    token_text: dict[int, str] = field(default_factory=dict)


# ---------------------------------------------------------------------------- the ASGI body limit


class _Guard:
    """The checks every request passes before the app, as plain ASGI (no per-chunk cost on streams):
    the API key on ``/v1`` routes (401) and the body size (413, by header or while reading)."""

    def __init__(self, app: Any, limit: int, api_key: str | None) -> None:
        self.app = app
        self.limit = limit
        self.key = api_key.encode() if api_key else None

    def _authorized(self, scope: dict[str, Any]) -> bool:
        if self.key is None or not scope.get("path", "").startswith("/v1"):
            return True
        got = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        scheme, _, token = got.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Any]], send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self._authorized(scope):
            err = ApiError(
                401, "invalid or missing API key", type="authentication_error", code="invalid_api_key"
            )
            await err.response()(scope, receive, send)
            return
        too_big = ApiError(413, f"request body larger than {self.limit} bytes", code="request_too_large")
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                try:
                    if int(v) > self.limit:
                        await too_big.response()(scope, receive, send)
                        return
                except ValueError:
                    await ApiError(400, "invalid Content-Length header").response()(scope, receive, send)
                    return
        seen = 0

        async def limited_receive() -> Any:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return msg

        try:
            await self.app(scope, limited_receive, send)
        except _TooLarge:  # raised while a handler reads its body, before it answers
            await too_big.response()(scope, receive, send)


class _TooLarge(Exception):
    pass


# ---------------------------------------------------------------------------- helpers


def _sse(obj: Any) -> str:
    body = obj.model_dump_json(exclude_unset=True) if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"data: {body}\n\n"


async def _prepend(first: RequestOutput, rest: RequestStream) -> AsyncIterator[RequestOutput]:
    yield first
    if not first.finished:
        async for out in rest:
            yield out


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several request streams as they come, tagged with the stream's position."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[Any] = asyncio.Queue()
    done = object()

    async def pump(i: int, s: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in s:
                await queue.put((i, out))
        except BaseException as e:  # handed to the consumer, which re-raises it
            await queue.put(e)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _until_disconnect(request: Request, poll_s: float = 0.25) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(poll_s)


class _Server:
    """Route handlers over one engine (state lives here, not in module globals)."""

    def __init__(self, state: _ServerState) -> None:
        self.s = state

    # ------------------------------------------------------------------ checks

    def check_model(self, model: str | None) -> str:
        names = self.s.names
        if model is None:
            return names[0]
        if model not in names:
            raise ApiError(
                404,
                f"The model {model!r} does not exist; this server serves {', '.join(map(repr, names))}",
                param="model",
                code="model_not_found",
            )
        return model

    def check_capacity(self, new: int) -> None:
        eng, cfg = self.s.engine, self.s.config
        if self.s.draining or not eng.is_running:
            raise ApiError(
                503, "the server is shutting down", type="service_unavailable", code="shutting_down"
            )
        # Requests beyond the batch's slots wait for sure; the last step's snapshot adds those held
        # back by KV-cache space.
        slots = eng.max_num_seqs
        waiting = max(eng.gauges.num_waiting, eng.num_unfinished() - slots, 0)
        if waiting + new > cfg.max_queue:
            raise ApiError(
                429,
                f"the waiting queue is full ({waiting} requests waiting, --max-queue {cfg.max_queue}); retry later",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(cfg.retry_after_s)},
            )

    def max_tokens_for(self, requested: int | None, prompt_len: int) -> int:
        """``max_tokens`` checked against the limits; ``None`` fills the context."""
        ctx = self.s.engine.max_model_len
        limit = self.s.config.max_tokens_limit
        if prompt_len >= ctx:
            raise ApiError(
                400,
                f"prompt: {prompt_len} tokens leave no room for output within the model's context "
                f"length max_model_len={ctx}",
                param="prompt",
                code="context_length_exceeded",
            )
        if requested is None:
            n = ctx - prompt_len
            return min(n, limit) if limit is not None else n
        if isinstance(requested, bool) or requested < 1:
            raise ApiError(400, f"max_tokens: must be >= 1, got {requested}", param="max_tokens")
        if limit is not None and requested > limit:
            raise ApiError(
                400, f"max_tokens: {requested} exceeds this server's limit of {limit}", param="max_tokens"
            )
        if prompt_len + requested > ctx:
            raise ApiError(
                400,
                f"max_tokens: the prompt ({prompt_len} tokens) plus max_tokens ({requested}) exceeds the "
                f"model's context length max_model_len={ctx}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return requested

    def check_n(self, n: int, prompts: int = 1) -> None:
        cfg = self.s.config
        if isinstance(n, bool) or n < 1 or n > cfg.max_n:
            raise ApiError(400, f"n: must be in [1, {cfg.max_n}], got {n}", param="n")
        if prompts > cfg.max_n:
            raise ApiError(
                400, f"prompt: at most {cfg.max_n} prompts per request, got {prompts}", param="prompt"
            )

    def token_text(self, tid: int) -> str:
        cache = self.s.token_text
        t = cache.get(tid)
        if t is None:
            tok = self.s.engine.tokenizer
            t = tok.decode([tid]) if tok is not None else str(tid)
            cache[tid] = t
        return t

    # ------------------------------------------------------------------ adding requests

    async def add_all(
        self, items: list[tuple[str | None, list[int], SamplingParams]], base_id: str
    ) -> list[RequestStream]:
        """Add every prompt's request; on a bad one, abort those already added and answer 400."""
        eng = self.s.engine
        loop = asyncio.get_running_loop()
        streams: list[RequestStream] = []
        try:
            for i, (text, ids, params) in enumerate(items):
                args = (text, params, f"{base_id}-{i}")
                kw: dict[str, Any] = {"prompt_token_ids": ids, "stream": True, "loop": loop}
                if params.guided is not None:  # compiling the grammar: off the event loop
                    streams.append(await asyncio.to_thread(eng.add_request, *args, **kw))
                else:
                    streams.append(eng.add_request(*args, **kw))
        except ValueError as e:
            for st in streams:
                await st.aclose()
            raise ApiError.bad_request(e) from None
        except EngineDeadError:
            raise ApiError(503, "the server is shutting down", type="service_unavailable") from None
        return streams

    async def run(
        self,
        request: Request,
        streams: list[RequestStream],
        stream: bool,
        events: Callable[[AsyncIterator[tuple[int, RequestOutput]]], AsyncIterator[str]],
        collect: Callable[[list[RequestOutput]], Any],
    ) -> Response:
        """Answer with SSE events or one JSON body; aborts every stream when the client leaves."""

        async def close_all() -> None:
            for st in streams:
                await st.aclose()

        # Wait for every request's first output before answering: a request the engine refuses
        # (with an engine process some checks run there) is then still a plain 400.
        sources: list[AsyncIterator[RequestOutput]] = []
        try:
            for st in streams:
                sources.append(_prepend(await st.__anext__(), st))
        except ValueError as e:
            await close_all()
            raise ApiError.bad_request(e) from None
        except (EngineStepError, EngineDeadError, StopAsyncIteration) as e:
            await close_all()
            dead = not isinstance(e, EngineStepError)
            msg = str(e) or "the request was aborted before it started"
            raise ApiError(503 if dead else 500, msg, type="server_error") from None

        if stream:

            async def body() -> AsyncIterator[str]:
                try:
                    async for ev in events(_merge(sources)):
                        yield ev
                except (EngineStepError, EngineDeadError) as e:
                    err = P.ErrorResponse(error=P.ErrorBody(message=str(e), type="server_error"))
                    yield f"data: {err.model_dump_json()}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    await close_all()

            return StreamingResponse(
                body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )

        finals: list[RequestOutput | None] = [None] * len(streams)

        async def gather() -> None:
            async for i, out in _merge(sources):
                if out.finished:
                    finals[i] = out

        work = asyncio.create_task(gather())
        watch = asyncio.create_task(_until_disconnect(request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client left
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                return Response(status_code=499)
            try:
                work.result()
            except (EngineStepError, EngineDeadError) as e:
                raise ApiError(
                    500 if isinstance(e, EngineStepError) else 503, str(e), type="server_error"
                ) from None
        finally:
            watch.cancel()
            await close_all()
        if any(f is None for f in finals):
            raise ApiError(503, "the request was aborted before it finished", type="server_error")
        return JSONResponse(collect([f for f in finals if f is not None]))

    # ------------------------------------------------------------------ logprobs

    def completion_logprobs(
        self, entries: list[tuple[int, dict[int, float] | None]], offset0: int, k: int
    ) -> P.CompletionLogprobs:
        lp = P.CompletionLogprobs()
        off = offset0
        for tid, d in entries:
            text = self.token_text(tid)
            lp.tokens.append(text)
            lp.token_logprobs.append(float(d[tid]) if d is not None and tid in d else None)
            if d is None:
                lp.top_logprobs.append(None)
            else:
                top = sorted(d.items(), key=lambda kv: -float(kv[1]))[: max(k, 0)]
                lp.top_logprobs.append({self.token_text(t): float(v) for t, v in top})
            lp.text_offset.append(off)
            off += len(text)
        return lp

    def chat_logprobs(self, token_ids: list[int], dicts: list[dict[int, float]], k: int) -> P.ChatLogprobs:
        content = []
        for tid, d in zip(token_ids, dicts):
            text = self.token_text(tid)
            top = sorted(d.items(), key=lambda kv: -float(kv[1]))[:k]
            content.append(
                P.ChatLogprobEntry(
                    token=text,
                    logprob=float(d.get(tid, float("-inf"))),
                    bytes=list(text.encode()),
                    top_logprobs=[
                        P.TopLogprob(
                            token=self.token_text(t),
                            logprob=float(v),
                            bytes=list(self.token_text(t).encode()),
                        )
                        for t, v in top
                    ],
                )
            )
        return P.ChatLogprobs(content=content)


# ---------------------------------------------------------------------------- the app


def build_app(
    engine: AsyncLLM, config: ServerConfig | None = None, metrics: ServerMetrics | None = None
) -> FastAPI:
    """The FastAPI app serving ``engine`` (its lifespan shuts the engine down)."""
    config = config or ServerConfig()
    metrics = metrics or ServerMetrics(engine.model_name)
    names = config.served_model_names or (engine.model_name,)
    state = _ServerState(engine, config, metrics, tuple(names))
    srv = _Server(state)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        state.draining = True
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="flashpage", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.flashpage = state

    # ---------------------------------------------------------------- errors

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            return ApiError(400, "the request body is not valid JSON", code="invalid_json").response()
        # Drop "body" and pydantic's union-member tags ("str", "list[int]") from the location.
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        path = [
            x for x in loc if not re.fullmatch(r"(str|int|float|bool|list|dict|function-\w+)(\[.*\])?", x)
        ]
        param = path[0] if path else None
        where = ".".join(path) or "body"
        msg = (
            f"{where}: field required"
            if first.get("type") == "missing"
            else f"{where}: {first.get('msg', 'invalid value')}"
        )
        return ApiError(400, msg, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, str(exc.detail), type=kind).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return ApiError(500, "internal server error", type="server_error").response()

    # ---------------------------------------------------------------- routes

    @app.get("/health")
    async def health() -> Response:
        if state.draining or not engine.is_running:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/stats")
    async def stats() -> Response:
        return JSONResponse(_page_stats(state))

    @app.get("/v1/models")
    async def models() -> P.ModelList:
        return P.ModelList(
            data=[
                P.ModelCard(id=n, root=engine.model_name, max_model_len=engine.max_model_len) for n in names
            ]
        )

    @app.post("/v1/completions")
    async def completions(req: P.CompletionRequest, request: Request) -> Response:
        model = srv.check_model(req.model)
        try:
            prompts = req.prompts()
        except ValueError as e:
            raise ApiError.bad_request(e) from None
        srv.check_n(req.n, len(prompts))
        items: list[tuple[str | None, list[int], SamplingParams]] = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                try:
                    ids = await asyncio.to_thread(engine.encode, p)
                except ValueError as e:
                    raise ApiError.bad_request(e) from None
                text: str | None = p
            else:
                ids, text = list(p), None
            if not ids:
                raise ApiError(400, f"prompt: prompt {i} is empty", param="prompt")
            max_tokens = srv.max_tokens_for(req.max_tokens, len(ids))
            try:
                params = req.to_sampling_params(max_tokens)
            except ValueError as e:
                raise ApiError.bad_request(e) from None
            items.append((text, ids, params))
        srv.check_capacity(len(items))
        rid = P.random_id("cmpl")
        streams = await srv.add_all(items, rid)
        return await srv.run(
            request,
            streams,
            req.stream,
            lambda merged: _completion_events(srv, req, rid, model, items, merged),
            lambda finals: _completion_body(srv, req, rid, model, items, finals),
        )

    @app.post("/v1/chat/completions")
    async def chat(req: P.ChatCompletionRequest, request: Request) -> Response:
        model = srv.check_model(req.model)
        srv.check_n(req.n)
        try:
            conv = req.conversation()
            text, ids = await asyncio.to_thread(
                engine.render_chat,
                conv,
                add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                chat_template=req.chat_template,
                continue_final_message=req.continue_final_message,
            )
        except ValueError as e:
            raise ApiError.bad_request(e) from None
        max_tokens = srv.max_tokens_for(req.requested_max_tokens, len(ids))
        try:
            params = req.to_sampling_params(max_tokens)
        except ValueError as e:
            raise ApiError.bad_request(e) from None
        srv.check_capacity(1)
        rid = P.random_id("chatcmpl")
        items = [(text, ids, params)]
        streams = await srv.add_all(items, rid)
        return await srv.run(
            request,
            streams,
            req.stream,
            lambda merged: _chat_events(srv, req, rid, model, len(ids), merged),
            lambda finals: _chat_body(srv, req, rid, model, finals[0]),
        )

    static = resources.files("flashpage.serve") / "static"

    @app.get("/", response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        return HTMLResponse((static / "index.html").read_text(encoding="utf-8"))

    app.mount("/static", StaticFiles(directory=str(static)), name="static")
    return _Guard(app, config.max_body_bytes, config.api_key)  # type: ignore[return-value]


def _page_stats(state: _ServerState) -> dict[str, Any]:
    """The live panel's JSON: the metrics summary plus the roofline of each phase's kernel."""
    eng = state.engine
    info = eng.info
    out = state.metrics.summary()
    keys = ("phase", "kernel", "num_splits", "intensity", "ridge", "bound", "steps")
    out.update(
        {
            "model": info.model_name,
            "served_model_names": list(state.names),
            "max_model_len": info.max_model_len,
            "device": info.device,
            "dtype": info.dtype,
            "hardware": info.hardware,
            "peak_tflops": info.peak_tflops,
            "peak_tbps": info.peak_tbps,
            "phases": [{k: p.get(k) for k in keys} for p in eng.phases],
        }
    )
    return out


# ---------------------------------------------------------------------------- completions


def _usage(prompt_tokens: int, finals: list[RequestOutput]) -> P.UsageInfo:
    gen = sum(len(c.token_ids) for f in finals for c in f.outputs)
    return P.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=gen, total_tokens=prompt_tokens + gen)


def _echo_logprobs(out: RequestOutput, ids: list[int]) -> list[tuple[int, dict[int, float] | None]]:
    """The prompt's tokens with their logprobs (the first has none), for ``echo`` + ``logprobs``."""
    plp = out.prompt_logprobs or [None] * len(ids)
    return [(t, plp[i] if i < len(plp) else None) for i, t in enumerate(ids)]


def _completion_body(
    srv: _Server,
    req: P.CompletionRequest,
    rid: str,
    model: str,
    items: list[tuple[str | None, list[int], SamplingParams]],
    finals: list[RequestOutput],
) -> dict[str, Any]:
    choices = []
    for i, out in enumerate(finals):
        text_p, ids, _ = items[i]
        prompt_text = ""
        if req.echo:
            prompt_text = text_p if text_p is not None else srv.s.engine.tokenizer.decode(ids)
        for c in out.outputs:
            text = (prompt_text + c.text) if req.echo else c.text
            lp = None
            if req.logprobs is not None:
                entries = _echo_logprobs(out, ids) if req.echo else []
                entries += list(zip(c.token_ids, c.logprobs or [None] * len(c.token_ids)))
                lp = srv.completion_logprobs(entries, 0, req.logprobs)
            choices.append(
                P.CompletionChoice(
                    index=i * req.n + c.index,
                    text=text,
                    logprobs=lp,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
    prompt_tokens = sum(len(ids) for _, ids, _ in items)
    resp = P.CompletionResponse(
        id=rid, created=P.now(), model=model, choices=choices, usage=_usage(prompt_tokens, finals)
    )
    return resp.model_dump()


async def _completion_events(
    srv: _Server,
    req: P.CompletionRequest,
    rid: str,
    model: str,
    items: list[tuple[str | None, list[int], SamplingParams]],
    merged: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[str]:
    created = P.now()
    started: set[int] = set()
    offsets: dict[int, int] = {}
    finals: dict[int, RequestOutput] = {}
    done: set[int] = set()
    async for i, out in merged:
        text_p, ids, _ = items[i]
        for c in out.outputs:
            idx = i * req.n + c.index
            if idx in done:
                continue
            new_ids = c.delta_token_ids
            text = c.delta_text
            entries: list[tuple[int, dict[int, float] | None]] = []
            if idx not in started:
                started.add(idx)
                if req.echo:
                    prompt_text = text_p if text_p is not None else srv.s.engine.tokenizer.decode(ids)
                    text = prompt_text + text
                    if req.logprobs is not None:
                        entries += _echo_logprobs(out, ids)
            if not text and not new_ids and c.finish_reason is None:
                continue
            lp = None
            if req.logprobs is not None:
                n_all = len(c.token_ids)
                lps = c.logprobs or []
                first = n_all - len(new_ids)
                entries += [
                    (t, lps[first + j] if first + j < len(lps) else None) for j, t in enumerate(new_ids)
                ]
                lp = srv.completion_logprobs(entries, offsets.get(idx, 0), req.logprobs)
                offsets[idx] = offsets.get(idx, 0) + sum(len(x) for x in lp.tokens)
            if c.finish_reason is not None:
                done.add(idx)
            chunk = P.CompletionResponse(
                id=rid,
                object="text_completion",
                created=created,
                model=model,
                choices=[
                    P.CompletionChoice(
                        index=idx,
                        text=text,
                        logprobs=lp,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                ],
            )
            if req.include_usage:
                chunk.usage = None
            yield _sse(chunk)
        if out.finished:
            finals[i] = out
    if req.include_usage:
        prompt_tokens = sum(len(ids) for _, ids, _ in items)
        usage = _usage(prompt_tokens, list(finals.values()))
        yield _sse(P.CompletionResponse(id=rid, created=created, model=model, choices=[], usage=usage))
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------------------- chat


def _chat_body(
    srv: _Server, req: P.ChatCompletionRequest, rid: str, model: str, out: RequestOutput
) -> dict[str, Any]:
    choices = []
    for c in out.outputs:
        lp = None
        if req.logprobs:
            lp = srv.chat_logprobs(c.token_ids, c.logprobs or [], req.top_logprobs or 0)
        choices.append(
            P.ChatChoice(
                index=c.index,
                message=P.ChatResponseMessage(role="assistant", content=c.text),
                logprobs=lp,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
        )
    resp = P.ChatCompletionResponse(
        id=rid, created=P.now(), model=model, choices=choices, usage=_usage(len(out.prompt_token_ids), [out])
    )
    return resp.model_dump()


async def _chat_events(
    srv: _Server,
    req: P.ChatCompletionRequest,
    rid: str,
    model: str,
    prompt_tokens: int,
    merged: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[str]:
    created = P.now()
    started: set[int] = set()
    done: set[int] = set()
    final: RequestOutput | None = None

    def chunk(choice: P.ChatChunkChoice) -> str:
        c = P.ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice])
        if req.include_usage:
            c.usage = None
        return _sse(c)

    async for _, out in merged:
        for c in out.outputs:
            if c.index in done:
                continue
            if c.index not in started:
                started.add(c.index)
                yield chunk(
                    P.ChatChunkChoice(index=c.index, delta=P.DeltaMessage(role="assistant", content=""))
                )
            if c.delta_text or c.delta_token_ids:
                lp = None
                if req.logprobs:
                    n_all, k = len(c.token_ids), len(c.delta_token_ids)
                    lp = srv.chat_logprobs(
                        c.delta_token_ids, (c.logprobs or [])[n_all - k :], req.top_logprobs or 0
                    )
                yield chunk(
                    P.ChatChunkChoice(index=c.index, delta=P.DeltaMessage(content=c.delta_text), logprobs=lp)
                )
            if c.finish_reason is not None:
                done.add(c.index)
                yield chunk(
                    P.ChatChunkChoice(
                        index=c.index,
                        delta=P.DeltaMessage(),
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )
        if out.finished:
            final = out
    if req.include_usage:
        usage = _usage(prompt_tokens, [final] if final is not None else [])
        yield _sse(P.ChatCompletionChunk(id=rid, created=created, model=model, choices=[], usage=usage))
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------------------- running it


def run_server(engine: AsyncLLM, config: ServerConfig, metrics: ServerMetrics | None = None) -> int:
    """Serve until SIGTERM / SIGINT, then drain (see the module docstring); returns the exit code."""
    import uvicorn

    app = build_app(engine, config, metrics)
    inner: FastAPI = app.app  # type: ignore[attr-defined]
    state: _ServerState = inner.state.flashpage

    grace = config.graceful_shutdown_s

    class _DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if not state.draining:
                state.draining = True
                # End what is still running just before the grace period is over, so every stream
                # closes with an error event and [DONE] rather than being cut by uvicorn.
                timer = threading.Timer(max(0.0, grace - 0.5), engine.fail_all, ("the server shut down",))
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)

    uv = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level="info",
        timeout_graceful_shutdown=math.ceil(grace) + 5,  # a backstop: fail_all ends the requests first
        lifespan="on",
    )
    server = _DrainingServer(uv)
    # uvicorn drains on SIGINT / SIGTERM and then raises the signal again under the handlers it found:
    # with these in place that re-raise is a no-op and a drained server exits 0.
    previous = {sig: signal.signal(sig, _drained) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        log.info("flashpage serving %s on http://%s:%d", ", ".join(state.names), config.host, config.port)
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        engine.shutdown()
    return 0


def _drained(sig: int, frame: Any) -> None:
    log.info("server drained after signal %d", sig)
