"""``bench throughput``'s measured yardstick: the workload's bound from timed linears and attention
rates on this device, and ``frac_of_measured_bound`` in the row (CPU, tiny sizes)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from flashpage.bench.common import validate_rows
from flashpage.bench.measured_bound import measure_workload_bound
from flashpage.bench.throughput import main
from flashpage.roofline.model_shapes import ModelShape

SHAPE = ModelShape("tiny", hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=256)


def test_measured_bound_counts_every_step_at_its_exact_batch() -> None:
    calls: list[int] = []

    def one_ms(fn: Callable[[], Any]) -> float:  # every timed call takes 1 ms
        fn()
        calls.append(1)
        return 1.0

    ins, outs = [5, 9, 3], [4, 2, 7]
    b = measure_workload_bound(
        SHAPE, ins, outs, "cpu", torch.float32, max_batch_tokens=8, time_ms=one_ms, tiny_attention=True
    )
    # Rates at 1 ms: causal prefill 2 x 64 tokens, 4 heads, d 16; decode reads 2 x 2 heads x 64 tokens.
    attn_tflops = 4 * 2 * 4 * 64 * 64 * 16 / 2 / 1e9
    kv_tbps = 2 * (2 * 2 * 64 * 16) * 4 / 1e9
    assert b.prefill_attn_tflops == pytest.approx(attn_tflops) and b.decode_kv_tbps == pytest.approx(kv_tbps)
    # Prefill: 17 prompt tokens = 2 chunks of 8 + 1 token, 2 layers each; attention; lm head over 3.
    attn_ms = 2 * sum(4 * 4 * 16 * n * n / 2 for n in ins) / attn_tflops / 1e9
    assert b.prefill_s == pytest.approx((2 * 2 + 2 + attn_ms + 1) / 1e3)
    # Decode steps 1..6 at batches 3, 2, 2, 1, 1, 1: 2 layers + lm head each, plus the KV read.
    kv_tokens = [(5 + 1) + (9 + 1) + (3 + 1), 7 + 5, 8 + 6, 7, 8, 9]
    kv_ms = sum(t * 2 * 2 * 2 * 16 * 4 for t in kv_tokens) / kv_tbps / 1e9
    assert b.decode_s == pytest.approx((6 * 3 + kv_ms) / 1e3)
    assert b.total_s == pytest.approx(b.prefill_s + b.decode_s) and b.decode_batches == 3
    assert b.useful_tokens_per_s == pytest.approx(sum(outs) / b.total_s)
    # Each batch size is timed once: layers at 8, 1, 3, 2; lm head at 3, 2, 1; two attention rates.
    assert len(calls) == 9
    assert b.fraction_of_bound(b.useful_tokens_per_s / 2) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="output_lens"):
        measure_workload_bound(SHAPE, [1, 2], [1], "cpu", time_ms=one_ms)
    with pytest.raises(ValueError, match="every length"):
        measure_workload_bound(SHAPE, [1], [0], "cpu", time_ms=one_ms)


def test_smoke_run_reports_the_measured_bound_beside_the_analytic_one(tmp_path: Path) -> None:
    assert main(["--smoke", "--cpu", "--skip-hf", "--num-requests", "4", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "throughput-cpu.json").read_text())
    env, rows = data["env"], data["rows"]
    assert validate_rows(rows) == []
    (fp,) = rows
    mb = env["measured_bound"]
    assert mb["total_s"] == pytest.approx(mb["prefill_s"] + mb["decode_s"]) and mb["total_s"] > 0
    assert fp["frac_of_measured_bound"] == pytest.approx(fp["tokens_per_s"] / mb["useful_tokens_per_s"])
    assert fp["frac_of_roofline"] == pytest.approx(
        fp["tokens_per_s"] / env["analytic_bound"]["useful_tokens_per_s"]
    )
    assert env["profile"] == "cpu" and env["peak_tbps"] > 0  # this machine's roofline, not a datasheet
