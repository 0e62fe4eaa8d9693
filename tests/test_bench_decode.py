"""``flashpage bench decode --smoke``: the whole script on tiny shapes (CPU: the Triton interpreter).

Checks what the committed H200 results rely on: every decode shape gets a ``planner`` row for the
compute dtype and for fp8 KV, timed with the configuration the engine would run (the defaults), every
row matched SDPA, and the prefill rows carry their ratio to the flash kernel.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from flashpage.bench.decode import block_manager_table, main
from flashpage.ops.paged_decode import default_decode_config
from flashpage.ops.paged_prefill import default_prefill_config


def test_smoke_run_writes_default_config_rows(tmp_path: Path) -> None:
    assert main(["--smoke", "--out", str(tmp_path)]) == 0  # 0: every implementation matched SDPA
    (path,) = tmp_path.glob("decode-*.json")
    data = json.loads(path.read_text())
    env, rows = data["env"], list(data["rows"])
    assert {r["bench"] for r in rows} == {"decode"}
    (prefill_path,) = tmp_path.glob("prefill-*.json")  # one file per (bench, GPU)
    rows += json.loads(prefill_path.read_text())["rows"]
    for key in ("gpu", "torch", "triton", "date", "git_commit", "copy_tbps", "profile"):
        assert key in env, key
    assert all(r["frac_of_roofline"] > 0 for r in rows if not r.get("status"))
    decode = [r for r in rows if r["bench"] == "decode" and r["impl"] == "flashpage"]
    shapes = {(r["batch"], r["ctx"], r["nheads"], r["nheads_k"], r["d"]) for r in decode}
    assert len(shapes) == 2
    for shape in shapes:
        mine = [r for r in decode if (r["batch"], r["ctx"], r["nheads"], r["nheads_k"], r["d"]) == shape]
        planner = {r["dtype"]: r for r in mine if r["variant"] == "planner"}
        assert {r["variant"] for r in mine} >= {"planner", "block-manager", "contiguous"}
        assert set(planner) == {"bfloat16" if torch.cuda.is_available() else "float32", "fp8_e4m3"}
        d = shape[-1]
        fp8 = planner["fp8_e4m3"]
        assert fp8["config"] == default_decode_config(torch.float8_e4m3fn, d).short()
        assert fp8["ratio_vs_bf16"] > 0 and fp8["tbps"] > 0
        for r in mine:
            assert r["max_err"] < 1e-2, r
            assert r["ms"] == min(r["ms_rounds"]) and len(r["ms_rounds"]) == 1  # --smoke: one round
    prefill = {r["variant"]: r for r in rows if r["bench"] == "prefill" and r["impl"] == "flashpage"}
    paged = prefill["paged-prefill"]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    assert paged["config"] == default_prefill_config(paged["d"], dev, dtype, paged["block_size"]).short()
    assert paged["ratio_vs_flash"] > 0 and "flash-varlen" in prefill


def test_rows_are_timed_round_robin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row of a shape is timed once per round, all rows in turn, and keeps its fastest round."""
    import flashpage.bench.decode as bench

    calls: list[tuple[int, list[int]]] = []  # per shape: (rows, the order they were timed in)
    real = bench.round_robin

    def spy(items: list, measure: Callable, rounds: int, on_error: Callable) -> list:
        seen: list[int] = []
        calls.append((len(items), seen))

        def traced(item: tuple) -> float:
            seen.append(id(item))
            return measure(item)

        return real(items, traced, rounds, on_error)

    monkeypatch.setattr(bench, "round_robin", spy)
    assert main(["--smoke", "--rounds", "2", "--out", str(tmp_path)]) == 0
    assert len(calls) == 3  # one per decode shape, one per prefill shape
    for n, seen in calls:
        assert n >= 2 and len(seen) == 2 * n and seen[:n] == seen[n:] and len(set(seen)) == n
    rows = [r for f in sorted(tmp_path.glob("*-*.json")) for r in json.loads(f.read_text())["rows"]]
    assert {r["bench"] for r in rows} == {"decode", "prefill"}
    assert all(len(r["ms_rounds"]) == 2 and r["ms"] == min(r["ms_rounds"]) for r in rows)
    paged = next(r for r in rows if r.get("variant") == "paged-prefill")
    flash = next(r for r in rows if r.get("variant") == "flash-varlen")
    assert paged["ratio_vs_flash"] == flash["ms"] / paged["ms"]


def test_block_manager_table_is_ascending_runs() -> None:
    """Prompts are one ascending run each, then the lockstep decode interleaves one block per
    sequence per round: every block used once, each row ascending."""
    t = block_manager_table(3, 64, 8)  # prompts of 16 tokens (2 blocks), then 6 blocks each
    assert t.shape == (3, 8) and t.dtype == torch.int32
    assert sorted(t.flatten().tolist()) == list(range(24))
    assert t[:, :2].tolist() == [[0, 1], [2, 3], [4, 5]]
    assert t[:, 2].tolist() == [6, 7, 8] and t[0, 3:].tolist() == [9, 12, 15, 18, 21]
    with pytest.raises(ValueError, match="multiple of block_size"):
        block_manager_table(1, 60, 8)
