"""``AsyncLLM``: the engine's asyncio API, which the OpenAI server uses.

::

    llm = AsyncLLM(model="smollm2-135m-instruct")
    async for out in llm.generate("Hello", SamplingParams(max_tokens=8), request_id="r1"):
        print(out.outputs[0].delta_text, end="")
    llm.shutdown()

One background thread owns the :class:`~flashpage.engine.engine_core.EngineCore`: it applies aborts,
runs ``step()`` while any request is unfinished, and hands each request's outputs to the event loop
that asked for it (``loop.call_soon_threadsafe``). So HTTP handling never waits on a step and a step
never waits on HTTP; requests from many clients join the running batch at the next step.

Guarantees:

* A request whose consumer stops iterating (a client that disconnected, a cancelled task) is
  aborted: its KV blocks are freed at once when no step is running, else right after the step.
* An exception inside a step fails the requests of that step (their iterators raise
  :class:`EngineStepError`) and the loop goes on with new requests; it never stops the engine.
* Engine state is mutated only by the loop thread (``add_request`` only appends to the engine's
  inbox), so the gauges it publishes are consistent snapshots.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from flashpage.engine.engine_core import EngineConfig, EngineCore
from flashpage.engine.outputs import RequestOutput
from flashpage.engine.sampling_params import SamplingParams

__all__ = ["AsyncLLM", "EngineDeadError", "EngineGauges", "EngineStepError", "RequestStream", "StepReport"]

log = logging.getLogger("flashpage.engine")

# Delivered to the stream of a request aborted by the caller: its iterator ends.
_ABORTED = object()

# Longest the loop thread sleeps with no work before it re-checks the stop flag.
_IDLE_WAIT_S = 0.25


class EngineStepError(RuntimeError):
    """A step failed while this request was in it; the request was aborted."""


class EngineDeadError(RuntimeError):
    """The engine was shut down before the request finished."""


@dataclass
class EngineGauges:
    """A consistent snapshot of the engine's load, taken by the loop thread.

    Attributes:
        num_running: requests with at least one sequence scheduled in the batch.
        num_waiting: requests queued but not yet admitted (or preempted back to the queue).
        kv_usage: fraction of KV blocks referenced by sequences, ``[0, 1]``.
        kv_blocks_used / kv_blocks_total: the same in blocks.
        prefix_cache_hit_rate: fraction of looked-up prompt blocks found in the prefix cache.
        num_preemptions: preemptions since start-up.
        time: ``time.time()`` of the snapshot.
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0
    time: float = 0.0


@dataclass
class StepReport:
    """What one step did, for metrics.

    Attributes:
        outputs: the step's request outputs (deltas for streaming requests, finals).
        decisions: ``{(phase, kernel, num_splits): steps}`` run by this step (one entry per step
            with work; empty for an idle refresh).
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
    leaving ``async with``) before that aborts the request.
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
            self.finished = True  # the engine thread already removed and aborted it
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
    """State shared between the event loop and the engine thread (guarded by ``lock``)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    streams: dict[str, RequestStream] = field(default_factory=dict)
    aborts: list[str] = field(default_factory=list)
    stop: bool = False


class AsyncLLM:
    """An asyncio front end to one engine, stepped by a background thread.

    Args:
        model: as :class:`~flashpage.engine.llm.LLM` (built-in name, HF directory, ``.gguf``, or a
            loaded model).
        observer: called in the engine thread with a :class:`StepReport` after every step and on
            idle refreshes (metrics); it must be quick and must not raise.
        **engine_kwargs: the other :class:`~flashpage.engine.engine_core.EngineConfig` options.
    Raises:
        ValueError: a bad option (naming it) or a model that cannot be loaded.
    """

    def __init__(
        self,
        model: Any = "smollm2-135m-instruct",
        *,
        observer: Callable[[StepReport], None] | None = None,
        **engine_kwargs: Any,
    ) -> None:
        core = engine_kwargs.pop("engine", None)
        self.core: EngineCore = (
            core if core is not None else EngineCore(EngineConfig(model=model, **engine_kwargs))
        )
        self._observer = observer
        self._state = _LoopState()
        self._wake = threading.Event()
        self._gauges = EngineGauges()
        self._decision_steps: dict[str, int] = {}
        self._ids = itertools.count()
        self._refresh_gauges()
        self._thread = threading.Thread(target=self._run, name="flashpage-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine(cls, core: EngineCore, observer: Callable[[StepReport], None] | None = None) -> AsyncLLM:
        """Wrap an existing engine (the caller must not step it any more)."""
        return cls(engine=core, observer=observer)

    # ------------------------------------------------------------------ properties

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    @property
    def model_name(self) -> str:
        return self.core.model_name

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def gauges(self) -> EngineGauges:
        """The latest snapshot (updated after every step and when the engine goes idle)."""
        return self._gauges

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._state.stop

    def num_unfinished(self) -> int:
        """Requests added and not yet finished, aborted or failed."""
        with self._state.lock:
            return len(self._state.streams)

    def stats(self) -> dict[str, Any]:
        """:meth:`EngineCore.stats` (read from this thread: counters may be mid-step)."""
        return self.core.stats()

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
        compiles its grammar here, which can take a fraction of a second: keep that off the loop).
        The outputs are delivered to that loop. Use the stream as an async iterator, or
        ``async with``: leaving it before the request finished aborts it.

        Args:
            prompt: text, token ids, or ``None`` with ``prompt_token_ids``.
            sampling_params: default ``SamplingParams()``.
            request_id: unique among unfinished requests (default: a fresh uuid).
            prompt_token_ids: token ids (with ``prompt`` text too: used as-is, text kept).
            stream: yield a snapshot (with ``delta_text`` / ``delta_token_ids``) every step that adds
                tokens; else only the final output.
        Raises:
            ValueError: a bad request (naming the field); nothing was added.
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
            self.core.add_request(
                rid, prompt, sampling_params, prompt_token_ids=prompt_token_ids, stream=stream
            )
        except BaseException:
            with st.lock:
                st.streams.pop(rid, None)
            raise
        self._wake.set()
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
        st = self._state
        with st.lock:
            streams, st.streams = st.streams, {}
            st.aborts.extend(streams)
        self._wake.set()
        for s in streams.values():
            self._deliver(s, EngineDeadError(message))
        return len(streams)

    def _abort_ids(self, ids: list[str]) -> None:
        st = self._state
        with st.lock:
            popped = [s for s in (st.streams.pop(rid, None) for rid in ids) if s is not None]
            st.aborts.extend(ids)
        self._wake.set()
        for s in popped:
            self._deliver(s, _ABORTED)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize with the model's tokenizer."""
        return self.core.encode(text, add_special_tokens=add_special_tokens)

    # ------------------------------------------------------------------ the engine thread

    def _run(self) -> None:
        st = self._state
        while True:
            with st.lock:
                aborts, st.aborts = st.aborts, []
                stop = st.stop
            if aborts:
                self.core.abort_request(aborts)
            if stop:
                break
            if self.core.has_unfinished():
                self._step()
                continue
            self._refresh_gauges()
            self._report(StepReport([], {}, self._gauges))
            self._wake.wait(_IDLE_WAIT_S)
            self._wake.clear()
        self._fail_all(EngineDeadError("the engine was shut down before the request finished"))

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self.core.step()
        except Exception as e:  # one bad step must not stop the server
            log.exception("engine step failed; aborting the requests in it")
            self._fail_all(EngineStepError(f"the engine step failed: {type(e).__name__}: {e}"))
            return
        dt = time.perf_counter() - t0
        decisions = self._new_decisions()
        if not outputs and not decisions:
            # Nothing could be scheduled (e.g. waiting for blocks): do not spin.
            time.sleep(0.001)
        st = self._state
        # One wake-up of each event loop per step, not one per request.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        with st.lock:
            for out in outputs:
                s = st.streams.pop(out.request_id, None) if out.finished else st.streams.get(out.request_id)
                if s is not None:
                    batches.setdefault(s.loop, []).append((s, out))
        for loop, items in batches.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
                loop.call_soon_threadsafe(_fan_out, items)
        self._refresh_gauges()
        self._report(StepReport(outputs, decisions, self._gauges, dt))

    def _new_decisions(self) -> dict[tuple[str, str, int], int]:
        """Steps run per (phase, kernel, split count) since the last call."""
        new: dict[tuple[str, str, int], int] = {}
        for phase, d in self.core.runner.decisions.items():
            prev = self._decision_steps.get(phase, 0)
            if d.steps > prev:
                c = d.choice
                key = (phase, str(c.kernel), int(c.num_splits or 1))
                new[key] = new.get(key, 0) + d.steps - prev
                self._decision_steps[phase] = d.steps
        return new

    def _refresh_gauges(self) -> None:
        core = self.core
        sched = core.scheduler
        u = core.block_manager.usage()
        running = {s.request.request_id for s in sched.running}
        waiting = {s.request.request_id for s in sched.waiting} - running
        pending_adds = max(0, core.num_waiting - len(sched.waiting))
        self._gauges = EngineGauges(
            num_running=len(running),
            num_waiting=len(waiting) + pending_adds,
            kv_usage=u.used_blocks / u.num_blocks if u.num_blocks else 0.0,
            kv_blocks_used=u.used_blocks,
            kv_blocks_total=u.num_blocks,
            prefix_cache_hit_rate=float(core.block_manager.prefix_cache_hit_rate),
            num_preemptions=int(sched.num_preemptions),
            time=time.time(),
        )

    def _report(self, report: StepReport) -> None:
        if self._observer is None:
            return
        try:
            self._observer(report)
        except Exception:
            log.exception("engine observer failed")

    @staticmethod
    def _deliver(s: RequestStream, item: Any) -> None:
        # A closed event loop raises RuntimeError: nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            s.loop.call_soon_threadsafe(s.queue.put_nowait, item)

    def _fail_all(self, err: BaseException) -> None:
        st = self._state
        with st.lock:
            streams, st.streams = st.streams, {}
        if streams:
            self.core.abort_request(list(streams))
        for s in streams.values():
            self._deliver(s, err)

    # ------------------------------------------------------------------ shutdown

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread (unfinished requests fail with :class:`EngineDeadError`) and
        release the KV cache. Idempotent."""
        with self._state.lock:
            self._state.stop = True
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self.core.close()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.shutdown()
