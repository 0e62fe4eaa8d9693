"""Incremental detokenization with stop strings (host side, one object per completion).

Decoding the whole output every step is quadratic; instead each step decodes only a short window:
``prefix`` = a few tokens already turned into text, ``read`` = the new tokens. The text of the new
tokens is ``decode(prefix + new) - decode(prefix)``, which keeps the spaces and merges that depend on
the previous token (SentencePiece leading spaces, byte-level BPE). A window whose text ends in the
replacement character ``U+FFFD`` is an incomplete UTF-8 sequence and waits for the next token.

Stop strings: after each step the new text is searched (including the characters before it that a
stop string could span); on a match the text is cut at the match (the stop string itself is left out
unless ``include_stop_str_in_output``). While streaming, the longest tail of the text that is a
prefix of some stop string is held back, so text that later turns out to be a stop string is never
emitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["IncrementalDetokenizer", "stop_holdback"]

# Prompt tokens kept as decoding context for the first output tokens.
_CONTEXT_TOKENS = 5


def stop_holdback(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``stops``."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class IncrementalDetokenizer:
    """Turns a completion's tokens into text one step at a time and detects stop strings.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode(ids, skip_special_tokens=...)``).
        prompt_token_ids: the prompt (its tail is the decoding context of the first tokens).
        skip_special_tokens: leave special tokens out of the text.
        stop: stop strings (may be empty).
        include_stop_str_in_output: keep the matched stop string in the text.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stops = tuple(stop)
        self._include_stop = include_stop_str_in_output
        self._max_stop = max((len(s) for s in self._stops), default=0)
        ctx = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._ids: list[int] = ctx  # decoding window: context + tokens not yet consumed
        self._prefix = 0  # self._ids[_prefix:_read] is already text
        self._read = len(ctx)
        self.text = ""  # the completion's text so far (cut at a stop string)
        self._emitted = 0  # characters of `text` handed out by `take_delta`
        self.stopped_by: str | None = None

    def add_tokens(self, token_ids: Sequence[int], check_stop: bool = True) -> str | None:
        """Append generated tokens; returns the stop string matched (then text is final), else ``None``.

        ``check_stop=False`` (below ``min_tokens``) appends without looking for stop strings."""
        if self.stopped_by is not None:
            return self.stopped_by
        self._ids.extend(token_ids)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        new_text = self._tok.decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            # Nothing printable yet (special token skipped, or an incomplete UTF-8 byte sequence).
            return None
        delta = new_text[len(prefix_text) :]
        # Slide the window: the consumed tokens become the next prefix; drop what is before it.
        self._ids = self._ids[self._read :]
        self._prefix, self._read = 0, len(self._ids)
        old_len = len(self.text)
        self.text += delta
        if self._stops and check_stop:
            return self._check_stop(old_len)
        return None

    def _check_stop(self, old_len: int) -> str | None:
        # A match must end inside the new text; it can start up to max_stop-1 characters before it.
        start = max(0, old_len - self._max_stop + 1)
        best_pos, best_stop = -1, None
        for s in self._stops:
            i = self.text.find(s, start)
            if i >= 0 and (best_pos < 0 or i < best_pos):
                best_pos, best_stop = i, s
        if best_stop is None:
            return None
        cut = best_pos + len(best_stop) if self._include_stop else best_pos
        self.text = self.text[:cut]
        self._emitted = min(self._emitted, cut)
        self.stopped_by = best_stop
        return best_stop

    def take_delta(self, final: bool) -> str:
        """Text not handed out yet; holds back a possible stop-string prefix unless ``final``."""
        end = len(self.text)
        if not final and self._stops:
            end -= stop_holdback(self.text, self._stops)
        if end <= self._emitted:
            return ""
        out = self.text[self._emitted : end]
        self._emitted = end
        return out

    @property
    def emitted_text(self) -> str:
        """The text handed out so far by :meth:`take_delta`."""
        return self.text[: self._emitted]
