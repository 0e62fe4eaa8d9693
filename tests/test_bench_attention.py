"""``flashpage bench attention``'s measurement plumbing: round-robin timing rounds and their rows."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from flashpage.bench.attention import Impl, Shape, impl_key, impl_rows, time_round_robin


def _impl(name: str, log: list[str], note: str = "", backward: bool = True) -> Impl:
    x = torch.ones(2, requires_grad=True)

    def fwd() -> torch.Tensor:
        log.append(f"{name}{note} fwd")
        return x * 2.0

    return Impl(name, fwd, (x, x, x), note=note, backward=backward)


def test_rounds_visit_every_implementation_in_turn() -> None:
    log: list[str] = []
    impls = [
        _impl("a", log),
        _impl("b", log, backward=False),
        _impl("t", log, note="m1"),
        _impl("t", log, note="m2"),
    ]
    clock = itertools.count(1)

    def time_ms(fn: Any) -> float:
        fn()
        return float(next(clock))

    times = time_round_robin(impls, torch.ones(2), time_ms, rounds=2, on_error=lambda i, e: None)
    # Round 1 times a (fwd, bwd), b (fwd), t/m1 and t/m2 (fwd, bwd): ticks 1-7; round 2: 8-14.
    assert times[impl_key(impls[0])] == [{"fwd": 1.0, "bwd": 2.0}, {"fwd": 8.0, "bwd": 9.0}]
    assert times[impl_key(impls[1])] == [{"fwd": 3.0}, {"fwd": 10.0}]
    assert times[impl_key(impls[2])] == [{"fwd": 4.0, "bwd": 5.0}, {"fwd": 11.0, "bwd": 12.0}]
    assert times[impl_key(impls[3])] == [{"fwd": 6.0, "bwd": 7.0}, {"fwd": 13.0, "bwd": 14.0}]
    assert len(times) == 4  # the two tutorial-style configs of one name stay apart
    assert log[:2] == ["a fwd", "a fwd"]  # a's timed forward, then the forward its backward needs


def test_failing_implementation_is_dropped_and_reported() -> None:
    log: list[str] = []
    good = _impl("a", log, backward=False)

    def broken() -> torch.Tensor:
        raise RuntimeError("unsupported shape")

    bad = Impl("bad", broken, (torch.ones(1),) * 3)
    errors: list[str] = []
    times = time_round_robin(
        [good, bad], torch.ones(2), lambda fn: (fn(), 1.0)[1], 3, lambda impl, e: errors.append(impl.name)
    )
    assert errors == ["bad"]  # reported once, not timed again in later rounds
    assert impl_key(bad) not in times and len(times[impl_key(good)]) == 3


def test_rows_keep_the_fastest_round_and_all_rounds() -> None:
    shape = Shape(batch=1, seqlen=1024, nheads=16, d=128, causal=False)
    impl = Impl("flashpage", lambda: torch.ones(1), (torch.ones(1),) * 3)
    rows, ok = impl_rows(impl, shape, (1e-3, 2e-3), [{"fwd": 2.0, "bwd": 5.0}, {"fwd": 1.5, "bwd": 6.0}])
    assert ok
    fwd, bwd = rows
    assert (fwd["pass"], fwd["ms"], fwd["ms_rounds"]) == ("fwd", 1.5, [2.0, 1.5])
    assert (bwd["pass"], bwd["ms"], bwd["ms_rounds"]) == ("bwd", 5.0, [5.0, 6.0])
    assert fwd["tflops"] == shape.fwd_flops / 1.5 / 1e9
    assert bwd["tflops"] == 2.5 * shape.fwd_flops / 5.0 / 1e9
    assert fwd["max_err"] == 1e-3 and bwd["max_err"] == 2e-3
    rows, ok = impl_rows(impl, shape, (0.5, 0.0), [{"fwd": 1.0}])
    assert not ok and [r["pass"] for r in rows] == ["fwd"]
