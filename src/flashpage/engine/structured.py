"""Structured output: grammar-constrained sampling on ``xgrammar`` (JSON schema, regex, JSON object).

One :class:`StructuredOutputs` lives on an engine (it holds the tokenizer's vocabulary info and the
grammar compiler with its cache). Per request the constraint of
:attr:`SamplingParams.guided <flashpage.engine.sampling_params.SamplingParams.guided>` is compiled
once (:meth:`StructuredOutputs.compile`, at ``add_request``, so a bad schema fails there); every
completion gets its own matcher. Each step the engine fills one bitmask row per constrained
sequence (:meth:`StructuredOutputs.fill_bitmask`, host side), the sampler applies it to the logits on
their device before sampling, and the engine advances the matcher with the sampled token; the
completion ends when the grammar is complete (EOS is only allowed then).

``xgrammar`` is imported lazily: an engine that never sees a constrained request does not need it.
"""

from __future__ import annotations

import math
import re
import threading
from typing import Any

import torch
from torch import Tensor

__all__ = ["StructuredOutputs"]


def _import_xgrammar(field: str) -> Any:
    try:
        import xgrammar
    except ImportError:
        raise ValueError(
            f"{field}: structured output needs the 'xgrammar' package (pip install 'flashpage[serve]')"
        ) from None
    return xgrammar


class StructuredOutputs:
    """Grammar compiler and bitmask filling for one engine's tokenizer.

    Args:
        tokenizer: a Hugging Face tokenizer (``None``: constrained requests are rejected).
        vocab_size: the model's logits width (may exceed the tokenizer's vocabulary; extra ids are
            never allowed).
        stop_token_ids: token ids that end a completion (EOS); allowed once the grammar is complete.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = sorted(stop_token_ids)
        self.bitmask_width = math.ceil(self.vocab_size / 32)
        self._compiler: Any = None
        self._lock = threading.Lock()  # add_request (and so compile) may run on several threads

    def _get_compiler(self, field: str) -> Any:
        xgr = _import_xgrammar(field)
        if self.tokenizer is None:
            raise ValueError(f"{field}: structured output needs a model with a tokenizer")
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
                )
                self._compiler = xgr.GrammarCompiler(info)
            return self._compiler

    def compile(self, guided: tuple[str, str]) -> Any:
        """Compile ``SamplingParams.guided`` (``(field, spec)``); cached by the compiler.

        JSON is compact (no free whitespace between tokens): with free whitespace a model, small ones
        above all, can spend its whole budget on blanks and never close the object.

        Raises:
            ValueError: naming the field, for a schema or pattern xgrammar rejects, or a missing
                package / tokenizer.
        """
        field, spec = guided
        compiler = self._get_compiler(field)
        try:
            if field == "guided_json":
                return compiler.compile_json_schema(spec, any_whitespace=False)
            if field == "guided_regex":
                return compiler.compile_regex(spec)
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        except Exception as e:  # xgrammar raises RuntimeError / its own errors for bad input
            text = str(e).strip()
            msg = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text.splitlines()[0]) if text else type(e).__name__
            raise ValueError(f"{field}: cannot compile the constraint ({msg})") from None

    def new_matcher(self, compiled: Any) -> Any:
        """A fresh matcher (one per completion) at the grammar's start."""
        xgr = _import_xgrammar("guided_json")
        return xgr.GrammarMatcher(compiled)

    def fill_bitmask(self, matchers: list[Any], device: torch.device) -> Tensor | None:
        """``(N, ceil(V / 32))`` int32 bitmask on ``device``, row ``i`` from ``matchers[i]`` (all ones
        for ``None``: unconstrained); ``None`` when no row is constrained."""
        if all(m is None for m in matchers):
            return None
        mask = torch.full((len(matchers), self.bitmask_width), -1, dtype=torch.int32)
        for i, m in enumerate(matchers):
            if m is not None:
                m.fill_next_token_bitmask(mask, i)
        return mask.to(device)
