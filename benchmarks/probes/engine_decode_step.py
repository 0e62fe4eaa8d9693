"""Probe (not part of the library): the engine's decode step time, and the paged launch it runs.

Times ``ModelRunner.execute`` for one-token decode steps of a Llama-3-8B-shaped model with dummy
weights (bf16, GQA 32/8, d=128), eagerly and replayed from CUDA graphs, and prints the split-KV
count and KV heads per program of the decode plans the step builds. Cases: b32 and b64 at a 4k
context (all 32 layers), and b32 at 32k with fewer layers (its KV cache would not fit otherwise;
the per-layer decode cost is what matters).

It uses whatever ``flashpage`` is importable, so one GPU call can time two trees::

    for tree in /path/old /path/new; do PYTHONPATH=$tree/src python benchmarks/probes/engine_decode_step.py; done

Options: ``--steps N`` (timed steps per case, default 20), ``--cases b32c4k,b64c4k,b32c32k``,
``--layers-32k L`` (layers of the 32k case, default 8), ``--tiny`` (a 2-layer toy on CPU under the
Triton interpreter: checks the script, times nothing meaningful). Writes ``engine_decode_step.json``
under ``$OUT`` (or the current directory).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from types import SimpleNamespace
from typing import Any

import torch

CASES = {"b32c4k": (32, 4096, 0), "b64c4k": (64, 4096, 0), "b32c32k": (32, 32768, 8)}


def _arg(name: str, default: str) -> str:
    if name in sys.argv:
        return sys.argv[sys.argv.index(name) + 1]
    return default


def _record_plans(plans: list[Any]) -> None:
    """Record every decode plan the step builds (the engine's, or the attention dispatch's)."""
    import flashpage.engine.model_runner as mr
    import flashpage.ops.dispatch as dispatch
    import flashpage.ops.paged_plan as pp

    real = pp.plan_decode

    def recording(*args: Any, **kwargs: Any) -> Any:
        plan = real(*args, **kwargs)
        plans.append(plan)
        return plan

    for mod in (mr, dispatch):
        if hasattr(mod, "plan_decode"):
            mod.plan_decode = recording


def _describe(plan: Any) -> str:
    return (
        f"batch {plan.batch} splits {plan.num_splits} heads/program {plan.config.heads_per_program} "
        f"block_n {plan.config.block_n} grid {tuple(plan.grid)}"
    )


def _graph_launch(runner: Any, batch: int, ctx: int, splits: int) -> str:
    """The launch of the CUDA graph a decode step of ``batch`` x ``ctx`` replays."""
    if hasattr(runner, "_decode_choice"):  # graphs keyed by (bucket, heads per program, splits)
        g = runner._find_graph(batch, runner._decode_choice(batch, ctx))
        return "graph: " + _describe(g.meta.decode_plan)
    g = runner._find_graph(batch, splits)  # graphs keyed by (bucket, splits)
    return f"graph: bucket {g.batch} splits {g.num_splits} (heads/program as the planner gives for them)"


def run_case(
    name: str, batch: int, ctx: int, layers: int, graphs: bool, steps: int, tiny: bool
) -> dict[str, Any]:
    from flashpage.engine.model_runner import ModelRunner, RunnerConfig
    from flashpage.engine.scheduler import ScheduledSeq
    from flashpage.models.config import get_builtin_config
    from flashpage.models.loader import load_model

    dev = torch.device("cpu" if tiny else "cuda")
    dtype = torch.float32 if tiny else torch.bfloat16
    cfg = get_builtin_config("llama-3-8b")
    changes: dict[str, Any] = {"max_position_embeddings": max(ctx + 64, cfg.max_position_embeddings)}
    if layers:
        changes["num_layers"] = layers
    if tiny:
        changes.update(
            num_layers=2,
            hidden_size=128,
            intermediate_size=256,
            vocab_size=256,
            num_heads=8,
            num_kv_heads=2,
            head_dim=32,
            bos_token_id=1,
            eos_token_ids=(2,),
        )
    cfg = dataclasses.replace(cfg, **changes)
    loaded = load_model("llama-3-8b", dtype=dtype, device=dev, load_format="dummy", config=cfg, seed=0)
    bs = 16
    nblk = -(-ctx // bs)
    per_block = 2 * cfg.num_layers * bs * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8
    runner = ModelRunner(
        loaded.model, cfg, device=dev, dtype=dtype, profile=None,
        config=RunnerConfig(block_size=bs, max_num_seqs=batch, max_num_batched_tokens=batch,
                            max_model_len=ctx + bs, kv_cache_bytes=(batch * nblk + 2) * per_block,
                            enforce_eager=not graphs),
    )  # fmt: skip
    if tiny and graphs:
        runner.capture_graphs(emulate=True)
    plans: list[Any] = []
    _record_plans(plans)
    seqs = [
        SimpleNamespace(token_ids=[1] * ctx, block_table=list(range(i * nblk, (i + 1) * nblk)))
        for i in range(batch)
    ]
    scheduled = [ScheduledSeq(s, ctx - 1, 1, True) for s in seqs]  # type: ignore[arg-type]
    for _ in range(3):  # warm-up: compiles, binds
        runner.execute(scheduled)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        runner.execute(scheduled)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / steps * 1e3
    dec = runner.decisions["decode"].as_dict()
    launched = _describe(plans[-1]) if plans else "(no plan recorded)"
    if dec["graph_steps"]:
        launched = _graph_launch(runner, batch, ctx, dec["num_splits"])
    row = {"case": name, "batch": batch, "ctx": ctx, "layers": cfg.num_layers, "graphs": graphs,
           "ms_per_step": round(ms, 4), "graph_steps": dec["graph_steps"], "steps": dec["steps"],
           "recorded_num_splits": dec["num_splits"], "launch": launched}  # fmt: skip
    print(
        f"{name:8s} layers {cfg.num_layers:2d} {'graphs' if graphs else 'eager ':6s} {ms:9.3f} ms/step  "
        f"graph steps {dec['graph_steps']}/{dec['steps']}  recorded splits {dec['num_splits']}  {launched}",
        flush=True,
    )
    runner.close()
    del runner, loaded
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    tiny = "--tiny" in sys.argv
    if tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("FLASHPAGE_BACKEND", "triton")
    steps = int(_arg("--steps", "2" if tiny else "20"))
    names = _arg("--cases", "b32c4k" if tiny else ",".join(CASES)).split(",")
    layers_32k = int(_arg("--layers-32k", "8"))
    import flashpage

    print(f"flashpage from {os.path.dirname(flashpage.__file__)}", flush=True)
    rows = []
    for name in names:
        batch, ctx, layers = CASES[name]
        if tiny:
            batch, ctx = 4, 256
        layers = layers_32k if layers else 0
        for graphs in (False, True):
            rows.append(run_case(name, batch, ctx, layers, graphs, steps, tiny))
    meta = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() and not tiny else "cpu",
            "flashpage": os.path.dirname(flashpage.__file__), "torch": torch.__version__}  # fmt: skip
    path = os.path.join(os.environ.get("OUT", "."), "engine_decode_step.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
