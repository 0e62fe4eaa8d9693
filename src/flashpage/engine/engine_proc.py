"""How :class:`~flashpage.engine.async_llm.AsyncLLM` drives an engine: in a thread of this process,
or in a process of its own.

Both drivers turn the engine into a stream of :class:`EngineEvent` s (a step's outputs, a rejected
request, a failed step, an idle snapshot) that ``AsyncLLM``'s thread hands to the event loops.

* :class:`ThreadDriver` steps an :class:`~flashpage.engine.engine_core.EngineCore` in the caller's
  thread. Simple, and the engine stays inspectable, but every step shares the GIL with the HTTP
  event loop: at high concurrency the loop's per-chunk work slows the steps.
* :class:`ProcessDriver` runs the engine in a child process (spawned; it owns the GPU) and talks to
  it over a pipe: requests and aborts go down, one message per step comes back. The server uses it,
  so HTTP handling never takes the engine's GIL. Messages are pickled between this process and the
  child it spawned, nothing else.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import signal
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from flashpage.engine.engine_core import EngineConfig, EngineCore
from flashpage.engine.outputs import CompletionOutput, RequestOutput

__all__ = [
    "EngineEvent",
    "EngineGauges",
    "EngineInfo",
    "Frontend",
    "ProcessDriver",
    "ThreadDriver",
    "engine_gauges",
    "engine_info",
]

log = logging.getLogger("flashpage.engine")

# Longest an idle driver waits before it re-checks for work and stop requests.
_IDLE_WAIT_S = 0.25


@dataclass
class EngineGauges:
    """A consistent snapshot of the engine's load, taken between steps.

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
class EngineInfo:
    """What the front end needs to know of an engine it may not hold (the process driver's).

    Attributes:
        model_name / max_model_len / max_num_seqs / vocab_size: the engine's.
        device / dtype: where and in what the model runs (strings).
        hardware: the roofline profile's name; peak_tflops / peak_tbps: its ceilings.
        tokenizer / chat_template: for tokenizing and rendering chats in the front end.
    """

    model_name: str
    max_model_len: int
    max_num_seqs: int
    vocab_size: int
    device: str
    dtype: str
    hardware: str | None = None
    peak_tflops: float | None = None
    peak_tbps: float | None = None
    tokenizer: Any = field(default=None, repr=False)
    chat_template: str | None = field(default=None, repr=False)


@dataclass
class EngineEvent:
    """One thing the engine did.

    Attributes:
        kind: ``"step"`` (outputs of a step), ``"reject"`` (``request_id`` refused with ``error``),
            ``"fail"`` (a step raised ``error``; every unfinished request is lost), ``"idle"``
            (nothing to run; a fresh snapshot).
        outputs: the step's request outputs.
        decisions: steps run per ``(phase, kernel, num_splits)`` by this step.
        gauges: the snapshot after the event.
        phases: per phase, the roofline planner's latest choice (``PhaseDecision.as_dict``).
        duration_s: wall time of the step.
    """

    kind: str
    outputs: list[RequestOutput] = field(default_factory=list)
    decisions: dict[tuple[str, str, int], int] = field(default_factory=dict)
    gauges: EngineGauges | None = None
    phases: list[dict[str, Any]] = field(default_factory=list)
    duration_s: float = 0.0
    request_id: str | None = None
    error: str | None = None


# ---------------------------------------------------------------------------- reading an engine


def engine_gauges(core: EngineCore) -> EngineGauges:
    """The load snapshot of ``core`` (call between steps, from the thread that steps it)."""
    sched = core.scheduler
    u = core.block_manager.usage()
    running = {s.request.request_id for s in sched.running}
    waiting = {s.request.request_id for s in sched.waiting} - running
    pending_adds = max(0, core.num_waiting - len(sched.waiting))
    return EngineGauges(
        num_running=len(running),
        num_waiting=len(waiting) + pending_adds,
        kv_usage=u.used_blocks / u.num_blocks if u.num_blocks else 0.0,
        kv_blocks_used=u.used_blocks,
        kv_blocks_total=u.num_blocks,
        prefix_cache_hit_rate=float(core.block_manager.prefix_cache_hit_rate),
        num_preemptions=int(sched.num_preemptions),
        time=time.time(),
    )


def engine_info(core: EngineCore) -> EngineInfo:
    """The front end's view of ``core``."""
    prof = getattr(core.runner, "profile", None)
    dtype = str(core.dtype).removeprefix("torch.")
    peak = None
    if prof is not None:
        peaks = getattr(prof, "peak_flops", {}) or {}
        v = peaks.get(dtype) or peaks.get("bfloat16") or (max(peaks.values()) if peaks else None)
        peak = v / 1e12 if v else None
    return EngineInfo(
        model_name=core.model_name,
        max_model_len=core.max_model_len,
        max_num_seqs=core.config.max_num_seqs,
        vocab_size=core.vocab_size,
        device=str(core.device),
        dtype=dtype,
        hardware=getattr(prof, "name", None),
        peak_tflops=peak,
        peak_tbps=prof.hbm_bandwidth / 1e12 if prof is not None else None,
        tokenizer=core.tokenizer,
        chat_template=core.chat_template,
    )


def _phases(core: EngineCore) -> list[dict[str, Any]]:
    return [d.as_dict() for d in list(core.runner.decisions.values())]


class _DecisionCounter:
    """Steps run per (phase, kernel, split count) since the last call."""

    def __init__(self) -> None:
        self._steps: dict[str, int] = {}

    def new(self, core: EngineCore) -> dict[tuple[str, str, int], int]:
        out: dict[tuple[str, str, int], int] = {}
        for phase, d in core.runner.decisions.items():
            prev = self._steps.get(phase, 0)
            if d.steps > prev:
                c = d.choice
                key = (phase, str(c.kernel), int(c.num_splits or 1))
                out[key] = out.get(key, 0) + d.steps - prev
                self._steps[phase] = d.steps
        return out


def _step_event(core: EngineCore, counter: _DecisionCounter) -> EngineEvent:
    """Run one step of ``core`` as an event (a ``"fail"`` one when the step raises)."""
    t0 = time.perf_counter()
    try:
        outputs = core.step()
    except Exception as e:  # one bad step must not stop the engine
        log.exception("engine step failed; aborting the requests in it")
        return EngineEvent("fail", error=f"the engine step failed: {type(e).__name__}: {e}")
    dt = time.perf_counter() - t0
    decisions = counter.new(core)
    if not outputs and not decisions:
        time.sleep(0.001)  # nothing could be scheduled (e.g. waiting for blocks): do not spin
    return EngineEvent("step", outputs, decisions, engine_gauges(core), _phases(core), dt)


class Frontend:
    """Tokenizing and chat rendering in the front-end process, with the engine's own code
    (:meth:`EngineCore.encode`, :meth:`EngineCore.render_chat` read only these two attributes)."""

    encode = EngineCore.encode
    render_chat = EngineCore.render_chat

    def __init__(self, tokenizer: Any, chat_template: str | None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template


# ---------------------------------------------------------------------------- in a thread


class ThreadDriver:
    """Steps ``core`` in the calling thread (see the module docstring)."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.info = engine_info(core)
        self.frontend: Any = core
        self._wake = threading.Event()
        self._counter = _DecisionCounter()
        self._aborts: list[str] = []
        self._lock = threading.Lock()

    def add(self, request_id: str, prompt: Any, params: Any, prompt_token_ids: Any, stream: bool) -> None:
        """Validate and queue now; raises ``ValueError`` for a bad request."""
        self.core.add_request(request_id, prompt, params, prompt_token_ids=prompt_token_ids, stream=stream)
        self._wake.set()

    def abort(self, ids: list[str]) -> None:
        with self._lock:
            self._aborts.extend(ids)
        self._wake.set()

    def next_event(self) -> EngineEvent:
        with self._lock:
            aborts, self._aborts = self._aborts, []
        if aborts:
            self.core.abort_request(aborts)
        if self.core.has_unfinished():
            return _step_event(self.core, self._counter)
        event = EngineEvent("idle", gauges=engine_gauges(self.core), phases=_phases(self.core))
        self._wake.wait(_IDLE_WAIT_S)
        self._wake.clear()
        return event

    def wake(self) -> None:
        self._wake.set()

    def close(self) -> None:
        self.core.close()


# ---------------------------------------------------------------------------- in a process


def _child_main(conn: Any, config: dict[str, Any]) -> None:
    """The engine process: build the engine, then step it while it has work and answer messages."""
    # Ctrl-C reaches the whole process group: the parent drains and then stops this process itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        core = EngineCore(EngineConfig(**config))
    except Exception as e:  # reported to the parent, which raises it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", engine_info(core)))
    counter = _DecisionCounter()
    slim = _Thinner()
    idle_sent = False
    try:
        while True:
            timeout = 0.0 if core.has_unfinished() else _IDLE_WAIT_S
            while conn.poll(timeout):
                timeout = 0.0
                msg = conn.recv()
                if msg[0] == "add":
                    _, rid, prompt, params, ids, stream = msg
                    try:
                        core.add_request(rid, prompt, params, prompt_token_ids=ids, stream=stream)
                    except ValueError as e:
                        conn.send(EngineEvent("reject", request_id=rid, error=str(e)))
                elif msg[0] == "abort":
                    core.abort_request(msg[1])
                    slim.forget(msg[1])
                elif msg[0] == "stop":
                    return
            if core.has_unfinished():
                # After a "fail" the parent aborts the requests it had, which ends them here.
                event = _step_event(core, counter)
                event.outputs = [slim.thin(o) for o in event.outputs]
                conn.send(event)
                idle_sent = False
            elif not idle_sent:
                conn.send(EngineEvent("idle", gauges=engine_gauges(core), phases=_phases(core)))
                idle_sent = True
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the parent is gone
    finally:
        core.close()


class _Thinner:
    """Child side: outputs cut down to what changed since the request's previous output (the
    prompt once, new tokens, their logprobs and times), so a step's message stays small whatever
    the sequences' lengths. :class:`_Thickener` rebuilds the full outputs in the parent."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def thin(self, out: RequestOutput) -> RequestOutput:
        first = out.request_id not in self._seen
        if out.finished:
            self._seen.discard(out.request_id)
        elif first:
            self._seen.add(out.request_id)
        comps = []
        for c in out.outputs:
            k = len(c.delta_token_ids)
            lps = c.logprobs[len(c.logprobs) - k :] if c.logprobs is not None else None
            comps.append(replace(c, text="", token_ids=[], logprobs=lps))
        k0 = len(out.outputs[0].delta_token_ids) if out.outputs else 0
        times = out.metrics.token_times
        metrics = replace(out.metrics, token_times=times[len(times) - k0 :] if k0 else [])
        return replace(
            out,
            prompt_token_ids=out.prompt_token_ids if first else [],
            prompt_logprobs=out.prompt_logprobs if first else None,
            outputs=comps,
            metrics=metrics,
        )

    def forget(self, ids: list[str]) -> None:
        self._seen.difference_update(ids)


@dataclass
class _Acc:
    prompt_token_ids: list[int]
    prompt_logprobs: Any
    token_times: list[float] = field(default_factory=list)
    texts: dict[int, str] = field(default_factory=dict)
    tokens: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[Any]] = field(default_factory=dict)


class _Thickener:
    """Parent side: the full (cumulative) outputs from :class:`_Thinner`'s, per request."""

    def __init__(self) -> None:
        self._acc: dict[str, _Acc] = {}

    def thicken(self, out: RequestOutput) -> RequestOutput:
        acc = self._acc.get(out.request_id)
        if acc is None:
            acc = self._acc[out.request_id] = _Acc(out.prompt_token_ids, out.prompt_logprobs)
        acc.token_times.extend(out.metrics.token_times)
        comps = []
        for c in out.outputs:
            text = acc.texts.get(c.index, "") + c.delta_text
            tokens = acc.tokens.setdefault(c.index, [])
            tokens.extend(c.delta_token_ids)
            acc.texts[c.index] = text
            lps = None
            if c.logprobs is not None:
                lps = acc.logprobs.setdefault(c.index, [])
                lps.extend(c.logprobs)
                lps = list(lps)
            comps.append(CompletionOutput(
                index=c.index, text=text, token_ids=list(tokens), finish_reason=c.finish_reason, logprobs=lps,
                stop_reason=c.stop_reason, delta_text=c.delta_text, delta_token_ids=c.delta_token_ids,
                cumulative_logprob=c.cumulative_logprob,
            ))  # fmt: skip
        if out.finished:
            del self._acc[out.request_id]
        return replace(
            out,
            prompt_token_ids=acc.prompt_token_ids,
            prompt_logprobs=acc.prompt_logprobs,
            outputs=comps,
            metrics=replace(out.metrics, token_times=list(acc.token_times)),
        )

    def forget(self, ids: list[str]) -> None:
        for rid in ids:
            self._acc.pop(rid, None)


class ProcessDriver:
    """Runs the engine in a spawned child process (see the module docstring).

    Args:
        config: the engine's options; ``config.model`` must be a name or path (a loaded model
            object does not cross processes).
        start_timeout_s: how long loading the model may take.
    Raises:
        ValueError: the engine could not be built (the child's error, naming the option).
    """

    def __init__(self, config: EngineConfig, start_timeout_s: float = 1800.0) -> None:
        if not isinstance(config.model, str):
            raise ValueError("model: an engine process needs a model name or path, not a loaded model")
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        kwargs = asdict(config)
        self._proc = ctx.Process(
            target=_child_main, args=(child, kwargs), name="flashpage-engine", daemon=True
        )
        self._proc.start()
        child.close()
        self._send_lock = threading.Lock()
        self._closed = False
        if not self._conn.poll(start_timeout_s):
            self._proc.kill()
            raise RuntimeError(f"the engine process did not start in {start_timeout_s:.0f} s")
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise RuntimeError(
                f"the engine process exited during start-up (code {self._proc.exitcode})"
            ) from None
        if kind == "error":
            self._proc.join(30)
            raise ValueError(payload)
        self.info: EngineInfo = payload
        self.frontend = Frontend(self.info.tokenizer, self.info.chat_template)
        self._thick = _Thickener()
        self._forget: list[str] = []

    def _send(self, msg: tuple[Any, ...]) -> None:
        with self._send_lock:
            if not self._closed:
                self._conn.send(msg)

    def add(self, request_id: str, prompt: Any, params: Any, prompt_token_ids: Any, stream: bool) -> None:
        """Queue in the engine process; a bad request comes back as a ``"reject"`` event."""
        self._send(("add", request_id, prompt, params, prompt_token_ids, stream))

    def abort(self, ids: list[str]) -> None:
        with self._send_lock:
            self._forget.extend(ids)
        with contextlib.suppress(OSError, ValueError):
            self._send(("abort", ids))

    def next_event(self) -> EngineEvent | None:
        """The child's next event; ``None`` after a quiet wait. Raises ``EOFError`` when it died.
        Call from one thread (the outputs are rebuilt from the child's deltas here)."""
        with self._send_lock:
            forget, self._forget = self._forget, []
        self._thick.forget(forget)
        if self._conn.poll(_IDLE_WAIT_S):
            event: EngineEvent = self._conn.recv()
            if event.kind == "step":
                event.outputs = [self._thick.thicken(o) for o in event.outputs]
            elif event.kind == "reject" and event.request_id is not None:
                self._thick.forget([event.request_id])
            return event
        if not self._proc.is_alive():
            raise EOFError(f"the engine process exited (code {self._proc.exitcode})")
        return None

    def wake(self) -> None:
        pass  # next_event never waits longer than _IDLE_WAIT_S

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._send(("stop",))
        self._closed = True
        self._proc.join(60)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)
        self._conn.close()
