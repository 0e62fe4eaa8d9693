"""``flashpage demo``: chat with the embedded SmolLM2-135M-Instruct, then report what the engine did.

Round 1 answers two conversations in one batch (one with a long system prompt); round 2 streams the
answer to a second question under the *same* system prompt, whose KV blocks now come from the prefix
cache. The report gives prompt / generation tokens per second, time to first token, KV blocks used
and their waste, the prefix-cache hit rate, and the roofline planner's decision per phase.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["build_parser", "main"]

SYSTEM_PROMPT = (
    "You are Atlas, a friendly and precise travel assistant working for a small tour company. "
    "You answer questions about cities, landmarks, food and transport. Keep every answer short: two "
    "or three sentences, plain language, no lists, no markdown. If you are not sure about a fact, say "
    "so instead of guessing. Always mention one practical tip a first-time visitor would appreciate, "
    "such as the best time of day to visit or how to get there by public transport."
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flashpage demo",
        description="Answer a few chat prompts with the embedded model and report throughput, TTFT, "
        "KV-cache use, prefix caching and the roofline decisions.",
    )
    p.add_argument("--model", default="smollm2-135m-instruct", help="model name, directory or .gguf file")
    p.add_argument("--max-tokens", type=int, default=48, help="new tokens per answer (default: 48)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    p.add_argument(
        "--no-stream", action="store_true", help="print the round-2 answer at the end, not streamed"
    )
    return p


def _args(args: argparse.Namespace | Sequence[str] | None) -> argparse.Namespace:
    parser = build_parser()
    if args is None:
        return parser.parse_args([])
    if isinstance(args, argparse.Namespace):
        defaults = vars(parser.parse_args([]))
        defaults.update({k: v for k, v in vars(args).items() if k in defaults})
        return argparse.Namespace(**defaults)
    return parser.parse_args(list(args))


def _fmt(x: Any, spec: str = ".1f") -> str:
    return "n/a" if x is None else format(x, spec)


def _report(stats: dict[str, Any], wall_s: float) -> str:
    lines = [
        "",
        "== flashpage engine report ==",
        f"model {stats['model']} on {stats['device']} ({stats['dtype']}), {stats['steps']} steps, "
        f"{wall_s:.1f} s of generation",
        f"prompt tokens:     {stats['prompt_tokens']} ({stats['prompt_tokens_computed']} computed, the rest from "
        f"the prefix cache), {_fmt(stats['prompt_tokens_per_s'])} tokens/s",
        f"generation tokens: {stats['generation_tokens']}, {_fmt(stats['generation_tokens_per_s'])} tokens/s",
        f"time to first token: p50 {_fmt(stats['ttft_ms_p50'], '.0f')} ms, mean {_fmt(stats['ttft_ms_mean'], '.0f')} ms",
        f"KV cache: {stats['kv_blocks_total']} blocks of {stats['kv_block_size']} tokens "
        f"({stats['kv_cache_bytes'] / 2**20:.0f} MiB); peak {stats['kv_peak_blocks_used']} blocks used, "
        f"waste {stats['kv_waste_pct_at_peak']:.1f}% at peak ({stats['kv_waste_pct_mean']:.1f}% on average)",
        f"prefix-cache hit rate: {100 * stats['prefix_cache_hit_rate']:.1f}% of prompt tokens",
        f"roofline decisions (hardware profile {stats['hardware_profile']}):",
        f"  {'phase':<16}{'op':<11}{'intensity':>10}{'ridge':>9}  {'bound':<8}{'kernel':<22}{'splits':>6}{'steps':>7}",
    ]
    for ph in ("prefill", "chunked_prefill", "decode"):
        d = stats["roofline"].get(ph)
        if d is None:
            continue
        lines.append(
            f"  {ph:<16}{d['op']:<11}{d['intensity']:>10.2f}{d['ridge']:>9.2f}  {d['bound']:<8}"
            f"{d['kernel']:<22}{d['num_splits']:>6}{d['steps']:>7}"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """Run the demo; returns the exit status (0 on success, 2 on bad arguments)."""
    ns = _args(args)
    if ns.max_tokens < 1:
        print("flashpage demo: --max-tokens must be >= 1", file=sys.stderr)
        return 2
    from flashpage.engine.llm import LLM
    from flashpage.engine.sampling_params import SamplingParams

    print(f"loading {ns.model} ...", flush=True)
    t0 = time.perf_counter()
    try:
        llm = LLM(model=ns.model, device=ns.device)
    except ValueError as e:
        print(f"flashpage demo: error: {e}", file=sys.stderr)
        return 2
    print(f"loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    params = SamplingParams(temperature=ns.temperature, max_tokens=ns.max_tokens, seed=0)
    system = {"role": "system", "content": SYSTEM_PROMPT}
    round1 = [
        [system, {"role": "user", "content": "What should I see first in Paris?"}],
        [{"role": "user", "content": "Explain in one sentence why the sky is blue."}],
    ]
    t_gen = time.perf_counter()
    outs = llm.chat(round1, params, use_tqdm=False)
    for conv, out in zip(round1, outs):
        print(f"\n>>> {conv[-1]['content']}\n{out.outputs[0].text.strip()}", flush=True)

    # Round 2: same system prompt -> its KV blocks are prefix-cache hits. Streamed via the engine core.
    question = "And how do I get from the airport to the city centre in Rome?"
    text = llm.apply_chat_template([system, {"role": "user", "content": question}])
    core = llm.engine
    core.add_request(
        "demo-stream", text, params, prompt_token_ids=core.encode(text, add_special_tokens=False)
    )
    print(f"\n>>> {question}", flush=True)
    final = None
    while core.has_unfinished():
        for o in core.step():
            if not ns.no_stream:
                print(o.outputs[0].delta_text, end="", flush=True)
            final = o
    if ns.no_stream and final is not None:
        print(final.outputs[0].text, end="")
    if final is not None:
        print(
            f"\n[{final.metrics.num_cached_tokens} of {len(final.prompt_token_ids)} prompt tokens from the prefix cache]"
        )
    print(_report(llm.stats(), time.perf_counter() - t_gen), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
