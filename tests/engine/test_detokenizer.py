"""Incremental detokenization and stop strings with a byte-level toy tokenizer."""

from __future__ import annotations

from collections.abc import Sequence

from flashpage.engine.detokenizer import IncrementalDetokenizer, stop_holdback


class ByteTok:
    """Token i = a byte string; decode joins bytes and decodes UTF-8 with replacement (like BPE)."""

    def __init__(self, pieces: list[bytes], special: Sequence[int] = ()) -> None:
        self.pieces = pieces
        self.special = set(special)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        data = b"".join(self.pieces[i] for i in ids if not (skip_special_tokens and i in self.special))
        return data.decode("utf-8", errors="replace")

    def ids(self, *texts: bytes) -> list[int]:
        out = []
        for t in texts:
            if t not in self.pieces:
                self.pieces.append(t)
            out.append(self.pieces.index(t))
        return out


def _run(tok: ByteTok, chunks: list[bytes], stop: Sequence[str] = (), include: bool = False) -> tuple[list[str], IncrementalDetokenizer]:  # fmt: skip
    prompt = tok.ids(b"prompt: ")
    d = IncrementalDetokenizer(tok, prompt, stop=stop, include_stop_str_in_output=include)
    deltas = []
    for c in chunks:
        hit = d.add_tokens(tok.ids(c))
        deltas.append(d.take_delta(final=hit is not None))
        if hit is not None:
            break
    return deltas, d


def test_plain_text_and_utf8_split() -> None:
    tok = ByteTok([b"<eos>"], special=[0])
    deltas, d = _run(tok, [b"caf", b"\xc3", b"\xa9", b" ok", b"<eos>"])
    assert deltas == ["caf", "", "é", " ok", ""]
    assert d.text == "café ok" and d.stopped_by is None


def test_stop_string_across_token_boundaries_is_cut() -> None:
    tok = ByteTok([])
    deltas, d = _run(tok, [b"Hel", b"lo W", b"orld"], stop=["o Wo"])
    assert d.stopped_by == "o Wo"
    assert d.text == "Hell"
    assert "".join(deltas) == "Hell"
    _, d2 = _run(ByteTok([]), [b"Hel", b"lo W", b"orld"], stop=["o Wo"], include=True)
    assert d2.text == "Hello Wo"


def test_streaming_holds_back_possible_stop_prefix() -> None:
    deltas, d = _run(ByteTok([]), [b"abc S", b"TO", b"P", b"more"], stop=["STOP"])
    assert deltas == ["abc ", "", ""]  # "S", "STO" held back; then the stop matches
    assert d.text == "abc " and d.stopped_by == "STOP"
    deltas, d = _run(ByteTok([]), [b"abc S", b"x", b"yz"], stop=["STOP"])
    assert deltas == ["abc ", "Sx", "yz"]  # released once it cannot be a stop string
    assert d.text == "abc Sxyz" and d.stopped_by is None


def test_earliest_of_several_stops_wins() -> None:
    _, d = _run(ByteTok([]), [b"one two three"], stop=["three", "two"])
    assert d.stopped_by == "two" and d.text == "one "


def test_stop_holdback() -> None:
    assert stop_holdback("hello wor", ["world", "xyz"]) == 3
    assert stop_holdback("hello", ["world"]) == 0
    assert stop_holdback("ab", ["abc", "b"]) == 2
