"""AsyncLLM: streaming outputs equal the offline engine's, leaving a stream aborts and frees its
blocks, a failing step fails only its requests, shutdown ends what is left."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from flashpage.engine.async_llm import AsyncLLM, EngineDeadError, EngineStepError
from flashpage.engine.engine_core import EngineConfig, EngineCore
from flashpage.engine.llm import LLM
from flashpage.engine.sampling_params import SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]


def _engine(loaded: Any, **kw: Any) -> AsyncLLM:
    core = EngineCore(EngineConfig(model="tiny", max_num_seqs=8, **kw), loaded=loaded)
    return AsyncLLM.from_engine(core)


def test_streams_match_offline_generate(tiny_loaded: Any) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(model=tiny_loaded).generate(PROMPTS, greedy, use_tqdm=False)]
    llm = _engine(tiny_loaded)

    async def one(p: list[int]) -> tuple[list[int], list[int], bool]:
        deltas: list[int] = []
        last = None
        async for out in llm.generate(p, greedy):
            deltas += out.outputs[0].delta_token_ids
            last = out
        assert last is not None
        return deltas, last.outputs[0].token_ids, last.finished

    async def main() -> list[tuple[list[int], list[int], bool]]:
        return await asyncio.wait_for(asyncio.gather(*(one(p) for p in PROMPTS)), 120)

    try:
        got = asyncio.run(main())
    finally:
        llm.shutdown()
    for (deltas, final, finished), ref in zip(got, want):
        assert finished and deltas == final == ref


def test_leaving_a_stream_aborts_and_frees_blocks(tiny_loaded: Any) -> None:
    llm = _engine(tiny_loaded)

    async def main() -> None:
        stream = llm.add_request(PROMPTS[2], SamplingParams(max_tokens=400, ignore_eos=True))
        n = 0
        async with stream:
            async for _ in stream:
                n += 1
                if n == 2:
                    break
        for _ in range(100):
            g = llm.gauges
            if g.kv_blocks_used == 0 and llm.num_unfinished() == 0 and not llm.core.has_unfinished():
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"not freed: {llm.gauges}")

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
        llm.core.block_manager.check_integrity()
        assert llm.core.stats()["requests_aborted"] == 1
    finally:
        llm.shutdown()


def test_bad_request_raises_before_anything_runs(tiny_loaded: Any) -> None:
    llm = _engine(tiny_loaded)

    async def main() -> None:
        with pytest.raises(ValueError, match="prompt"):
            llm.add_request([], SamplingParams())
        with pytest.raises(ValueError, match="request_id"):
            llm.add_request([1], SamplingParams(max_tokens=50, ignore_eos=True), request_id="dup")
            llm.add_request([1], SamplingParams(), request_id="dup")
        await llm.abort("dup")

    try:
        asyncio.run(main())
        assert llm.num_unfinished() == 0
    finally:
        llm.shutdown()


def test_failing_step_fails_its_requests_only(tiny_loaded: Any) -> None:
    llm = _engine(tiny_loaded)
    real = llm.core.runner.execute
    state = {"fail": True}

    def flaky(*a: Any, **k: Any) -> Any:
        if state.pop("fail", False):
            raise RuntimeError("boom")
        return real(*a, **k)

    llm.core.runner.execute = flaky

    async def main() -> list[int]:
        with pytest.raises(EngineStepError, match="boom"):
            async for _ in llm.generate([1, 2, 3], SamplingParams(max_tokens=4)):
                pass
        outs = [o async for o in llm.generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))]
        return outs[-1].outputs[0].token_ids

    try:
        assert len(asyncio.run(asyncio.wait_for(main(), 60))) == 4
        llm.core.block_manager.check_integrity()
    finally:
        llm.shutdown()


def test_shutdown_and_fail_all_end_the_streams(tiny_loaded: Any) -> None:
    llm = _engine(tiny_loaded)

    async def main() -> None:
        stream = llm.add_request([1, 2, 3], SamplingParams(max_tokens=500, ignore_eos=True))
        await stream.__anext__()
        assert llm.fail_all("closing") == 1
        with pytest.raises(EngineDeadError, match="closing"):
            async for _ in stream:
                pass

    asyncio.run(asyncio.wait_for(main(), 60))
    llm.shutdown()
    assert not llm.is_running

    async def after() -> None:
        with pytest.raises(EngineDeadError):
            llm.add_request([1], SamplingParams())

    asyncio.run(after())


def test_engine_process() -> None:
    """The engine in a child process: same greedy tokens as in a thread, rejections at the first
    iteration, aborts free the cache, a dead child fails what is left."""
    import os
    import signal
    import time

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kw = {"dtype": "float32", "device": "cpu", "kv_cache_bytes": 32 * 2**20, "max_num_seqs": 8}
    ref = LLM(model="smollm2-135m-instruct", **kw).generate(
        ["The capital of France is"], greedy, use_tqdm=False
    )
    llm = AsyncLLM("smollm2-135m-instruct", engine_process=True, **kw)
    assert llm.core is None and llm.info.max_num_seqs == 8 and llm.tokenizer is not None
    assert llm.render_chat([{"role": "user", "content": "Hi"}])[1]

    rich = SamplingParams(temperature=0.0, max_tokens=6, n=2, logprobs=2, prompt_logprobs=1, stop=["zzz"])
    ref_rich = LLM(model="smollm2-135m-instruct", **kw).generate(["Hello there"], rich, use_tqdm=False)[0]

    async def main() -> None:
        outs = [o async for o in llm.generate("The capital of France is", greedy)]
        assert outs[-1].finished and outs[-1].outputs[0].token_ids == ref[0].outputs[0].token_ids
        # Every field rebuilt from the child's deltas equals the engine's own output.
        got = [o async for o in llm.generate("Hello there", rich)][-1]
        assert got.prompt_token_ids == ref_rich.prompt_token_ids
        assert [float(next(iter(d.values()))) if d else None for d in got.prompt_logprobs] == [
            float(next(iter(d.values()))) if d else None for d in ref_rich.prompt_logprobs
        ]
        for a, b in zip(got.outputs, ref_rich.outputs):
            assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)
            assert [{t: float(v) for t, v in d.items()} for d in a.logprobs] == [
                {t: float(v) for t, v in d.items()} for d in b.logprobs
            ]
            assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob)
        assert len(got.metrics.token_times) == len(got.outputs[0].token_ids)
        with pytest.raises(ValueError, match="max_tokens"):
            async for _ in llm.generate([1, 2, 3], SamplingParams(max_tokens=10**6)):
                pass
        stream = llm.add_request([1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True))
        await stream.__anext__()
        await stream.aclose()
        for _ in range(200):
            if llm.gauges.kv_blocks_used == 0 and llm.gauges.num_running == 0:
                break
            await asyncio.sleep(0.05)
        assert llm.gauges.kv_blocks_used == 0
        stream = llm.add_request([1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True))
        await stream.__anext__()
        os.kill(llm._driver._proc.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="process"):
            async for _ in stream:
                pass

    try:
        asyncio.run(asyncio.wait_for(main(), 180))
        deadline = time.monotonic() + 10
        while llm.is_running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not llm.is_running
    finally:
        llm.shutdown()
