"""flashpage: roofline-driven LLM attention and inference.

Public API (imported lazily so ``import flashpage`` and ``flashpage --help`` stay fast):

* ``flash_attn_func``, ``flash_attn_varlen_func``, ``flash_attn_with_kvcache`` — flash-attn 2.x
  compatible attention (Triton kernels on GPU, PyTorch reference path on CPU).
* ``LLM``, ``AsyncLLM``, ``SamplingParams``, ``RequestOutput``, ``CompletionOutput``, ``Logprob`` — the vLLM-style engine.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "flash_attn_func": "flashpage.ops.flash_attn",
    "flash_attn_varlen_func": "flashpage.ops.flash_attn",
    "flash_attn_with_kvcache": "flashpage.ops.kvcache",
    "LLM": "flashpage.engine.llm",
    "AsyncLLM": "flashpage.engine.async_llm",
    "SamplingParams": "flashpage.engine.sampling_params",
    "RequestOutput": "flashpage.engine.outputs",
    "CompletionOutput": "flashpage.engine.outputs",
    "Logprob": "flashpage.engine.outputs",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flashpage' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)
