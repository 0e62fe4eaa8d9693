"""The vLLM surface on the tiny random model: prompt_logprobs (through chunked prefill and prefix-cache
hits), min_tokens, logit_bias, cumulative_logprob, thread-safe ``LLM.generate``, and the
``max_model_len`` / ``max_tokens`` limits."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from flashpage.engine.llm import LLM
from flashpage.engine.outputs import Logprob
from flashpage.engine.sampling_params import SamplingParams
from tests.engine.test_engine import BLOCK8, NEW, PROMPTS, no_cache_hidden, recompute_greedy, run_checked


@torch.inference_mode()
def prompt_logprob_reference(model: Any, prompt: list[int]) -> torch.Tensor:
    """``(len(prompt), V)`` log-softmax of every prompt position, one no-cache forward."""
    return model.compute_logits(no_cache_hidden(model, prompt)).float().log_softmax(-1).cpu()


def _check_prompt_logprobs(lps: list[dict[int, Logprob] | None] | None, ref: torch.Tensor, prompt: list[int], k: int) -> None:  # fmt: skip
    assert lps is not None and len(lps) == len(prompt) and lps[0] is None
    for pos in range(1, len(prompt)):
        d = lps[pos]
        assert d is not None
        row = ref[pos - 1]
        tok = prompt[pos]
        assert d[tok].logprob == pytest.approx(row[tok].item(), abs=1e-4)
        v = row[tok].item()
        assert int((row > v + 1e-4).sum()) + 1 <= d[tok].rank <= int((row > v - 1e-4).sum()) + 1
        top = row.topk(k).indices.tolist()
        assert set(top) <= set(d) and len(d) in (k, k + 1)
        assert all(isinstance(v, Logprob) and v.decoded_token is None for v in d.values())


@pytest.mark.parametrize(
    "opts",
    [{}, {"max_num_batched_tokens": 8}],
    ids=["one-chunk", "chunked"],
)
def test_prompt_logprobs_through_chunks_and_prefix_cache_hits(tiny_loaded: Any, opts: dict) -> None:
    llm = LLM(model=tiny_loaded, kv_cache_bytes=200 * BLOCK8, **opts)
    core = llm.engine
    new = 3
    greedy = SamplingParams(temperature=0, max_tokens=new)
    # Fill the prefix cache with the shared 20-token prefix and the full prompts.
    run_checked(core, PROMPTS[:3], greedy)
    k = 2
    asks = SamplingParams(temperature=0, max_tokens=new, prompt_logprobs=k)
    # Prompt-logprob requests beside plain ones that hit the same cached blocks.
    outs = run_checked(core, [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[5]], [asks, greedy, asks, asks])
    refs = [
        recompute_greedy(tiny_loaded.model, p, new) for p in (PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[5])
    ]
    assert [o.outputs[0].token_ids for o in outs] == refs  # shared blocks were not overwritten
    assert outs[0].metrics.num_cached_tokens > 0  # the cache hit happened, yet every position came back
    for o, p in zip([outs[0], outs[2], outs[3]], [PROMPTS[0], PROMPTS[2], PROMPTS[5]]):
        _check_prompt_logprobs(o.prompt_logprobs, prompt_logprob_reference(tiny_loaded.model, p), p, k)
    assert outs[1].prompt_logprobs is None
    # A one-token prompt has only the leading None.
    (one,) = run_checked(core, [[5]], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))
    assert one.prompt_logprobs == [None]


def test_min_tokens_holds_back_stop_tokens(tiny_loaded: Any) -> None:
    llm = LLM(model=tiny_loaded, kv_cache_bytes=100 * BLOCK8)
    s = 7
    # The bias makes token s all but certain; as a stop token it ends the completion at once...
    forced = SamplingParams(temperature=0, max_tokens=NEW, stop_token_ids=[s], logit_bias={str(s): 100})
    (a,) = llm.generate([PROMPTS[0]], forced, use_tqdm=False)
    assert a.outputs[0].token_ids == [s] and a.outputs[0].finish_reason == "stop"
    assert a.outputs[0].stop_reason == s
    # ... unless min_tokens holds it back: masked for the first 3 tokens, sampled as the 4th.
    held = SamplingParams(
        temperature=0, max_tokens=NEW, stop_token_ids=[s], logit_bias={s: 100}, min_tokens=3
    )
    (b,) = llm.generate([PROMPTS[0]], held, use_tqdm=False)
    out = b.outputs[0]
    assert len(out.token_ids) == 4 and s not in out.token_ids[:3] and out.token_ids[3] == s
    assert out.finish_reason == "stop"
    with pytest.raises(ValueError, match=r"^logit_bias: token ids \[96\]"):
        llm.generate([PROMPTS[0]], SamplingParams(logit_bias={96: 1.0}), use_tqdm=False)


def test_cumulative_logprob_and_logprob_objects(tiny_loaded: Any) -> None:
    llm = LLM(model=tiny_loaded, kv_cache_bytes=100 * BLOCK8)
    p = SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=NEW, logprobs=1)
    (out,) = llm.generate([PROMPTS[1]], p, use_tqdm=False)
    for c in out.outputs:
        assert c.logprobs is not None and len(c.logprobs) == NEW
        chosen = [d[t] for d, t in zip(c.logprobs, c.token_ids)]
        assert all(isinstance(v, Logprob) and v.rank >= 1 and v.logprob <= 0 for v in chosen)
        assert c.cumulative_logprob == pytest.approx(sum(chosen), abs=1e-5)
        top1 = [next(iter(d.items())) for d in c.logprobs]
        assert all(v.rank == 1 for _, v in top1)
    (plain,) = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert plain.outputs[0].cumulative_logprob is None and plain.outputs[0].logprobs is None


def test_generate_from_several_threads(tiny_loaded: Any) -> None:
    llm = LLM(model=tiny_loaded, kv_cache_bytes=300 * BLOCK8, max_num_seqs=8)
    greedy = SamplingParams(temperature=0, max_tokens=NEW)
    reference = [recompute_greedy(tiny_loaded.model, p, NEW) for p in PROMPTS]
    jobs = [[(t + i) % len(PROMPTS) for i in range(3)] for t in range(4)]
    results: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(jobs))

    def worker(t: int) -> None:
        try:
            start.wait()
            for _ in range(2):  # two calls per thread: requests of later calls join a running batch
                outs = llm.generate([PROMPTS[j] for j in jobs[t]], greedy, use_tqdm=False)
                results.setdefault(t, []).extend(o.outputs[0].token_ids for o in outs)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(len(jobs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not errors, errors
    for t, idx in enumerate(jobs):
        assert results[t] == [reference[j] for j in idx] * 2
    assert not llm.engine.has_unfinished() and not llm._done
    assert llm.engine.block_manager.usage().used_blocks == 0


def test_max_model_len_over_the_cache_is_an_error(tiny_loaded: Any) -> None:
    with pytest.raises(
        ValueError, match=r"^max_model_len: 64 tokens .*kv_cache_bytes or gpu_memory_utilization"
    ):
        LLM(model=tiny_loaded, kv_cache_bytes=4 * BLOCK8, block_size=8, max_model_len=64)
    llm = LLM(model=tiny_loaded, kv_cache_bytes=4 * BLOCK8, block_size=8, max_model_len=32)
    assert llm.engine.max_model_len == 32
    # The default still caps to what the cache holds.
    assert LLM(model=tiny_loaded, kv_cache_bytes=4 * BLOCK8, block_size=8).engine.max_model_len == 32
    with pytest.raises(ValueError, match=r"^max_tokens: "):
        llm.generate([[1] * 20], SamplingParams(max_tokens=13), use_tqdm=False)
    (ok,) = llm.generate([[1] * 20], SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert len(ok.outputs[0].token_ids) == 12
