"""Greedy parity on the embedded SmolLM2-135M GGUF: flashpage vs Hugging Face ``generate``, and
flashpage's scheduling regimes against each other; text features with the real tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from flashpage.engine.llm import LLM
from flashpage.engine.sampling_params import SamplingParams
from tests.engine.conftest import GREEDY, PARITY_PROMPTS

pytestmark = pytest.mark.slow

# One KV block of SmolLM2 in fp32: 2 * 30 layers * 16 tokens * 3 heads * 64 * 4 bytes.
BLOCK = 2 * 30 * 16 * 3 * 64 * 4


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def default_llm(smollm: Any) -> LLM:
    return LLM(model=smollm, kv_cache_bytes=64 * BLOCK)


@pytest.fixture(scope="module")
def batch_tokens(default_llm: LLM, parity_prompt_ids: list[list[int]]) -> list[list[int]]:
    return _tokens(default_llm, parity_prompt_ids)


def test_matches_hf_generate(batch_tokens: list[list[int]], hf_greedy: list[list[int]]) -> None:
    same = sum(a == b for a, b in zip(batch_tokens, hf_greedy))
    assert same >= len(PARITY_PROMPTS) - 1, list(zip(batch_tokens, hf_greedy))
    assert all(len(t) > 0 for t in batch_tokens)


def test_prefix_cache_hit_gives_same_tokens(default_llm: LLM, parity_prompt_ids: list[list[int]], batch_tokens: list[list[int]]) -> None:  # fmt: skip
    before = default_llm.stats()["prefix_cache_hit_rate"]
    again = _tokens(default_llm, parity_prompt_ids)  # prompts now served from the prefix cache
    assert again == batch_tokens
    assert default_llm.stats()["prefix_cache_hit_rate"] > before


@pytest.mark.parametrize(
    "opts",
    [
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 16},  # chunked prefill
        {"kv_cache_bytes": 6 * BLOCK, "block_size": 8},  # 12 blocks of 8: preemption by recompute
    ],
    ids=["no-prefix-cache", "chunked-16", "preempt"],
)
def test_regimes_give_the_same_tokens(
    smollm: Any, parity_prompt_ids: list[list[int]], batch_tokens: list[list[int]], opts: dict
) -> None:
    llm = LLM(model=smollm, **{"kv_cache_bytes": 64 * BLOCK, **opts})
    assert _tokens(llm, parity_prompt_ids) == batch_tokens
    st = llm.stats()
    if "kv_cache_bytes" in opts:
        assert st["num_preemptions"] > 0
    if "max_num_batched_tokens" in opts:
        assert st["roofline"]["chunked_prefill"]["kernel"] == "paged_prefill"
    assert st["kv_blocks_used"] == 0


def test_one_by_one_equals_batch(default_llm: LLM, parity_prompt_ids: list[list[int]], batch_tokens: list[list[int]]) -> None:  # fmt: skip
    default_llm.engine.block_manager.reset_prefix_cache()
    assert [_tokens(default_llm, [p])[0] for p in parity_prompt_ids] == batch_tokens


def test_stop_string_streaming_and_chat(default_llm: LLM, parity_prompt_ids: list[list[int]]) -> None:
    core = default_llm.engine
    ids = parity_prompt_ids[3]
    full = default_llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)[0].outputs[0]
    text = full.text
    assert text and text == default_llm.get_tokenizer().decode(full.token_ids, skip_special_tokens=True)
    stop = text[len(text) // 3 : len(text) // 3 + 4]
    assert stop.strip(), text
    want = text[: text.index(stop)]
    p = SamplingParams(temperature=0, max_tokens=32, stop=[stop, "\x00never"])
    core.add_request("stream", ids, p, stream=True)
    deltas: list[str] = []
    final = None
    while core.has_unfinished():
        for o in core.step():
            deltas.append(o.outputs[0].delta_text)
            final = o
    assert final is not None and final.finished
    c = final.outputs[0]
    assert c.text == want and "".join(deltas) == want  # stop string never streamed
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.token_ids == full.token_ids[: len(c.token_ids)]
    (reply,) = default_llm.chat([{"role": "user", "content": "What is 2+2?"}], GREEDY, use_tqdm=False)
    assert "4" in reply.outputs[0].text and reply.outputs[0].finish_reason == "stop"
    st = default_llm.stats()
    assert st["ttft_ms_p50"] is not None and st["generation_tokens_per_s"] > 0
