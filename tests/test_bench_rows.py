"""Result rows: the schema, the roofline fraction, missing/failed rows and the OOM batch fallback."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flashpage.bench.common import (
    failure_reason,
    is_oom,
    roofline_fraction,
    run_with_batch_fallback,
    status_row,
    validate_rows,
)
from flashpage.bench.throughput import run_hf_baseline
from flashpage.roofline.hardware import load_profile


def _ok(**kw: Any) -> dict[str, Any]:
    return {"bench": "decode", "impl": "flashpage", "ms": 1.0, "tbps": 3.0, "frac_of_roofline": 0.9, **kw}


def test_validate_rows_accepts_measured_and_status_rows_and_names_what_is_wrong() -> None:
    good = [_ok(), status_row("decode", "flashinfer", "missing", "flashinfer is not importable", batch=1)]
    assert validate_rows(good) == []
    assert good[1]["status"] == "missing" and good[1]["batch"] == 1
    bad = [
        _ok(bench="nope"),
        _ok(frac_of_roofline=None),
        _ok(frac_of_roofline=float("nan")),
        {"bench": "decode", "impl": "x", "frac_of_roofline": 0.5},  # no figure
        {"bench": "decode", "impl": "x", "status": "failed"},  # no reason
        _ok(status="weird"),
        _ok(impl=""),
    ]
    problems = validate_rows(bad)
    assert len(problems) == len(bad)
    assert "bench must be one of" in problems[0] and "frac_of_roofline" in problems[1]
    assert "no measured figure" in problems[3] and "needs a reason" in problems[4]
    assert "unknown status" in problems[5] and "impl missing" in problems[6]
    with pytest.raises(ValueError, match="status"):
        status_row("decode", "x", "broken", "why")


def test_roofline_fraction_takes_the_binding_ceiling() -> None:
    prof = load_profile("h100-sxm")  # 989.4 TFLOP/s bf16, 3.35 TB/s
    # Memory-bound (decode-like): 1 GFLOP, 1 GB in 0.5 ms -> 2 TB/s of 3.35.
    assert roofline_fraction(1e9, 1e9, 5e-4, prof) == pytest.approx(2e12 / 3.35e12)
    # Compute-bound (prefill-like): 500 TFLOP/s of 989.4.
    assert roofline_fraction(5e11, 1e8, 1.0, prof) == pytest.approx(5e11 / 989.4e12)
    with pytest.raises(ValueError, match="seconds"):
        roofline_fraction(1.0, 1.0, 0.0, prof)


def test_is_oom_and_failure_reason() -> None:
    assert is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert is_oom(RuntimeError("CUDA error: out of memory"))
    assert not is_oom(RuntimeError("shape mismatch")) and not is_oom(ValueError("out of memory"))
    assert failure_reason(RuntimeError("CUDA error: out of memory\nmore")) == (
        "out of memory: RuntimeError: CUDA error: out of memory"
    )


def test_batch_fallback_halves_until_it_fits() -> None:
    tried: list[int] = []
    freed: list[int] = []

    def run(b: int) -> str:
        tried.append(b)
        if b > 48:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory at batch {b}")
        return f"ran {b}"

    assert run_with_batch_fallback(run, 256, free=lambda: freed.append(1)) == ("ran 32", 32, [256, 128, 64])
    assert tried == [256, 128, 64, 32] and len(freed) == 3

    def never(b: int) -> None:
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError):  # batch 1 does not fit either: the error propagates
        run_with_batch_fallback(never, 4, free=lambda: None)

    def broken(b: int) -> None:
        raise ValueError("not an OOM")

    with pytest.raises(ValueError):  # other errors are not retried
        run_with_batch_fallback(broken, 4)


def _fake_generate(limit: int, calls: list[tuple[int, int]]) -> Any:
    """A stand-in for HF generate that runs out of memory above ``limit`` prompts."""

    def generate(prompts: list[list[int]], max_new: int) -> dict[str, Any]:
        calls.append((len(prompts), max_new))
        if len(prompts) > limit:
            raise RuntimeError(f"CUDA out of memory. Tried to allocate {len(prompts)} GiB")
        return {"elapsed_s": 1.0, "new_tokens": max_new, "ttft_s": 0.25, "itl_s": [0.01] * (max_new - 1)}

    return generate


def test_hf_baseline_falls_back_to_the_largest_batch_that_fits_and_says_so() -> None:
    prompts = [[1, 2, 3]] * 8
    outs = [4, 2, 6, 3, 5, 5, 1, 2]
    base = {"bench": "throughput", "model": "m", "dtype": "bfloat16", "batch": 8}
    calls: list[tuple[int, int]] = []
    row = run_hf_baseline(_fake_generate(2, calls), prompts, outs, base)
    # 8 and 4 ran out of memory; 2 fits: four consecutive batches, each to its longest request.
    assert calls == [(8, 6), (4, 6), (2, 4), (2, 6), (2, 5), (2, 2)]
    assert row["impl"] == "hf-generate" and row["static_batch"] == 2 and row["batch"] == 8
    assert "out of memory at static batch 8, 4" in row["note"] and "4 consecutive batches of 2" in row["note"]
    assert row["elapsed_s"] == 4.0 and row["tokens_per_s"] == sum(outs) / 4.0
    assert row["ttft_ms_p50"] in (1250.0, 2250.0)  # a request's TTFT counts the batches before its own
    assert row["ttft_ms_p99"] == 3250.0
    row["frac_of_roofline"] = 0.1
    assert validate_rows([row]) == []


def test_hf_baseline_that_cannot_run_is_a_failed_row() -> None:
    base = {"bench": "throughput", "model": "m", "dtype": "bfloat16", "batch": 2}
    row = run_hf_baseline(_fake_generate(0, []), [[1]] * 2, [3, 3], base)
    assert row["status"] == "failed" and row["impl"] == "hf-generate" and "out of memory" in row["reason"]
    assert validate_rows([row]) == []
