"""Tensor parallelism on CPU (gloo, spawned processes on 127.0.0.1, every wait bounded).

* the parallel layers of 2 ranks equal the unsharded ones (column/row linears, fused gate/up split,
  vocab-parallel embedding with an uneven vocabulary, logits gathered on rank 0 or on every rank);
* every architecture sharded over 2 ranks (kv-head replication, Qwen2 biases, Qwen3/Gemma 3 q/k norms,
  Gemma 2 softcaps and sandwich norms, Mistral's window) gives the unsharded hidden states and logits
  over prefill, decode and a chunked step through the paged cache;
* ``LLM(..., tensor_parallel_size=2)`` gives the same greedy tokens as one process (chunked prefill and
  decode), a dead worker is an error on rank 0, close() leaves no process; heads that do not divide
  are a ValueError naming ``tensor_parallel_size``;
* (slow) the embedded SmolLM2 (9 heads / 3 kv heads) at ``tensor_parallel_size=3``.
"""

from __future__ import annotations

import copy
import datetime
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from flashpage.distributed.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    head_split,
    local_config,
    shard_model_,
)
from flashpage.engine.engine_core import EngineConfig
from flashpage.engine.llm import LLM
from flashpage.engine.sampling_params import SamplingParams
from flashpage.models.config import ModelConfig
from flashpage.models.llama import LlamaForCausalLM
from tests.distributed.spawn import free_port
from tests.models.test_llama import make_caches, step_meta

TIMEOUT_S = 120.0


def _rank_entry(rank: int, world: int, port: int, body: Callable[[TensorParallel], None]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    try:
        body(TensorParallel.from_group())
    finally:
        dist.destroy_process_group()


def run_ranks(body: Callable[[TensorParallel], None], world: int = 2) -> None:
    """Run ``body(tp)`` on ``world`` spawned gloo ranks; a rank's exception fails the test (bounded)."""
    ctx = torch.multiprocessing.start_processes(
        _rank_entry, args=(world, free_port(), body), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"ranks did not finish within {TIMEOUT_S} s")


# ----------------------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------------------


def _layers_body(tp: TensorParallel) -> None:
    r, n = tp.rank, tp.world_size
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, generator=g)
    w, b = torch.randn(12, 8, generator=g), torch.randn(12, generator=g)
    w2, b2 = torch.randn(7, 12, generator=g), torch.randn(7, generator=g)
    full = F.linear(x, w, b)
    col = ColumnParallelLinear.from_full(w, b, tp)
    torch.testing.assert_close(col(x), full[:, r * 6 : (r + 1) * 6])
    # Fused gate/up: each half split by ranks, the rank's halves concatenated.
    fused = ColumnParallelLinear.from_full(w, b, tp, sizes=[6, 6])
    want = torch.cat([full[:, r * 3 : (r + 1) * 3], full[:, 6 + r * 3 : 6 + (r + 1) * 3]], dim=-1)
    torch.testing.assert_close(fused(x), want)
    # Column then row: the unsharded two-layer product on every rank (bias added once).
    row = RowParallelLinear.from_full(w2, b2, tp)
    torch.testing.assert_close(row(col(x)), F.linear(full, w2, b2))
    # Vocab-parallel embedding and logits, vocabulary 13 over 2 ranks (7 rows + 6 rows padded to 7).
    table = torch.randn(13, 8, generator=g)
    start, end, rows = tp.vocab_shard(13)
    assert rows == 7 and (start, end) == ((0, 7), (7, 13))[r]
    shard = torch.zeros(rows, 8)
    shard[: end - start] = table[start:end]
    ids = torch.tensor([0, 6, 7, 12, 3, 12, 9])
    emb = tp.vocab_parallel_embedding(ids, shard, 13)
    torch.testing.assert_close(emb, F.embedding(ids, table), rtol=0, atol=0)
    logits = tp.vocab_parallel_logits(x, shard, 13, dst=0)
    if r == 0:
        torch.testing.assert_close(logits, F.linear(x, table))
    else:
        assert logits.shape == (0, 13)
    torch.testing.assert_close(tp.vocab_parallel_logits(x, shard, 13, dst=None), F.linear(x, table))
    assert n == 2


# ----------------------------------------------------------------------------------------------------------
# Sharded models
# ----------------------------------------------------------------------------------------------------------

_TINY = {
    "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_layers": 2, "num_heads": 4,
    "num_kv_heads": 2, "head_dim": 16, "max_position_embeddings": 64,
}  # fmt: skip

ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    # 1 kv head over 2 ranks: replicated; output-projection bias added once after the all-reduce.
    "llama-kv-replicated": {"architecture": "llama", "num_kv_heads": 1, "attention_out_bias": True},
    "mistral": {"architecture": "mistral", "sliding_window": 4},
    "qwen2": {"architecture": "qwen2", "attention_bias": True, "tie_word_embeddings": True},
    "qwen3": {"architecture": "qwen3"},
    "gemma2": {
        "architecture": "gemma2",
        "sliding_window": 4,
        "attn_logit_softcapping": 20.0,
        "final_logit_softcapping": 10.0,
        "query_pre_attn_scalar": 16.0,
        "tie_word_embeddings": True,
    },
    "gemma3": {"architecture": "gemma3", "sliding_window": 4, "rope_local_theta": 10000.0, "num_layers": 6},
}


def _models_body(tp: TensorParallel) -> None:
    block = 4
    steps = [  # (cached tokens, new tokens) per sequence: prefill, decode, a chunk of 3 after a prefix
        [(0, 5), (0, 3)],
        [(5, 1), (3, 1)],
        [(6, 3), (4, 1)],
    ]
    tables = [[3, 0, 5], [1, 4]]
    for name, opts in ARCH_CONFIGS.items():
        cfg = ModelConfig(**{**_TINY, **opts})
        ref = LlamaForCausalLM(cfg, seed=1)
        ref.init_random_(0.2, seed=1)
        sharded = shard_model_(copy.deepcopy(ref), tp)
        assert sharded.embed_tokens.shape == (49, 64)
        ref_caches = make_caches(cfg, 6, block)
        tp_caches = make_caches(local_config(cfg, tp.world_size), 6, block)
        assert tp_caches[0][0].shape[2] == max(1, cfg.num_kv_heads // tp.world_size)
        ids_gen = torch.Generator().manual_seed(2)
        for seqs in steps:
            meta, pos = step_meta(seqs, tables, block)
            ids = torch.randint(0, cfg.vocab_size, (pos.numel(),), generator=ids_gen)
            want = ref(ids, pos, ref_caches, meta)
            meta, pos = step_meta(seqs, tables, block)
            got = sharded(ids, pos, tp_caches, meta)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
            logits = sharded.compute_logits(got)
            if tp.rank == 0:
                torch.testing.assert_close(logits, ref.compute_logits(want), rtol=1e-4, atol=1e-4)


def _layers_and_models_body(tp: TensorParallel) -> None:
    _layers_body(tp)
    _models_body(tp)


def test_parallel_layers_and_every_sharded_architecture_equal_unsharded() -> None:
    """One spawn for both checks (process start-up dominates their time)."""
    run_ranks(_layers_and_models_body)


# ----------------------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------------------


def test_heads_that_do_not_divide_are_a_value_error() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size: the model's 9 attention heads"):
        head_split(9, 3, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size: the model's 6 key/value heads"):
        head_split(8, 6, 4)  # 8 q heads divide by 4, 6 kv heads do not
    with pytest.raises(ValueError, match="tensor_parallel_size: 8 is not a multiple"):
        head_split(24, 3, 8)
    assert head_split(8, 2, 4) == head_split(8, 2, 4).__class__(2, 1, 2)  # kv heads replicated twice
    assert head_split(9, 3, 3).kv_range(2) == (2, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)
    cfg = ModelConfig(**{**_TINY, "architecture": "llama", "num_heads": 3, "num_kv_heads": 3})
    with pytest.raises(ValueError, match="tensor_parallel_size: the model's 3 attention heads"):
        LLM("tiny", load_format="dummy", model_config=cfg, device="cpu", tensor_parallel_size=2)


# ----------------------------------------------------------------------------------------------------------
# The engine
# ----------------------------------------------------------------------------------------------------------

PROMPTS = [list(range(3, 23)), [5, 6, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48], [90, 2]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Qwen3 checkpoint (4 heads / 2 kv heads, q/k norms), weights large enough that the
    greedy continuation depends on the context."""
    from flashpage.models.loader import save_hf_checkpoint

    model = LlamaForCausalLM(ModelConfig(**{**_TINY, "architecture": "qwen3"}), seed=3)
    model.init_random_(0.2, seed=3)
    out = str(tmp_path_factory.mktemp("qwen3"))
    save_hf_checkpoint(model, out)
    return out


ENGINE_OPTS = {"device": "cpu", "dtype": "float32", "max_num_batched_tokens": 8, "kv_cache_bytes": 1 << 20}


@pytest.fixture(scope="module")
def single_tokens(qwen3_dir: str) -> list[list[int]]:
    """Greedy tokens of one process (the reference)."""
    single = LLM(qwen3_dir, **ENGINE_OPTS)
    want = _tokens(single)
    single.close()
    assert len({tuple(t) for t in want}) == len(PROMPTS)  # the continuations differ: a real check
    return want


def test_llm_tp2_greedy_parity_and_shutdown(qwen3_dir: str, single_tokens: list[list[int]]) -> None:
    want = single_tokens
    llm = LLM(qwen3_dir, tensor_parallel_size=2, **ENGINE_OPTS)
    try:
        assert _tokens(llm) == want
        phases = llm.stats()["roofline"]
        assert {"prefill", "chunked_prefill", "decode"} <= set(phases)  # 20-token prompt in chunks of 8
        with pytest.raises(ValueError, match="prompt_logprobs"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)
        assert _tokens(llm) == want  # again, from the prefix cache
    finally:
        llm.close()
    procs = llm.engine.tp.procs
    assert len(procs) == 1 and not procs[0].is_alive() and procs[0].exitcode == 0


def test_llm_tp2_dead_worker_is_an_error_on_rank_0(qwen3_dir: str) -> None:
    llm = LLM(qwen3_dir, tensor_parallel_size=2, device="cpu", dtype="float32", kv_cache_bytes=1 << 20)
    try:
        worker = llm.engine.tp.procs[0]
        worker.kill()
        worker.join(10)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="worker rank 1 exited"):
            llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
        assert time.monotonic() - t0 < 10
    finally:
        llm.close()


_TORCHRUN_SCRIPT = """
import json, sys
from flashpage import LLM, SamplingParams
opts = json.loads(sys.argv[2])
llm = LLM(sys.argv[1], tensor_parallel_size=2, **opts)
prompts = json.loads(sys.argv[3])
outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
print("TOKENS " + json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
llm.close()
"""


def test_llm_tp2_under_torchrun(qwen3_dir: str, single_tokens: list[list[int]], tmp_path: Any) -> None:
    """``torchrun`` starts both ranks: rank 0 is the engine, rank 1 serves inside ``LLM(...)`` and exits."""
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "tp_script.py"
    script.write_text(_TORCHRUN_SCRIPT)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(script),
    ]
    cmd += [qwen3_dir, json.dumps(ENGINE_OPTS), json.dumps(PROMPTS)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("TOKENS ")]
    assert len(lines) == 1  # printed by rank 0 only: rank 1 never returns from LLM(...)
    assert json.loads(lines[0][len("TOKENS ") :]) == single_tokens


@pytest.mark.slow
def test_smollm2_tp3_greedy_parity() -> None:
    """SmolLM2's 9 heads / 3 kv heads divide by 3 (not by 2): one kv head per rank."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    sp = SamplingParams(temperature=0.0, max_tokens=6)
    opts = {"device": "cpu", "dtype": "float32", "max_num_batched_tokens": 4, "kv_cache_bytes": 4 << 20}
    outs = []
    for n in (1, 3):
        llm = LLM(tensor_parallel_size=n, **opts)
        try:
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
        finally:
            llm.close()
    assert outs[0] == outs[1] and all(outs[0])
