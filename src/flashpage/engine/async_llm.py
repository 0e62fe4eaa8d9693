"""``AsyncLLM``: the engine's asyncio API, which the OpenAI server uses.

::

    llm = AsyncLLM(model="smollm2-135m-instruct")
    async for out in llm.generate("Hello", SamplingParams(max_tokens=8), request_id="r1"):
        print(out.outputs[0].delta_text, end="")
    llm.shutdown()

One background thread drives the engine (:mod:`flashpage.engine.engine_proc`): in this thread
(default), or in a process of its own (``engine_process=True``, what ``flashpage serve`` uses, so
HTTP handling never shares the engine's GIL). It applies aborts, lets the engine step while any
request is unfinished, and hands each step's outputs to the event loops that asked for them, one
wake-up per loop per step. Requests from many clients join the running batch at the next step.

Guarantees:

* A request whose consumer stops iterating (a client that disconnected, a cancelled task) is
  aborted: its KV blocks are freed at once when no step is running, else right after the step.
* An exception inside a step fails the requests in the engine (their iterators raise
  :class:`EngineStepError`) and the engine goes on with new requests.
* Engine state is mutated only between steps by the thread (or process) that steps it, so the
  gauges it publishes are consistent snapshots.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from flashpage.engine.engine_core import EngineConfig, EngineCore
from flashpage.engine.engine_proc import EngineEvent, EngineGauges, EngineInfo, ProcessDriver, ThreadDriver
from flashpage.engine.outputs import RequestOutput
from flashpage.engine.sampling_params import SamplingParams

__all__ = [
    "AsyncLLM",
    "EngineDeadError",
    "EngineGauges",
    "EngineInfo",
    "EngineStepError",
    "RequestStream",
    "StepReport",
]

log = logging.getLogger("flashpage.engine")

# Delivered to the stream of a request aborted by the caller: its iterator ends.
_ABORTED = object()


class EngineStepError(RuntimeError):
    """A step failed while this request was in it; the request was aborted."""


class EngineDeadError(RuntimeError):
    """The engine was shut down (or its process died) before the request finished."""


@dataclass
class StepReport:
    """What one step did, for metrics.

    Attributes:
        outputs: the step's request outputs (deltas for streaming requests, finals).
        decisions: ``{(phase, kernel, num_splits): steps}`` run by this step (empty for an idle
            refresh).
        gauges: the snapshot after the step.
        duration_s: wall time of the step.
    """

    outputs: list[RequestOutput]
    decisions: dict[tuple[str, str, int], int]
    gauges: EngineGauges
    duration_s: float = 0.0


def _fan_out(items: list[tuple[RequestStream, Any]]) -> None:
    for s, item in items:
        s.queue.put_nowait(item)


class RequestStream:
    """The outputs of one request added by :meth:`AsyncLLM.add_request`.

    An async iterator of :class:`RequestOutput` that ends after the final output; ``aclose()`` (or
    leaving ``async with``) before that aborts the request. With an engine process a request the
    engine rejects raises its ``ValueError`` at the first iteration.
    """

    def __init__(
        self, engine: AsyncLLM, request_id: str, queue: asyncio.Queue[Any], loop: asyncio.AbstractEventLoop
    ) -> None:
        self.request_id = request_id
        self.queue = queue
        self.loop = loop
        self.finished = False
        self._engine = engine

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if item is _ABORTED:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True  # already removed (and aborted) by the engine side
            raise item
        self.finished = item.finished
        return item

    async def aclose(self) -> None:
        """Abort the request unless it finished."""
        if not self.finished:
            self.finished = True
            self._engine._abort_ids([self.request_id])

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


@dataclass
class _LoopState:
    """State shared between the event loops and the engine thread (guarded by ``lock``)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    streams: dict[str, RequestStream] = field(default_factory=dict)
    stop: bool = False


class AsyncLLM:
    """An asyncio front end to one engine.

    Args:
        model: as :class:`~flashpage.engine.llm.LLM` (built-in name, HF directory, ``.gguf``, or a
            loaded model; a loaded model needs ``engine_process=False``).
        observer: called in the engine thread with a :class:`StepReport` after every step and on
            idle refreshes (metrics); it must be quick and must not raise.
        engine_process: run the engine in a child process (it loads the model and owns the GPU);
            the default steps it in a thread of this process, where it stays inspectable
            (:attr:`core`).
        **engine_kwargs: the other :class:`~flashpage.engine.engine_core.EngineConfig` options.
    Raises:
        ValueError: a bad option (naming it) or a model that cannot be loaded.
    """

    def __init__(
        self,
        model: Any = "smollm2-135m-instruct",
        *,
        observer: Callable[[StepReport], None] | None = None,
        engine_process: bool = False,
        **engine_kwargs: Any,
    ) -> None:
        core = engine_kwargs.pop("engine", None)
        self.core: EngineCore | None = None
        if core is not None:
            self.core = core
            self._driver: ThreadDriver | ProcessDriver = ThreadDriver(core)
        elif engine_process:
            self._driver = ProcessDriver(EngineConfig(model=model, **engine_kwargs))
        else:
            self.core = EngineCore(EngineConfig(model=model, **engine_kwargs))
            self._driver = ThreadDriver(self.core)
        self.info: EngineInfo = self._driver.info
        self._frontend = self._driver.frontend
        self._observer = observer
        self._state = _LoopState()
        self._gauges = EngineGauges()
        self._phases: list[dict[str, Any]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="flashpage-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine(cls, core: EngineCore, observer: Callable[[StepReport], None] | None = None) -> AsyncLLM:
        """Wrap an existing engine in this process (the caller must not step it any more)."""
        return cls(engine=core, observer=observer)

    # ------------------------------------------------------------------ properties

    @property
    def tokenizer(self) -> Any:
        return self.info.tokenizer

    @property
    def model_name(self) -> str:
        return self.info.model_name

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.info.max_num_seqs

    @property
    def gauges(self) -> EngineGauges:
        """The latest snapshot (updated after every step and when the engine goes idle)."""
        return self._gauges

    @property
    def phases(self) -> list[dict[str, Any]]:
        """Per phase, the roofline planner's latest choice and its step count."""
        return self._phases

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._state.stop

    def num_unfinished(self) -> int:
        """Requests added and not yet finished, aborted or failed."""
        with self._state.lock:
            return len(self._state.streams)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize with the model's tokenizer."""
        return self._frontend.encode(text, add_special_tokens=add_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> tuple[str, list[int]]:
        """:meth:`EngineCore.render_chat` (the model's chat template), in this process."""
        return self._frontend.render_chat(messages, **kwargs)

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        prompt: str | list[int] | None,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        stream: bool = True,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> RequestStream:
        """Add a request now and return the stream of its outputs.

        Call from a running event loop, or from a worker thread with ``loop`` (a guided request
        compiles its grammar here when the engine runs in this process, which can take a fraction
        of a second: keep that off the loop). The outputs are delivered to that loop. Use the
        stream as an async iterator, or ``async with``: leaving it before the request finished
        aborts it.

        Args:
            prompt: text, token ids, or ``None`` with ``prompt_token_ids``.
            sampling_params: default ``SamplingParams()``.
            request_id: unique among unfinished requests (default: a fresh uuid).
            prompt_token_ids: token ids (with ``prompt`` text too: used as-is, text kept).
            stream: yield a snapshot (with ``delta_text`` / ``delta_token_ids``) every step that adds
                tokens; else only the final output.
        Raises:
            ValueError: a bad request (naming the field); nothing was added. With an engine
                process, checks that need the engine raise at the stream's first iteration.
            EngineDeadError: the engine is shut down.
        """
        if not self.is_running:
            raise EngineDeadError("the engine is shut down")
        rid = request_id if request_id is not None else f"req-{uuid.uuid4().hex}"
        handle = RequestStream(self, rid, asyncio.Queue(), loop or asyncio.get_running_loop())
        st = self._state
        with st.lock:
            if rid in st.streams:
                raise ValueError(f"request_id: {rid!r} is already in use by an unfinished request")
            st.streams[rid] = handle
        try:
            self._driver.add(rid, prompt, sampling_params, prompt_token_ids, stream)
        except BaseException:
            with st.lock:
                st.streams.pop(rid, None)
            raise
        return handle

    async def generate(
        self,
        prompt: str | list[int] | None,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        stream: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs until it finishes (see :meth:`add_request`).

        Yields:
            :class:`RequestOutput` snapshots; the last one has ``finished=True``.
        Raises:
            ValueError: a bad request (at the first iteration, before anything runs).
            EngineStepError: a step failed with this request in it.
            EngineDeadError: the engine was shut down first.
        """
        handle = self.add_request(
            prompt, sampling_params, request_id, prompt_token_ids=prompt_token_ids, stream=stream
        )
        async with handle:
            async for out in handle:
                yield out

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests (unknown ids are ignored); their iterators end without a final output."""
        self._abort_ids([request_id] if isinstance(request_id, str) else list(request_id))

    def fail_all(self, message: str) -> int:
        """End every unfinished request: each iterator raises :class:`EngineDeadError` with
        ``message`` and the engine aborts the request. Safe from any thread; returns how many."""
        return self._fail(EngineDeadError(message))

    def _fail(self, err: BaseException) -> int:
        st = self._state
        with st.lock:
            streams, st.streams = st.streams, {}
        if streams:
            self._driver.abort(list(streams))
        self._deliver(list(streams.values()), err)
        return len(streams)

    def _abort_ids(self, ids: list[str]) -> None:
        st = self._state
        with st.lock:
            popped = [s for s in (st.streams.pop(rid, None) for rid in ids) if s is not None]
        self._driver.abort(ids)
        self._deliver(popped, _ABORTED)

    @staticmethod
    def _deliver(streams: list[RequestStream], item: Any) -> None:
        """Put ``item`` on every stream."""
        AsyncLLM._deliver_pairs([(s, item) for s in streams])

    @staticmethod
    def _deliver_pairs(pairs: list[tuple[RequestStream, Any]]) -> None:
        """Put each item on its stream, one wake-up per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        for s, item in pairs:
            by_loop.setdefault(s.loop, []).append((s, item))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
                loop.call_soon_threadsafe(_fan_out, items)

    # ------------------------------------------------------------------ the engine thread

    def _run(self) -> None:
        reason = "the engine was shut down before the request finished"
        while not self._state.stop:
            try:
                event = self._driver.next_event()
            except (EOFError, OSError) as e:
                log.error("the engine process is gone: %s", e)
                reason = f"the engine process stopped: {e}"
                break
            if event is not None:
                self._handle(event)
        with self._state.lock:
            self._state.stop = True
        self._fail(EngineDeadError(reason))

    def _handle(self, event: EngineEvent) -> None:
        st = self._state
        if event.kind == "reject":
            with st.lock:
                s = st.streams.pop(event.request_id or "", None)
            if s is not None:
                self._deliver([s], ValueError(event.error))
            return
        if event.kind == "fail":
            self._fail(EngineStepError(event.error or "the engine step failed"))
        pairs: list[tuple[RequestStream, Any]] = []
        with st.lock:
            for out in event.outputs:
                s = st.streams.pop(out.request_id, None) if out.finished else st.streams.get(out.request_id)
                if s is not None:
                    pairs.append((s, out))
        self._deliver_pairs(pairs)
        if event.gauges is not None:
            self._gauges = event.gauges
        if event.phases:
            self._phases = event.phases
        if self._observer is not None:
            try:
                self._observer(StepReport(event.outputs, event.decisions, self._gauges, event.duration_s))
            except Exception:
                log.exception("engine observer failed")

    # ------------------------------------------------------------------ shutdown

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine (unfinished requests fail with :class:`EngineDeadError`) and release
        the KV cache (and the engine process). Idempotent."""
        with self._state.lock:
            self._state.stop = True
            closed, self._closed = self._closed, True
        self._driver.wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if not closed:
            self._driver.close()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.shutdown()
