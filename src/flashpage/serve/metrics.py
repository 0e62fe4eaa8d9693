"""Prometheus metrics of the server (vLLM's names under the ``flashpage:`` prefix) and the live
summary that the page at ``/`` polls.

Every metric lives in the server's own ``CollectorRegistry`` (two servers in one process do not
share counters). Updates come from the engine thread through :meth:`ServerMetrics.observe`, the
:class:`~flashpage.engine.async_llm.AsyncLLM` observer; ``prometheus_client`` is thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from flashpage.engine.async_llm import EngineGauges, StepReport

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (seconds), so dashboards built for vLLM read ours unchanged.
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)
# How far back the page's tokens/s and TTFT figures look.
_WINDOW_S = 10.0


class ServerMetrics:
    """The server's metrics.

    Args:
        model_name: the ``model_name`` label on every metric, as vLLM labels them.
    """

    def __init__(self, model_name: str = "") -> None:
        # One series per metric, as vLLM exposes them (no "_created" twins).
        prometheus_client.disable_created_metrics()
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.model_name = model_name
        self.num_requests_running = Gauge(
            "flashpage:num_requests_running", "Requests in the running batch.", m, registry=r
        )
        self.num_requests_waiting = Gauge(
            "flashpage:num_requests_waiting", "Requests waiting to be scheduled.", m, registry=r
        )
        self.kv_cache_usage_perc = Gauge(
            "flashpage:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", m, registry=r
        )
        self.prefix_cache_hit_rate = Gauge(
            "flashpage:prefix_cache_hit_rate",
            "Fraction of looked-up prompt blocks found in the prefix cache.",
            m,
            registry=r,
        )
        self.num_preemptions = Counter(
            "flashpage:num_preemptions", "Sequences preempted (recomputed later).", m, registry=r
        )
        self.prompt_tokens = Counter("flashpage:prompt_tokens", "Prompt tokens processed.", m, registry=r)
        self.generation_tokens = Counter("flashpage:generation_tokens", "Tokens generated.", m, registry=r)
        self.request_success = Counter(
            "flashpage:request_success",
            "Finished requests by finish reason.",
            [*m, "finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "flashpage:time_to_first_token_seconds",
            "Time to first token.",
            m,
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "flashpage:inter_token_latency_seconds",
            "Time between consecutive output tokens.",
            m,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "flashpage:e2e_request_latency_seconds",
            "Request latency from arrival to its last token.",
            m,
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "flashpage:request_queue_time_seconds",
            "Time from arrival to first scheduling.",
            m,
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.roofline_steps = Counter(
            "flashpage:roofline_steps",
            "Engine steps by phase and the attention kernel and split-KV count the roofline planner chose.",
            [*m, "phase", "kernel", "num_splits"],
            registry=r,
        )
        self._lock = threading.Lock()
        self._gauges = EngineGauges()
        self._last_preemptions = 0
        self._tokens: deque[tuple[float, int]] = deque()  # (time, tokens generated that step)
        self._ttfts: deque[tuple[float, float]] = deque()
        self._decisions: dict[str, dict[str, Any]] = {}

    # ------------------------------------------------------------------ updates (engine thread)

    def observe(self, report: StepReport) -> None:
        """Record one :class:`StepReport` (the AsyncLLM observer)."""
        name = self.model_name
        g = report.gauges
        self.num_requests_running.labels(name).set(g.num_running)
        self.num_requests_waiting.labels(name).set(g.num_waiting)
        self.kv_cache_usage_perc.labels(name).set(g.kv_usage)
        self.prefix_cache_hit_rate.labels(name).set(g.prefix_cache_hit_rate)
        now = time.time()
        # Per-request work is kept to plain arithmetic; each metric is touched once per step
        # (this runs in the engine thread, between steps).
        new_tokens = new_prompt = 0
        ttfts: list[float] = []
        queue_times: list[float] = []
        itls: list[float] = []
        e2es: list[float] = []
        reasons: dict[str, int] = {}
        for out in report.outputs:
            m = out.metrics
            delta = sum(len(c.delta_token_ids) for c in out.outputs)
            if delta:
                new_tokens += delta
                if m.num_generation_tokens == delta:  # the request's first tokens
                    new_prompt += len(out.prompt_token_ids)
                    if m.ttft is not None:
                        ttfts.append(m.ttft)
                    if m.time_in_queue is not None:
                        queue_times.append(m.time_in_queue)
                k = len(out.outputs[0].delta_token_ids)
                tt = m.token_times
                itls.extend(tt[i] - tt[i - 1] for i in range(max(1, len(tt) - k), len(tt)))
            if out.finished:
                if m.e2e_latency is not None:
                    e2es.append(m.e2e_latency)
                for c in out.outputs:
                    r = c.finish_reason or "abort"
                    reasons[r] = reasons.get(r, 0) + 1
        if new_tokens:
            self.generation_tokens.labels(name).inc(new_tokens)
        if new_prompt:
            self.prompt_tokens.labels(name).inc(new_prompt)
        for hist, values in (
            (self.ttft, ttfts),
            (self.queue_time, queue_times),
            (self.itl, itls),
            (self.e2e, e2es),
        ):
            if values:
                child = hist.labels(name)
                for v in values:
                    child.observe(v)
        for r, n in reasons.items():
            self.request_success.labels(name, r).inc(n)
        with self._lock:
            if g.num_preemptions > self._last_preemptions:
                self.num_preemptions.labels(name).inc(g.num_preemptions - self._last_preemptions)
                self._last_preemptions = g.num_preemptions
            self._gauges = g
            self._ttfts.extend((now, t) for t in ttfts)
            if new_tokens:
                self._tokens.append((now, new_tokens))
            while self._tokens and self._tokens[0][0] < now - _WINDOW_S:
                self._tokens.popleft()
            while self._ttfts and self._ttfts[0][0] < now - _WINDOW_S * 6:
                self._ttfts.popleft()
            for (phase, kernel, splits), steps in report.decisions.items():
                self.roofline_steps.labels(name, phase, kernel, str(splits)).inc(steps)
                self._decisions[phase] = {"kernel": kernel, "num_splits": splits, "time": now}

    # ------------------------------------------------------------------ reads

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)

    def summary(self) -> dict[str, Any]:
        """The live figures of the page: load, KV use, tokens/s and TTFT over the last seconds."""
        now = time.time()
        with self._lock:
            g = self._gauges
            toks = [n for t, n in self._tokens if t >= now - _WINDOW_S]
            ttfts = sorted(v for _, v in self._ttfts)
            decisions = {k: dict(v) for k, v in self._decisions.items()}
        first = next((t for t, _ in self._tokens if t >= now - _WINDOW_S), None)
        span = max(1.0, now - first) if first is not None else _WINDOW_S
        return {
            "num_requests_running": g.num_running,
            "num_requests_waiting": g.num_waiting,
            "kv_cache_usage_perc": g.kv_usage,
            "kv_blocks_used": g.kv_blocks_used,
            "kv_blocks_total": g.kv_blocks_total,
            "prefix_cache_hit_rate": g.prefix_cache_hit_rate,
            "num_preemptions": g.num_preemptions,
            "generation_tokens_per_s": sum(toks) / span if toks else 0.0,
            "ttft_ms_p50": 1e3 * ttfts[len(ttfts) // 2] if ttfts else None,
            "last_decisions": decisions,
        }
