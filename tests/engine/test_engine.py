"""Engine end to end on a tiny random-weight model: greedy tokens equal a no-cache recomputation
under every scheduling regime; block-manager integrity after every step; n > 1, abort, seeds."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

from flashpage.engine.engine_core import EngineCore
from flashpage.engine.llm import LLM
from flashpage.engine.outputs import RequestOutput
from flashpage.engine.sampling_params import SamplingParams
from flashpage.kv.layout import KVCacheSpec, allocate_kv_cache
from flashpage.ops.metadata import AttentionMetadata

NEW = 10
_rng = random.Random(5)
_SHARED = [_rng.randrange(96) for _ in range(20)]
PROMPTS = [_SHARED + [_rng.randrange(96) for _ in range(n)] for n in (3, 11, 17)] + [
    [_rng.randrange(96) for _ in range(n)] for n in (1, 6, 29)
]
# Bytes of one 8-token block of the tiny model: 2 (K, V) * 2 layers * 8 tokens * 1 head * 32 * 4 B.
BLOCK8 = 2 * 2 * 8 * 32 * 4


@torch.inference_mode()
def no_cache_hidden(model: Any, ids: list[int]) -> torch.Tensor:
    """``(len(ids), H)`` hidden states of one sequence computed from scratch (fresh cache)."""
    c = model.config
    dev = next(model.parameters()).device
    t = len(ids)
    nblk = math.ceil(t / 16)
    cache = allocate_kv_cache(
        KVCacheSpec(c.num_layers, nblk, 16, c.num_kv_heads, c.head_dim, torch.float32), dev
    )
    meta = AttentionMetadata(
        slot_mapping=torch.arange(t, device=dev),
        block_table=torch.arange(nblk, dtype=torch.int32, device=dev).view(1, -1),
        seqlens_k=torch.tensor([t], dtype=torch.int32, device=dev),
        cu_seqlens_q=torch.tensor([0, t], dtype=torch.int32, device=dev),
        max_seqlen_q=t,
        max_seqlen_k=t,
        decode_only=t == 1,
        prefix_free=True,
    )
    return model.forward(torch.tensor(ids, device=dev), torch.arange(t, device=dev), cache, meta)


@torch.inference_mode()
def recompute_greedy(model: Any, prompt: list[int], n_new: int) -> list[int]:
    """Greedy continuation recomputing the whole sequence every token (fresh cache, one sequence)."""
    ids = list(prompt)
    for _ in range(n_new):
        h = no_cache_hidden(model, ids)
        ids.append(int(model.compute_logits(h[-1:]).argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def reference(tiny_loaded: Any) -> list[list[int]]:
    return [recompute_greedy(tiny_loaded.model, p, NEW) for p in PROMPTS]


def run_checked(core: EngineCore, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:  # fmt: skip
    """Run requests through the core, checking block-manager integrity after every step."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    base = core.stats()["requests_finished"] + len(core._requests)
    ids = [f"t{base}-{i}" for i in range(len(prompts))]
    for rid, p, sp in zip(ids, prompts, plist):
        core.add_request(rid, p, sp, stream=False)
    done: dict[str, RequestOutput] = {}
    for _ in range(2000):
        for o in core.step():
            done[o.request_id] = o
        core.block_manager.check_integrity()
        if not core.has_unfinished():
            break
    assert core.block_manager.usage().used_blocks == 0, "blocks still referenced after all requests ended"
    return [done[i] for i in ids]


@pytest.mark.parametrize(
    "opts",
    [
        {},
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 8},  # chunked prefill, mixed with decodes
        {"kv_cache_bytes": 9 * BLOCK8, "block_size": 8},  # preemption (tiny cache)
        {"max_num_seqs": 2, "max_num_batched_tokens": 13},
    ],
    ids=["default", "no-prefix-cache", "chunked", "preempt", "few-seqs"],
)
def test_greedy_equals_recompute(tiny_loaded: Any, reference: list[list[int]], opts: dict) -> None:
    llm = LLM(model=tiny_loaded, **{"kv_cache_bytes": 400 * BLOCK8, **opts})
    core = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=NEW)
    outs = run_checked(core, PROMPTS, greedy)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert all(o.outputs[0].finish_reason == "length" and o.finished for o in outs)
    # Second pass: shared prefixes and the previous prompts now come from the prefix cache.
    outs2 = run_checked(core, PROMPTS[::-1], greedy)
    assert [o.outputs[0].token_ids for o in outs2] == reference[::-1]
    st = llm.stats()
    if opts.get("enable_prefix_caching", True) and "kv_cache_bytes" not in opts:
        assert st["prefix_cache_hit_rate"] > 0.3
        assert any(o.metrics.num_cached_tokens > 0 for o in outs2)
    if "kv_cache_bytes" in opts:
        assert st["num_preemptions"] > 0
    if "max_num_batched_tokens" in opts:
        assert "chunked_prefill" in st["roofline"]
    assert st["generation_tokens"] == 2 * NEW * len(PROMPTS)


def test_n_completions_fork_and_share_prompt_blocks(tiny_loaded: Any, reference: list[list[int]]) -> None:
    llm = LLM(model=tiny_loaded, kv_cache_bytes=100 * BLOCK8)
    core = llm.engine
    core.add_request("fork", PROMPTS[2], SamplingParams(n=3, temperature=0, max_tokens=NEW), stream=False)
    core.step()  # prefill, then the two siblings fork from the parent and sample their first token
    req = core._requests["fork"]
    assert len(req.seqs) == 3
    tables = [core.block_manager.block_table(s.seq_id) for s in req.seqs]
    assert tables[0] == tables[1] == tables[2]
    assert all(core.block_manager.ref_count(b) == 3 for b in tables[0])
    done: list[RequestOutput] = []
    while core.has_unfinished():
        done += core.step()
        core.block_manager.check_integrity()
    (out,) = done
    # Copy-on-write kept every sibling's KV right: greedy siblings all equal the reference.
    assert [c.token_ids for c in out.outputs] == [reference[2]] * 3
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert core.block_manager.usage().used_blocks == 0
    # Sampled siblings with a seed: reproducible, and (almost surely) not all equal.
    p = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=NEW)
    a = run_checked(core, [PROMPTS[0]], p)[0]
    b = run_checked(core, [PROMPTS[0]], p)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1


def test_abort_mid_run_frees_blocks_at_once(tiny_loaded: Any) -> None:
    llm = LLM(model=tiny_loaded, kv_cache_bytes=100 * BLOCK8, max_num_batched_tokens=16)
    core = llm.engine
    for i, p in enumerate(PROMPTS):
        core.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=NEW), stream=True)
    for _ in range(3):
        core.step()
    victims = ["r0", "r5"]  # r0 is decoding, r5 (29 tokens) is still in prefill or waiting
    seq_ids = [s.seq_id for rid in victims for s in core._requests[rid].seqs]
    used_before = core.block_manager.usage().used_blocks
    core.abort_request(victims)
    assert not any(core.block_manager.has_seq(sid) for sid in seq_ids)
    assert core.block_manager.usage().used_blocks < used_before
    core.block_manager.check_integrity()
    finished = set()
    while core.has_unfinished():
        for o in core.step():
            if o.finished:
                finished.add(o.request_id)
        core.block_manager.check_integrity()
    assert finished == {"r1", "r2", "r3", "r4"}
    assert core.block_manager.usage().used_blocks == 0
    assert core.stats()["requests_aborted"] == 2


def test_stream_deltas_add_up_and_seeds_reproduce(tiny_loaded: Any) -> None:
    llm = LLM(model=tiny_loaded, kv_cache_bytes=100 * BLOCK8)
    core = llm.engine
    p = SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=NEW, logprobs=2)
    core.add_request("s", PROMPTS[1], p, stream=True)
    core.add_request("other", PROMPTS[3], SamplingParams(temperature=1.0, max_tokens=NEW), stream=True)
    deltas: list[int] = []
    final = None
    while core.has_unfinished():
        for o in core.step():
            if o.request_id == "s":
                deltas += o.outputs[0].delta_token_ids
                final = o if o.finished else final
    assert final is not None and deltas == final.outputs[0].token_ids and len(deltas) == NEW
    lps = final.outputs[0].logprobs
    assert lps is not None and len(lps) == NEW
    assert all(t in d and len(d) <= 3 for t, d in zip(deltas, lps))
    m = final.metrics
    assert m.ttft is not None and m.ttft >= 0 and len(m.token_times) == NEW and m.finished_time is not None
    # The same seed alone in its batch gives the same tokens.
    alone = llm.generate([PROMPTS[1]], p, use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == deltas


def test_request_validation(tiny_loaded: Any) -> None:
    llm = LLM(model=tiny_loaded, kv_cache_bytes=4 * BLOCK8, block_size=8)
    core = llm.engine
    assert core.max_model_len == 32  # capped by the cache size
    with pytest.raises(ValueError, match="prompt"):
        core.add_request("x", list(range(32)), SamplingParams())
    with pytest.raises(ValueError, match="prompt"):
        core.add_request("x", [96], SamplingParams())
    with pytest.raises(ValueError, match="prompt"):
        core.add_request("x", "text needs a tokenizer", SamplingParams())
    # Prompt + max_tokens over max_model_len is rejected (vLLM); max_tokens=None runs to the limit.
    with pytest.raises(ValueError, match=r"max_tokens: .*max_model_len=32; lower max_tokens to at most 30"):
        core.add_request("x", [1, 2], SamplingParams(max_tokens=31))
    core.add_request("dup", [1, 2], SamplingParams(max_tokens=None, ignore_eos=True))
    with pytest.raises(ValueError, match="request_id"):
        core.add_request("dup", [1, 2], SamplingParams())
    (out,) = _drain(core)
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 30  # max_model_len
    with pytest.raises(ValueError, match="block_size"):
        LLM(model=tiny_loaded, block_size=12)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(model=tiny_loaded, gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([[1], [2]], [SamplingParams()], use_tqdm=False)


def test_loaded_model_sets_device_and_dtype(tiny_loaded: Any) -> None:
    """A loaded model brings its device and dtype (an fp32 model on a GPU machine stays fp32 there);
    a config naming others is an error, not a silent mismatch."""
    param = next(tiny_loaded.model.parameters())
    core = LLM(model=tiny_loaded, kv_cache_bytes=8 * BLOCK8).engine
    assert core.device == param.device and core.dtype == torch.float32 == param.dtype
    with pytest.raises(
        ValueError, match=r"dtype: the loaded model holds torch\.float32, the config asks for"
    ):
        LLM(model=tiny_loaded, dtype="bfloat16", kv_cache_bytes=8 * BLOCK8)
    if param.device.type == "cuda":
        with pytest.raises(
            ValueError, match=r"device: the loaded model is on cuda:0, the config asks for cpu"
        ):
            LLM(model=tiny_loaded, device="cpu", kv_cache_bytes=8 * BLOCK8)


def _drain(core: EngineCore) -> list[RequestOutput]:
    out = []
    while core.has_unfinished():
        out += [o for o in core.step() if o.finished]
    return out


@pytest.mark.slow
def test_triton_backend_matches(
    tiny_loaded: Any, reference: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Triton kernels (interpreter) through the engine: flash varlen prefill, chunked prefill over
    the paged cache mixed with decodes, paged decode."""
    monkeypatch.setenv("FLASHPAGE_BACKEND", "triton")
    llm = LLM(model=tiny_loaded, kv_cache_bytes=50 * BLOCK8, max_num_batched_tokens=16)
    prompts = [PROMPTS[0], PROMPTS[3]]
    outs = run_checked(llm.engine, prompts, SamplingParams(temperature=0, max_tokens=4))
    assert [o.outputs[0].token_ids for o in outs] == [reference[0][:4], reference[3][:4]]
    assert {"prefill", "chunked_prefill", "decode"} <= set(llm.stats()["roofline"])


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_decode_graph_buffers_padding_and_buckets(
    tiny_loaded: Any, reference: list[list[int]], backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA-graph decode path (static buffers, batch padded to a bucket, slot -1 for pad rows,
    per-split graphs) emulated on CPU: tokens must equal the reference as the batch shrinks."""
    monkeypatch.setenv("FLASHPAGE_BACKEND", backend)
    llm = LLM(model=tiny_loaded, kv_cache_bytes=100 * BLOCK8, max_num_seqs=6)
    runner = llm.engine.runner
    runner.capture_graphs(emulate=True)
    assert runner._graph_buckets == [1, 2, 4, 6]
    n_new = [NEW, 3, 7, 1, 5, 9]  # requests finish at different steps: 6 -> 5 -> ... -> 1 sequences
    params = [SamplingParams(temperature=0, max_tokens=n) for n in n_new]
    outs = run_checked(llm.engine, PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == [r[:n] for r, n in zip(reference, n_new)]
    dec = llm.stats()["roofline"]["decode"]
    assert dec["graph_steps"] == dec["steps"] > 0


def test_decode_plan_is_the_planners_launch(tiny_loaded: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's decode plan is the library planner's (what ``bench decode``'s planner rows time:
    ``plan_decode`` with ``num_splits=0``), reused by the next steps of the same batch and launch; the CUDA-graph
    buckets hold a graph key for each launch the planner can pick, and the stats record the launched
    split count."""
    from flashpage.ops.paged_plan import plan_decode

    monkeypatch.setenv("FLASHPAGE_BACKEND", "triton")
    llm = LLM(model=tiny_loaded, kv_cache_bytes=100 * BLOCK8, max_num_seqs=6)
    runner = llm.engine.runner
    c = tiny_loaded.config
    for batch, ctx in ((1, 300), (3, 64), (6, 500)):
        ctx = min(ctx, runner.max_model_len)
        plan = runner._decode_plan(batch, ctx)
        want = plan_decode(
            batch, c.num_heads, c.num_kv_heads, c.head_dim, block_size=runner.block_size, max_seqlen_k=ctx,
            q_dtype=runner.dtype, device=runner.device,
        )  # fmt: skip
        assert (plan.num_splits, plan.config, plan.grid) == (want.num_splits, want.config, want.grid)
        key = runner._launch_key(runner._decode_choice(batch, ctx))
        assert key == (plan.config.heads_per_program, plan.num_splits)
        bucket = next(b for b in (1, 2, 4, 6) if b >= batch)
        prev = {1: 0, 2: 1, 4: 2, 6: 4}[bucket]
        assert key in runner._possible_launches(bucket, prev)
        assert runner._decode_plan(batch, ctx) is plan  # the next step of this launch reuses the plan


def test_add_and_abort_from_another_thread_while_stepping(
    tiny_loaded: Any, reference: list[list[int]]
) -> None:
    """What the server does: requests arrive from an event-loop thread while a worker steps."""
    import threading

    llm = LLM(model=tiny_loaded, kv_cache_bytes=100 * BLOCK8)
    core = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=NEW)
    core.add_request("first", PROMPTS[0], greedy)
    done: dict[str, RequestOutput] = {}
    stop = threading.Event()

    def stepper() -> None:
        while not stop.is_set():
            for o in core.step():
                if o.finished:
                    done[o.request_id] = o

    t = threading.Thread(target=stepper)
    t.start()
    try:
        for i, p in enumerate(PROMPTS[1:], start=1):
            core.add_request(f"r{i}", p, greedy)
        core.add_request("gone", PROMPTS[5], SamplingParams(max_tokens=400, ignore_eos=True))
        core.abort_request("gone")
        for _ in range(2000):
            if len(done) == len(PROMPTS):
                break
            threading.Event().wait(0.005)
    finally:
        stop.set()
        t.join()
    assert "gone" not in done and not core.has_unfinished()
    assert [done[k].outputs[0].token_ids for k in ["first", *(f"r{i}" for i in range(1, 6))]] == reference
    assert core.block_manager.usage().used_blocks == 0
