"""The inference engine: continuous batching over a paged KV cache (vLLM-style API).

* :class:`~flashpage.engine.llm.LLM` — offline ``generate`` / ``chat`` / ``stats``.
* :class:`~flashpage.engine.async_llm.AsyncLLM` — the asyncio streaming API the server uses.
* :class:`~flashpage.engine.engine_core.EngineCore` — ``add_request`` / ``abort_request`` /
  ``step()`` returning incremental outputs (what the server drives).
* :class:`~flashpage.engine.sampling_params.SamplingParams`, :class:`~flashpage.engine.outputs.RequestOutput`,
  :class:`~flashpage.engine.outputs.CompletionOutput`, :class:`~flashpage.engine.outputs.Logprob`.

Layout: ``scheduler.py`` (continuous batching, chunked prefill, preemption), ``model_runner.py``
(batch flattening, roofline plan, CUDA graphs, KV cache sizing), ``sampler.py`` (on-device sampling),
``sequence.py`` (state), ``detokenizer.py`` (incremental text, stop strings), ``structured.py``
(grammar-constrained output on xgrammar).
"""

from __future__ import annotations

from flashpage.engine.async_llm import AsyncLLM
from flashpage.engine.engine_core import EngineConfig, EngineCore
from flashpage.engine.llm import LLM
from flashpage.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from flashpage.engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineCore",
    "Logprob",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
]
