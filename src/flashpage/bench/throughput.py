"""``flashpage bench throughput``: end-to-end offline serving throughput, flashpage vs HF ``generate``.

GPU (default when CUDA is present): a Llama-3-8B-shaped bf16 model with random weights
(``load_format="dummy"``) on the issue's workload: 256 requests with input lengths uniform in
[64, 1024] and output lengths uniform in [32, 512], drawn as::

    g = torch.Generator().manual_seed(0)
    inp = torch.randint(64, 1025, (256,), generator=g)
    out = torch.randint(32, 513, (256,), generator=g)

random prompt token ids, ``ignore_eos=True`` and ``max_tokens=out[i]``, so request ``i`` generates
exactly ``out[i]`` tokens. Reported per implementation: useful output tokens/s (the tokens the requests
asked for / wall time), TTFT and inter-token latency p50/p99, flashpage's peak KV waste, and two
yardsticks, both of the GPU the run is on:

* ``frac_of_roofline``: of the analytic bound (:func:`flashpage.roofline.intensity.workload_bound`)
  on the profile ``--profile`` names (``flashpage bench all`` passes the one ``probe`` measured in the
  same run), else on this device probed now;
* ``frac_of_measured_bound``: of the workload's measured bound (:mod:`flashpage.bench.measured_bound`:
  cuBLAS time of every linear at each step's exact batch, attention at SDPA's measured rates), whose
  seconds go to ``env["measured_bound"]`` (``--skip-measured-bound`` leaves it out).

Baselines in the same run (``--skip-hf`` leaves the first out): ``transformers`` generate with static
batching — the requests in left-padded batches, ``max_new_tokens`` = the longest request of the batch,
default SDPA attention, ``LlamaForCausalLM._from_config(cfg, dtype=bfloat16)``; one batch of all
requests, halved after each out-of-memory error until it fits (the row's ``static_batch`` and ``note``
say so). vLLM when importable (``LLM(load_format="dummy")`` on the same config, token-id prompts), else a
``missing`` row. A baseline that fails is a ``failed`` row with its reason.

CPU (``--cpu-hf``): the embedded SmolLM2-135M-Instruct GGUF (fp32), 32 prompts x 64 new tokens, greedy,
flashpage vs ``transformers`` generate on the same dequantised weights (batched, left padded).

``--smoke`` runs the GPU-mode code path on a tiny dummy model on any device (checks the script).
Results: ``benchmarks/results/throughput-<gpu>.json`` (``flashpage bench report`` renders the tables).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

__all__ = ["gpu_workload", "main"]

TABLE_COLUMNS = [
    "impl",
    "model",
    "dtype",
    "batch",
    "tokens_per_s",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "itl_ms_p50",
    "itl_ms_p99",
    "kv_waste_pct_peak",
    "frac_of_roofline",
    "frac_of_measured_bound",
    "elapsed_s",
    "speedup_vs_hf",
]


def _log(msg: str) -> None:
    print(msg, flush=True)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def gpu_workload(
    num_requests: int = 256, vocab: int = 128256
) -> tuple[list[int], list[int], list[list[int]]]:
    """The issue's workload: input and output lengths (``manual_seed(0)``, inputs first), prompts.

    Prompt token ids come from a second generator (seed 1) so the lengths match the issue exactly.
    """
    g = torch.Generator().manual_seed(0)
    inp = torch.randint(64, 1025, (256,), generator=g)
    out = torch.randint(32, 513, (256,), generator=g)
    gi = torch.Generator().manual_seed(1)
    ins, outs = inp.tolist()[:num_requests], out.tolist()[:num_requests]
    prompts = [torch.randint(0, vocab, (n,), generator=gi).tolist() for n in ins]
    return ins, outs, prompts


# ----------------------------------------------------------------------------------------------------
# flashpage
# ----------------------------------------------------------------------------------------------------


def run_flashpage(
    loaded: Any,
    prompts: list[list[int]],
    out_lens: list[int],
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int | None,
    max_model_len: int,
    enforce_eager: bool,
    kv_cache_bytes: int | None,
    block_size: int,
    greedy: bool,
    warmup: bool = True,
) -> dict[str, Any]:
    """Run the workload through the engine; returns figures and the engine stats."""
    from flashpage.engine.llm import LLM
    from flashpage.engine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=loaded,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enforce_eager=enforce_eager,
        kv_cache_bytes=kv_cache_bytes,
        block_size=block_size,
    )
    core = llm.engine
    st = core.stats()
    _log(
        f"[flashpage] engine up in {time.perf_counter() - t0:.1f} s: {st['kv_blocks_total']} KV blocks "
        f"({st['kv_cache_bytes'] / 2**30:.1f} GiB), max_model_len {st['max_model_len']}, "
        f"{st['cuda_graphs']['num_graphs']} CUDA graphs ({st['cuda_graphs']['capture_s']:.1f} s)"
    )
    temp = 0.0 if greedy else 1.0
    if warmup:
        # Compile every kernel variant first: plain prefill, chunked prefill mixed with decodes, decode.
        t0 = time.perf_counter()
        n = min(8, len(prompts))
        mnbt = core.max_num_batched_tokens
        warm = [p[: max(1, min(len(p), mnbt // 2))] for p in prompts[:n]]
        llm.generate(warm, SamplingParams(temperature=temp, max_tokens=8, ignore_eos=True), use_tqdm=False)
        llm.generate(
            warm[:2], SamplingParams(temperature=temp, max_tokens=4, ignore_eos=True), use_tqdm=False
        )
        _log(f"[flashpage] warm-up {time.perf_counter() - t0:.1f} s")
        core.block_manager.reset_prefix_cache()
        llm.reset_stats()
    params = [SamplingParams(temperature=temp, max_tokens=o, ignore_eos=True) for o in out_lens]
    t0 = time.perf_counter()
    for i, (p, sp) in enumerate(zip(prompts, params)):
        core.add_request(f"bench-{i}", p, sp, arrival_time=t0, stream=False)
    done: dict[str, Any] = {}
    last = t0
    while core.has_unfinished():
        for o in core.step():
            done[o.request_id] = o
        now = time.perf_counter()
        if now - last > 2.0:
            last = now
            toks = core.stats()["generation_tokens"]
            _log(
                f"[flashpage] {now - t0:6.1f} s: {len(done)}/{len(prompts)} done, {toks} tokens, "
                f"running {core.num_running}, waiting {core.num_waiting}"
            )
    elapsed = time.perf_counter() - t0
    outs = [done[f"bench-{i}"] for i in range(len(prompts))]
    bad = [i for i, (o, n) in enumerate(zip(outs, out_lens)) if len(o.outputs[0].token_ids) != n]
    if bad:
        raise RuntimeError(f"requests {bad[:5]} did not generate exactly their output length")
    ttft = [1e3 * o.metrics.ttft for o in outs if o.metrics.ttft is not None]
    itl = [1e3 * x for o in outs for x in o.metrics.inter_token_latencies]
    stats = llm.stats()
    useful = sum(out_lens)
    res = {
        "elapsed_s": elapsed,
        "tokens_per_s": useful / elapsed,
        "ttft_ms_p50": _pct(ttft, 50),
        "ttft_ms_p99": _pct(ttft, 99),
        "itl_ms_p50": _pct(itl, 50),
        "itl_ms_p99": _pct(itl, 99),
        "kv_waste_pct_peak": stats["kv_waste_pct_at_peak"],
        "kv_waste_pct_max": stats["kv_waste_pct_max"],
        "kv_peak_blocks_used": stats["kv_peak_blocks_used"],
        "kv_blocks_total": stats["kv_blocks_total"],
        "num_preemptions": stats["num_preemptions"],
        "steps": stats["steps"],
        "busy_s": stats["busy_s"],
        "schedule_s": stats["schedule_s"],
        "launch_s": stats["launch_s"],
        "roofline": stats["roofline"],
        "cuda_graphs": stats["cuda_graphs"],
    }
    llm.close()
    del llm, core
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


# ----------------------------------------------------------------------------------------------------
# transformers generate (static batching)
# ----------------------------------------------------------------------------------------------------


def _hf_generate_timed(model: Any, prompts: list[list[int]], max_new: int, pad_id: int, device: torch.device) -> dict[str, Any]:  # fmt: skip
    """One left-padded static batch; step times recorded by a logits processor (one call per token)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class _Clock(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.times.append(time.perf_counter())
            return scores

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    clock = _Clock()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        y = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new,  # no early stop: every row runs max_new steps (static batching)
            do_sample=False,
            pad_token_id=pad_id,
            logits_processor=LogitsProcessorList([clock]),
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0
    steps = clock.times
    return {
        "elapsed_s": elapsed,
        "new_tokens": int(y.shape[1] - width),
        "ttft_s": steps[0] - t0 if steps else None,
        "itl_s": [b - a for a, b in pairwise(steps)],
    }


def _hf_row_figures(r: dict[str, Any], useful: int, n: int) -> dict[str, Any]:
    itl = [1e3 * x for x in r["itl_s"]]
    ttft = None if r["ttft_s"] is None else 1e3 * r["ttft_s"]
    return {
        "elapsed_s": r["elapsed_s"],
        "tokens_per_s": useful / r["elapsed_s"],
        # Static batching: every request gets its first token when the whole batch's prefill is done.
        "ttft_ms_p50": ttft,
        "ttft_ms_p99": ttft,
        "itl_ms_p50": _pct(itl, 50),
        "itl_ms_p99": _pct(itl, 99),
        "batch": n,
    }


def hf_static_batches(
    generate: Any, prompts: list[list[int]], out_lens: list[int], batch: int
) -> dict[str, Any]:
    """The workload as consecutive static batches of ``batch`` requests (in order), each generating
    the longest output of its batch: ``generate(prompts, max_new)`` -> :func:`_hf_generate_timed`'s
    dict. Returns elapsed seconds over all batches, every request's TTFT (its batch's start offset
    plus the batch's first-token time) and every step's inter-token latency."""
    elapsed, ttft, itl = 0.0, [], []
    for i in range(0, len(prompts), batch):
        r = generate(prompts[i : i + batch], max(out_lens[i : i + batch]))
        if r["ttft_s"] is not None:
            ttft += [elapsed + r["ttft_s"]] * len(prompts[i : i + batch])
        itl += r["itl_s"]
        elapsed += r["elapsed_s"]
    return {"elapsed_s": elapsed, "ttft_s": ttft, "itl_s": itl}


def run_hf_baseline(
    generate: Any, prompts: list[list[int]], out_lens: list[int], base: dict[str, Any]
) -> dict[str, Any]:
    """The ``hf-generate`` row: all requests in one static batch, halved after each out-of-memory
    error until it fits (``note`` and ``reason`` say which batches did not fit); a ``failed`` row
    when even batch 1 (or anything else) fails."""
    from flashpage.bench.common import failure_reason, run_with_batch_fallback, status_row

    n = len(prompts)
    try:
        r, b, oom = run_with_batch_fallback(lambda b: hf_static_batches(generate, prompts, out_lens, b), n)
    except Exception as e:
        return status_row(
            "throughput",
            "hf-generate",
            "failed",
            failure_reason(e),
            **{k: v for k, v in base.items() if k != "bench"},
        )
    itl = [1e3 * x for x in r["itl_s"]]
    ttft = [1e3 * x for x in r["ttft_s"]]
    row = {
        **base,
        "impl": "hf-generate",
        "elapsed_s": r["elapsed_s"],
        "tokens_per_s": sum(out_lens) / r["elapsed_s"],
        "ttft_ms_p50": _pct(ttft, 50),
        "ttft_ms_p99": _pct(ttft, 99),
        "itl_ms_p50": _pct(itl, 50),
        "itl_ms_p99": _pct(itl, 99),
        "static_batch": b,
    }
    if oom:
        row["note"] = (
            f"out of memory at static batch {', '.join(map(str, oom))}: ran {-(-n // b)} consecutive "
            f"batches of {b} (the largest that fits)"
        )
        row["reason"] = row["note"]
    return row


def run_vllm_baseline(
    hf_config: dict[str, Any], prompts: list[list[int]], out_lens: list[int], base: dict[str, Any]
) -> dict[str, Any]:
    """The ``vllm`` row: vLLM's offline ``LLM`` with dummy weights on the same config (token-id
    prompts, ``ignore_eos``, the same output lengths), timed like flashpage's run after a warm-up;
    ``missing`` when vLLM is not importable, ``failed`` with the reason when it raises."""
    import importlib.util
    import json
    import tempfile

    from flashpage.bench.common import failure_reason, status_row

    fields = {k: v for k, v in base.items() if k != "bench"}
    if importlib.util.find_spec("vllm") is None:
        return status_row("throughput", "vllm", "missing", "vllm is not installed", **fields)
    try:
        from vllm import LLM as VLLM  # type: ignore[import-not-found]
        from vllm import SamplingParams as VParams  # type: ignore[import-not-found]

        with tempfile.TemporaryDirectory(prefix="flashpage-vllm-") as d:
            Path(d, "config.json").write_text(json.dumps({**hf_config, "torch_dtype": "bfloat16"}))
            llm = VLLM(model=d, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0)
            ps = [{"prompt_token_ids": p} for p in prompts]
            params = [
                VParams(max_tokens=o, ignore_eos=True, temperature=1.0, detokenize=False) for o in out_lens
            ]
            llm.generate(ps[:8], params[:8], use_tqdm=False)  # warm-up
            t0 = time.perf_counter()
            outs = llm.generate(ps, params, use_tqdm=False)
            elapsed = time.perf_counter() - t0
        got = sum(len(o.outputs[0].token_ids) for o in outs)
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception as e:
        return status_row("throughput", "vllm", "failed", failure_reason(e), **fields)
    return {**base, "impl": "vllm", "elapsed_s": elapsed, "tokens_per_s": sum(out_lens) / elapsed,
            "generated_tokens": got}  # fmt: skip


# ----------------------------------------------------------------------------------------------------
# Modes
# ----------------------------------------------------------------------------------------------------


def _gpu_mode(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any], str]:
    from flashpage.models.config import get_builtin_config
    from flashpage.models.loader import load_model
    from flashpage.roofline.intensity import workload_bound
    from flashpage.roofline.model_shapes import get_model_shape, model_shape_from_config

    smoke = args.smoke
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    if smoke:
        from flashpage.models.config import ModelConfig

        cfg = ModelConfig(
            architecture="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
            num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=2048,
        )  # fmt: skip
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        name = "tiny (dummy)"
        n_req = args.num_requests or 8
    else:
        cfg = get_builtin_config("llama-3-8b")
        dtype = torch.bfloat16
        name = "llama-3-8b (dummy)"
        n_req = args.num_requests or (32 if args.quick else 256)
    ins, outs, prompts = gpu_workload(n_req, cfg.vocab_size)
    if smoke:  # keep the CPU check short
        ins = [min(x, 40) for x in ins]
        outs = [min(x, 6) for x in outs]
        prompts = [p[:n] for p, n in zip(prompts, ins)]
    useful = sum(outs)
    _log(
        f"workload: {n_req} requests, {sum(ins)} prompt tokens (mean {statistics.mean(ins):.0f}), "
        f"{useful} output tokens (mean {statistics.mean(outs):.0f}, max {max(outs)}); model {name} {dtype} on {device}"
    )
    from flashpage.bench.common import run_profile
    from flashpage.bench.measured_bound import measure_workload_bound

    profile = run_profile(args.profile, quick=True)
    shape = model_shape_from_config(cfg.to_hf_config(), name=name) if smoke else get_model_shape("llama-3-8b")
    bound = workload_bound(shape, profile, list(zip(ins, outs)), dtype="bf16")
    _log(
        f"roofline bound ({profile.name} profile): {bound.total_s:.2f} s = {bound.useful_tokens_per_s:.0f} useful "
        f"tokens/s (prefill {bound.prefill_s:.2f} s, decode {bound.decode_s:.2f} s)"
    )
    measured = None
    if not args.skip_measured_bound:
        measured = measure_workload_bound(
            shape, ins, outs, device, dtype, max_batch_tokens=args.max_num_batched_tokens or 8192,
            tiny_attention=smoke,
        )  # fmt: skip
        _log(
            f"measured bound on this device: {measured.total_s:.2f} s = {measured.useful_tokens_per_s:.0f} useful "
            f"tokens/s (prefill {measured.prefill_s:.2f} s, decode {measured.decode_s:.2f} s; attention "
            f"{measured.prefill_attn_tflops:.0f} TFLOP/s prefill, {measured.decode_kv_tbps:.2f} TB/s decode; "
            f"measured in {measured.details['measure_s']:.0f} s)"
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()
    rows: list[dict[str, Any]] = []
    base = {"bench": "throughput", "model": name, "dtype": str(dtype).removeprefix("torch."), "batch": n_req}

    def yardsticks(tokens_per_s: float) -> dict[str, Any]:
        out = {"frac_of_roofline": bound.fraction_of_bound(tokens_per_s)}
        if measured is not None:
            out["frac_of_measured_bound"] = measured.fraction_of_bound(tokens_per_s)
        return out

    t0 = time.perf_counter()
    loaded = load_model(name, dtype=dtype, device=device, load_format="dummy", config=cfg, seed=0)
    _log(f"[flashpage] dummy model on {device} in {time.perf_counter() - t0:.1f} s")
    fp = run_flashpage(
        loaded,
        prompts,
        outs,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=min(cfg.max_position_embeddings, 2048),
        enforce_eager=args.enforce_eager,
        kv_cache_bytes=args.kv_cache_bytes,
        block_size=args.block_size,
        greedy=False,
    )
    fp_row = {
        **base,
        "impl": "flashpage",
        "block_size": args.block_size,
        **{k: v for k, v in fp.items() if k not in ("roofline", "cuda_graphs")},
        **yardsticks(fp["tokens_per_s"]),
        "roofline_bound_tokens_per_s": bound.useful_tokens_per_s,
        "kernels": {ph: d["kernel"] for ph, d in fp["roofline"].items()},
        "cuda_graph_decode_steps": fp["roofline"].get("decode", {}).get("graph_steps", 0),
    }
    if measured is not None:
        fp_row["measured_bound_tokens_per_s"] = measured.useful_tokens_per_s
    rows.append(fp_row)
    measured_txt = (
        f", {100 * fp_row['frac_of_measured_bound']:.1f}% of the measured bound"
        if measured is not None
        else ""
    )
    _log(
        f"[flashpage] {fp['tokens_per_s']:.0f} useful tokens/s in {fp['elapsed_s']:.1f} s "
        f"({100 * fp_row['frac_of_roofline']:.1f}% of the roofline bound{measured_txt}); TTFT p50 {fp['ttft_ms_p50']:.0f} ms "
        f"p99 {fp['ttft_ms_p99']:.0f} ms; ITL p50 {fp['itl_ms_p50']:.1f} ms p99 {fp['itl_ms_p99']:.1f} ms; "
        f"peak KV waste {fp['kv_waste_pct_peak']:.2f}%; {fp['num_preemptions']} preemptions; "
        f"decode steps on CUDA graphs {fp_row['cuda_graph_decode_steps']}/{fp['roofline'].get('decode', {}).get('steps', 0)}; "
        f"step time {fp['busy_s']:.2f} s of which scheduler {fp['schedule_s']:.2f} s, input build + launch "
        f"{fp['launch_s']:.2f} s"
    )
    del loaded
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    if not args.skip_hf:
        rows.append(_hf_gpu_row(cfg, dtype, device, prompts, outs, base))
    if not args.skip_vllm and not smoke:
        rows.append(run_vllm_baseline(cfg.to_hf_config(), prompts, outs, base))
    for r in rows[1:]:
        if r.get("status") is None:
            r.update(yardsticks(r["tokens_per_s"]))
            _log(
                f"[{r['impl']}] {r['tokens_per_s']:.0f} useful tokens/s in {r['elapsed_s']:.1f} s"
                + (f" ({r['note']})" if r.get("note") else "")
            )
            if r["impl"] == "hf-generate":
                fp_row["speedup_vs_hf"] = fp_row["tokens_per_s"] / r["tokens_per_s"]
        else:
            _log(f"[{r['impl']}] {r['status']}: {r['reason']}")
    note = (
        f"{n_req} requests, input ~U[64,1024], output ~U[32,512] (torch.Generator().manual_seed(0)), "
        f"random token ids, ignore_eos; useful output tokens/s; analytic bound {bound.useful_tokens_per_s:.0f} "
        f"tokens/s ({profile.name})"
        + (f", measured bound {measured.useful_tokens_per_s:.0f} tokens/s." if measured is not None else ".")
    )
    extra = {"measured_bound": measured.to_env()} if measured is not None else {}
    extra["analytic_bound"] = {"total_s": bound.total_s, "useful_tokens_per_s": bound.useful_tokens_per_s}
    return rows, {"profile": profile, "extra": extra}, note


def _hf_gpu_row(
    cfg: Any,
    dtype: torch.dtype,
    device: torch.device,
    prompts: list[list[int]],
    outs: list[int],
    base: dict[str, Any],
) -> dict[str, Any]:
    """The ``hf-generate`` row of the GPU workload (``missing`` without transformers)."""
    from flashpage.bench.common import failure_reason, status_row

    fields = {k: v for k, v in base.items() if k != "bench"}
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        return status_row("throughput", "hf-generate", "missing", f"transformers: {e}", **fields)
    hf_cfg = LlamaConfig(**{k: v for k, v in cfg.to_hf_config().items() if k not in ("architectures",)})
    t0 = time.perf_counter()
    try:
        with torch.device(device):
            try:
                model = LlamaForCausalLM._from_config(hf_cfg, dtype=dtype).eval()
            except TypeError:  # transformers 4.x spells it torch_dtype
                model = LlamaForCausalLM._from_config(hf_cfg, torch_dtype=dtype).eval()
    except Exception as e:
        return status_row("throughput", "hf-generate", "failed", failure_reason(e), **fields)
    _log(f"[hf-generate] model built in {time.perf_counter() - t0:.1f} s; static batches from {len(prompts)} "
         f"requests down (halved on out of memory)")  # fmt: skip
    holder = [model]
    del model
    row = run_hf_baseline(
        lambda ps, mx: _hf_generate_timed(holder[0], ps, mx, 0, device), prompts, outs, base
    )
    holder.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _cpu_prompts(n: int) -> list[str]:
    subjects = ["the ocean", "a small robot", "the history of Rome", "quantum computers", "a rainy day",
                "the moon landing", "bread baking", "a chess game", "mountain hiking", "the printing press",
                "honey bees", "a jazz concert", "volcanoes", "the internet", "a lighthouse keeper", "tea"]  # fmt: skip
    forms = ["Write a short story about {}.", "Explain {} to a child.", "List three facts about {}.",
             "Describe {} in a few sentences."]  # fmt: skip
    return [forms[i % len(forms)].format(subjects[i % len(subjects)]) for i in range(n)]


def _cpu_hf_figures(prompts: list[list[int]], new: int, pad: int) -> dict[str, Any]:
    """``transformers`` generate of ``prompts`` (one left-padded batch, ``new`` tokens each) on the
    embedded GGUF's dequantised weights, after a warm-up: :func:`_hf_row_figures`."""
    import transformers

    from flashpage.models.loader import embedded_model_path

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = embedded_model_path("smollm2-135m-instruct")
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32, local_files_only=True
    ).eval()
    _log(f"[hf-generate] loaded in {time.perf_counter() - t0:.1f} s")
    device = torch.device("cpu")
    _hf_generate_timed(model, prompts[:2], 4, pad, device)  # warm-up
    r = _hf_generate_timed(model, prompts, new, pad, device)
    return _hf_row_figures(r, len(prompts) * new, len(prompts))


def _cpu_mode(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any], str]:
    from flashpage.engine.llm import LLM
    from flashpage.engine.sampling_params import SamplingParams
    from flashpage.models.loader import load_model

    n, new = (8, 16) if args.quick else (32, 64)
    device = torch.device("cpu")
    t0 = time.perf_counter()
    loaded = load_model("smollm2-135m-instruct", dtype=torch.float32, device=device)
    _log(f"[flashpage] SmolLM2-135M-Instruct GGUF loaded in {time.perf_counter() - t0:.1f} s; torch threads {torch.get_num_threads()}")  # fmt: skip
    tok = loaded.tokenizer
    # Chat-formatted (the model is an instruct model), so lengths vary as real requests do.
    prompts = [
        list(tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                add_generation_prompt=True), add_special_tokens=False))
        for q in _cpu_prompts(n)
    ]  # fmt: skip
    _log(
        f"prompt lengths {min(map(len, prompts))}..{max(map(len, prompts))} tokens (mean {statistics.mean(map(len, prompts)):.0f})"
    )
    llm = LLM(model=loaded, max_num_seqs=max(n, 1))
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    llm.engine.block_manager.reset_prefix_cache()
    llm.reset_stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    fp_s = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == new for o in outs)
    fp_tps = n * new / fp_s
    st = llm.stats()
    ttft = [1e3 * o.metrics.ttft for o in outs if o.metrics.ttft is not None]
    itl = [1e3 * x for o in outs for x in o.metrics.inter_token_latencies]
    _log(f"[flashpage] {n} prompts x {new} tokens: {fp_s:.2f} s, {fp_tps:.1f} tokens/s")
    base = {
        "bench": "throughput",
        "model": "smollm2-135m-instruct (GGUF Q4_1 -> fp32)",
        "dtype": "float32",
        "batch": n,
    }
    rows = [
        {
            **base,
            "impl": "flashpage",
            "block_size": 16,
            "elapsed_s": fp_s,
            "tokens_per_s": fp_tps,
            "ttft_ms_p50": _pct(ttft, 50),
            "ttft_ms_p99": _pct(ttft, 99),
            "itl_ms_p50": _pct(itl, 50),
            "itl_ms_p99": _pct(itl, 99),
            "kv_waste_pct_peak": st["kv_waste_pct_at_peak"],
        }
    ]
    llm.close()
    del llm
    if not args.skip_hf:
        try:
            hf = _cpu_hf_figures(prompts, new, int(tok.eos_token_id if tok.eos_token_id is not None else 0))
        except Exception as e:  # a baseline that cannot run is a row, never the end of the run
            from flashpage.bench.common import failure_reason, status_row

            rows.append(status_row("throughput", "hf-generate", "failed", failure_reason(e),
                                   **{k: v for k, v in base.items() if k != "bench"}))  # fmt: skip
        else:
            rows.append({**base, **hf, "impl": "hf-generate"})
            rows[0]["speedup_vs_hf"] = fp_tps / hf["tokens_per_s"]
            _log(
                f"[hf-generate] {n} prompts x {new} tokens: {hf['elapsed_s']:.2f} s, {hf['tokens_per_s']:.1f} "
                f"tokens/s; flashpage / hf = {rows[0]['speedup_vs_hf']:.2f}x"
            )
    from flashpage.bench.common import run_profile
    from flashpage.bench.measured_bound import measure_workload_bound
    from flashpage.roofline.intensity import workload_bound
    from flashpage.roofline.model_shapes import get_model_shape

    profile = run_profile(args.profile, quick=True)
    shape = get_model_shape("smollm2-135m")
    lens = [len(p) for p in prompts]
    bound = workload_bound(shape, profile, [(x, new) for x in lens], dtype="fp32")
    measured = None
    if not args.skip_measured_bound:
        measured = measure_workload_bound(shape, lens, [new] * n, device, torch.float32, tiny_attention=True)
    for r in rows:
        if r.get("status") is None:
            r["frac_of_roofline"] = bound.fraction_of_bound(r["tokens_per_s"])
            if measured is not None:
                r["frac_of_measured_bound"] = measured.fraction_of_bound(r["tokens_per_s"])
    note = (
        f"CPU, {torch.get_num_threads()} threads: {n} prompts x {new} new tokens, greedy, same GGUF weights."
    )
    extra = {"analytic_bound": {"total_s": bound.total_s, "useful_tokens_per_s": bound.useful_tokens_per_s}}
    if measured is not None:
        extra["measured_bound"] = measured.to_env()
    return rows, {"profile": profile, "extra": extra}, note


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (see the module docstring); returns 0 on success."""
    p = argparse.ArgumentParser(prog="flashpage bench throughput", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cpu-hf", action="store_true", help="CPU: SmolLM2-135M flashpage vs transformers generate"
    )
    p.add_argument("--skip-hf", action="store_true", help="leave out the transformers baseline")
    p.add_argument(
        "--quick",
        action="store_true",
        help="32 requests (GPU) / 8 x 16 tokens (CPU); no result file unless --out",
    )
    p.add_argument(
        "--smoke", action="store_true", help="GPU-mode code path on a tiny dummy model, any device"
    )
    p.add_argument("--cpu", action="store_true", help="with --smoke: run on CPU even when CUDA is present")
    p.add_argument("--num-requests", type=int, default=None, help="first N requests of the workload")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default 8192 on GPU")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-bytes", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--skip-vllm", action="store_true", help="leave out the vLLM baseline")
    p.add_argument(
        "--skip-measured-bound",
        action="store_true",
        help="do not measure the workload's bound on this device",
    )
    p.add_argument(
        "--profile",
        default=None,
        help="hardware profile JSON the bounds use (flashpage bench all passes the one probe measured); "
        "default: this device probed now",
    )
    p.add_argument("--out", "--out-dir", dest="out_dir", type=Path, default=None, help="results directory")
    args = p.parse_args(argv)
    if args.cpu_hf:
        rows, run, note = _cpu_mode(args)
    elif torch.cuda.is_available() or args.smoke:
        rows, run, note = _gpu_mode(args)
    else:
        print(
            "flashpage bench throughput: no CUDA GPU; use --cpu-hf (CPU vs transformers) or --smoke",
            file=sys.stderr,
        )
        return 2
    from flashpage.bench.common import env_info, markdown_table, write_results

    print(markdown_table(rows, TABLE_COLUMNS), flush=True)
    if (args.quick or args.smoke) and args.out_dir is None:
        _log("(quick/smoke run: no result file written; pass --out DIR to keep it)")
        return 0
    env = {**env_info(None, None, profile=run["profile"]), **run["extra"]}
    path = write_results(
        "throughput", rows, env, table_columns=TABLE_COLUMNS, out_dir=args.out_dir, note=note
    )
    _log(f"results written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
