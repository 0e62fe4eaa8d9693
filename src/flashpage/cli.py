"""The ``flashpage`` command: ``roofline``, ``probe``, ``demo``, ``serve``, ``bench``, ``netprobe`` (each with
``--help``).

Every subcommand imports its machinery inside its handler, so ``flashpage --help`` stays fast.

- ``flashpage roofline [--model NAME|config.json] [--hardware NAME|profile.json] [--batch B] [--seq S]
  [--chunk C] [--dtype D] [--json] [--plot FILE.png]``: per phase and op, the arithmetic intensity,
  ridge, bound, attainable FLOP/s and chosen kernel. Defaults: model ``smollm2-135m`` (the shape of
  the embedded demo model), hardware detected (this GPU's datasheet profile, else this CPU measured
  on the spot), batch 8, seq 4096, chunk 512, dtype bfloat16.
- ``flashpage probe [--out FILE] [--quick]``: measure this device and write a profile JSON that
  ``--hardware FILE`` and ``load_profile`` accept (stdout without ``--out``).
- ``flashpage demo [ARGS...]``: the inference demo ``flashpage.engine.demo.main(ARGS)`` on the
  embedded model (``--help`` lists its options).
- ``flashpage serve [--model NAME|DIR|FILE.gguf] [--host H] [--port P] [--api-key KEY]
  [--tensor-parallel-size N] [engine options...]``: the OpenAI-compatible HTTP server
  (:mod:`flashpage.serve.api_server`: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
  ``/health``, ``/metrics``, ``/stats``, a live page at ``/``); SIGTERM drains running requests.
- ``flashpage bench NAME [--out DIR] [--quick] [ARGS...]``: runs the benchmark ``NAME`` of
  ``flashpage.bench.all.REGISTRY`` (attention, decode, throughput, serve) with the remaining arguments.
- ``flashpage bench all [--quick] [--out DIR] [--only A,B]``: ``probe``, then every benchmark this
  machine supports (:mod:`flashpage.bench.all`).
- ``flashpage bench report [--results DIR] [--check] [--baseline-ref REF]``: render
  ``benchmarks/README.md`` and ``benchmarks/roofline-<gpu>.png`` from the result files and flag
  flashpage figures more than 5% below the committed ones (:mod:`flashpage.bench.report`).
- ``flashpage netprobe [--sizes 8,1K,..] [--iters N] [--backend nccl|gloo] [--json] [--save-profile FILE]``
  (under ``torchrun``): collective latency / bus bandwidth, NCCL's transport per peer, an RDMA verdict.

Exit status: 0 on success, 2 on bad input (the message says what is wrong), 1 when a benchmark fails
or is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["build_parser", "main"]

#: ``flashpage bench`` commands beside the benchmarks of ``flashpage.bench.all.REGISTRY``.
BENCH_COMMANDS: tuple[str, ...] = ("all", "report")


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree of the ``flashpage`` command."""
    parser = argparse.ArgumentParser(
        prog="flashpage",
        description="Roofline-driven LLM attention and inference: FlashAttention and paged-KV kernels, "
        "a roofline planner, and a vLLM-style engine.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{roofline,probe,demo,serve,bench,netprobe}")

    r = sub.add_parser(
        "roofline",
        help="arithmetic intensity, bound and chosen kernel of every phase/op",
        description="Print, per phase (prefill, decode, chunked prefill) and op (attention, GEMMs), the "
        "arithmetic intensity, the hardware ridge point, the bound, the attainable FLOP/s and the kernel "
        "the planner chooses.",
    )
    r.add_argument(
        "--model",
        default="smollm2-135m",
        help="built-in model name or HF config.json path (default: smollm2-135m)",
    )
    r.add_argument(
        "--hardware",
        default=None,
        help="profile name (h200, h200-measured, h100-sxm, a100-80gb, l40s, rtx-4090, cpu) or profile JSON; "
        "default: detected (this GPU's datasheet profile, else this CPU measured now)",
    )
    r.add_argument("--batch", type=int, default=8, help="sequences per step (default: 8)")
    r.add_argument(
        "--seq", type=int, default=4096, help="prompt length / cached context length (default: 4096)"
    )
    r.add_argument(
        "--chunk", type=int, default=512, help="new tokens per chunked-prefill step (default: 512)"
    )
    r.add_argument(
        "--dtype", default="bfloat16", help="bfloat16 | float16 | float32 | fp8 (default: bfloat16)"
    )
    r.add_argument(
        "--json",
        action="store_true",
        help="print the JSON object (list of ops under 'ops') instead of the table",
    )
    r.add_argument(
        "--plot", metavar="FILE.png", default=None, help="also draw the roofline with the ops to this PNG"
    )
    r.add_argument(
        "--world",
        type=int,
        default=None,
        help="also model N GPUs: ring attention's K/V transfer vs compute per step and the tensor-parallel "
        "all-reduce share of a decode step, with warnings when communication-bound",
    )
    r.add_argument(
        "--link",
        default="nvlink4",
        help="link between the GPUs with --world: nvlink4, pcie5, ib-ndr, ib-hdr, roce-400g, roce-200g, tcp, "
        "or a profile JSON from 'flashpage netprobe --save-profile' (default: nvlink4)",
    )

    p = sub.add_parser(
        "probe",
        help="measure this device and write a hardware profile JSON",
        description="Measure matmul FLOP/s per dtype and memory copy bandwidth of this device (GPU: "
        "triton.testing.do_bench; CPU: small sizes, a few seconds) and write a profile JSON.",
    )
    p.add_argument(
        "--out", metavar="FILE", default=None, help="write the profile here (default: print it to stdout)"
    )
    p.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if present, else cpu)")
    p.add_argument("--name", default=None, help="profile name (default: cpu or <gpu>-measured)")

    d = sub.add_parser(
        "demo",
        help="run the inference demo on the embedded model",
        description="Run flashpage.engine.demo with the remaining arguments (see flashpage demo --help).",
    )
    d.set_defaults(forward=True)

    _add_serve_parser(sub)

    n = sub.add_parser(
        "netprobe",
        help="collective latency / bus bandwidth, NCCL transport per peer, RDMA verdict (run under torchrun)",
        description="Under torchrun (torchrun --nproc-per-node N -m flashpage.cli netprobe): time all-reduce, "
        "all-gather and send/recv per message size with nccl-tests' bus-bandwidth factors, parse the transport "
        "NCCL chose per peer from its NCCL_DEBUG=INFO output, and say whether RDMA (GPUDirect) is in use.",
    )
    n.add_argument(
        "--sizes",
        default="8,1K,64K,1M,16M,128M",
        help="message sizes in bytes, comma separated, K/M/G suffixes (default: 8,1K,64K,1M,16M,128M)",
    )
    n.add_argument("--iters", type=int, default=20, help="timed runs per size (default: 20)")
    n.add_argument("--warmup", type=int, default=5, help="untimed runs per size (default: 5)")
    n.add_argument(
        "--backend", choices=["nccl", "gloo"], default=None, help="default: nccl with CUDA, else gloo"
    )
    n.add_argument("--json", action="store_true", help="print one JSON object (rank 0)")
    n.add_argument(
        "--save-profile",
        metavar="FILE",
        default=None,
        help="write a link profile (send/recv bandwidth and latency) for 'flashpage roofline --link FILE'",
    )

    b = sub.add_parser(
        "bench",
        help="run benchmarks (GPU) and render their report",
        description="NAME: one benchmark (attention, decode, throughput, serve; remaining arguments are "
        "forwarded); all: probe, then every benchmark this machine supports; report: render "
        "benchmarks/README.md and the roofline plots, compare with the committed results.",
    )
    b.add_argument("which", metavar="NAME|all|report", help="benchmark name, all, or report")
    b.add_argument("--out", metavar="DIR", default=None, help="results directory (forwarded)")
    b.add_argument("--quick", action="store_true", help="small sweep (forwarded)")
    b.set_defaults(forward=True)
    return parser


def _add_serve_parser(sub: Any) -> None:
    s = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve a model over OpenAI's HTTP API (/v1/models, /v1/completions, /v1/chat/completions, "
        "streaming as server-sent events), with /health, /metrics (Prometheus), /stats and a live page at /. "
        "SIGTERM drains: running requests get --graceful-shutdown seconds, then the process exits 0.",
    )
    s.add_argument(
        "--model", default="smollm2-135m-instruct", help="built-in name, HF directory or .gguf file"
    )
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    s.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every /v1 route (default: $FLASHPAGE_API_KEY, else none)",
    )
    s.add_argument("--served-model-name", action="append", default=None, help="name clients use (repeatable)")
    s.add_argument("--max-queue", type=int, default=256, help="waiting requests before a 429 (default: 256)")
    s.add_argument(
        "--max-tokens-limit", type=int, default=None, help="largest max_tokens (default: the context)"
    )
    s.add_argument(
        "--max-n", type=int, default=16, help="largest n, and most prompts per request (default: 16)"
    )
    s.add_argument(
        "--max-body-bytes", type=int, default=4 * 1024 * 1024, help="largest request body (default: 4 MiB)"
    )
    s.add_argument(
        "--graceful-shutdown",
        type=float,
        default=30.0,
        help="seconds running requests get after SIGTERM (default: 30)",
    )
    e = s.add_argument_group("engine")
    e.add_argument("--dtype", default="auto", help="auto | bfloat16 | float16 | float32")
    e.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if present)")
    e.add_argument("--load-format", default="auto", help="auto | safetensors | gguf | dummy")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--kv-cache-bytes", type=int, default=None)
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    e.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    e.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs (or CPU processes) per model")
    e.add_argument(
        "--engine-in-thread",
        action="store_true",
        help="step the engine in a thread of the server process instead of a process of its own "
        "(shares the GIL with HTTP handling: slower at high concurrency)",
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    import logging
    import os

    from flashpage.engine.async_llm import AsyncLLM
    from flashpage.serve.api_server import ServerConfig, run_server
    from flashpage.serve.metrics import ServerMetrics

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get("FLASHPAGE_API_KEY") or None,
        served_model_names=tuple(args.served_model_name or ()),
        max_queue=args.max_queue,
        max_tokens_limit=args.max_tokens_limit,
        max_n=args.max_n,
        max_body_bytes=args.max_body_bytes,
        graceful_shutdown_s=args.graceful_shutdown,
    )
    metrics = ServerMetrics()
    engine = AsyncLLM(
        args.model,
        observer=metrics.observe,
        dtype=args.dtype,
        device=args.device,
        load_format=args.load_format,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_bytes=args.kv_cache_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=not args.no_prefix_caching,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        engine_process=not args.engine_in_thread,
    )
    metrics.model_name = config.served_model_names[0] if config.served_model_names else engine.model_name
    return run_server(engine, config, metrics)


def _cmd_roofline(args: argparse.Namespace) -> int:
    from flashpage.roofline.hardware import detect_profile, load_profile
    from flashpage.roofline.model_shapes import get_model_shape
    from flashpage.roofline.report import build_report, format_table, plot_roofline, report_json

    shape = get_model_shape(args.model)
    profile = load_profile(args.hardware) if args.hardware else detect_profile()
    report = build_report(shape, profile, batch=args.batch, seq=args.seq, chunk=args.chunk, dtype=args.dtype)
    dist = None
    if args.world is not None:
        from flashpage.roofline.comm import distributed_json, format_distributed
        from flashpage.roofline.links import load_link

        dist = distributed_json(
            shape,
            profile,
            load_link(args.link),
            world=args.world,
            batch=args.batch,
            seq=args.seq,
            dtype=args.dtype,
        )
    if args.json:
        for w in dist["warnings"] if dist else ():  # the table prints them itself
            print(f"flashpage roofline: warning: {w}", file=sys.stderr)
        print(json.dumps({**report_json(report), **({"distributed": dist} if dist else {})}, indent=1))
    else:
        print(format_table(report) + (format_distributed(dist) if dist else ""), end="")
    if args.plot:
        out = plot_roofline(report, args.plot)
        print(f"roofline plot written to {out}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _cmd_probe(args: argparse.Namespace) -> int:
    from flashpage.roofline.hardware import save_profile
    from flashpage.roofline.probe import probe

    prof = probe(device=args.device, quick=args.quick, name=args.name)
    if args.out:
        path = save_profile(prof, args.out)
        peaks = ", ".join(f"{k} {v / 1e12:.3g}" for k, v in prof.peak_flops.items())
        print(f"{prof.name}: matmul TFLOP/s {peaks}; copy {prof.hbm_bandwidth / 1e9:.4g} GB/s -> {path}")
    else:
        print(json.dumps(prof.to_dict(), indent=1))
    return 0


def _parse_sizes(text: str) -> list[int]:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for item in text.split(","):
        item = item.strip().upper()
        try:
            sizes.append(int(item[:-1]) * mult[item[-1]] if item[-1:] in mult else int(item))
        except ValueError:
            raise ValueError(f"--sizes: {item!r} is not a byte count like 8, 64K or 16M") from None
    return sizes


def _cmd_netprobe(args: argparse.Namespace) -> int:
    from flashpage.distributed.netprobe import main as netprobe_main

    return netprobe_main(
        sizes=_parse_sizes(args.sizes),
        iters=args.iters,
        warmup=args.warmup,
        backend=args.backend,
        as_json=args.json,
        save_profile=args.save_profile,
    )


def _cmd_demo(extra: list[str]) -> int:
    from flashpage.engine.demo import main as demo_main

    rc = demo_main(extra)
    return int(rc or 0)


def _cmd_bench(args: argparse.Namespace, extra: list[str]) -> int:
    import importlib

    from flashpage.bench.all import REGISTRY

    names = [e.name for e in REGISTRY]
    fwd = [*(["--out", args.out] if args.out else []), *(["--quick"] if args.quick else []), *extra]
    if args.which == "report":
        if args.quick:
            print("flashpage bench report: --quick does not apply", file=sys.stderr)
            return 2
        fwd = [*(["--results", args.out] if args.out else []), *extra]
    elif args.which not in (*names, *BENCH_COMMANDS):
        print(
            f"flashpage bench: unknown benchmark {args.which!r}; choose one of "
            f"{', '.join((*names, *BENCH_COMMANDS))}",
            file=sys.stderr,
        )
        return 2
    modname = next((e.module for e in REGISTRY if e.name == args.which), f"flashpage.bench.{args.which}")
    try:
        mod = importlib.import_module(modname)
    except ModuleNotFoundError as e:
        if e.name is not None and modname.startswith(e.name):
            print(f"flashpage bench: {modname} is not available yet", file=sys.stderr)
            return 1
        raise
    return int(mod.main(list(fwd)) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``flashpage`` command with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if (
        argv[:1] == ["bench"]
        and len(argv) > 2
        and not argv[1].startswith("-")
        and {"-h", "--help"} & set(argv[2:])
    ):
        # `flashpage bench NAME --help`: the benchmark's own options, not the bench parser's.
        return _cmd_bench(argparse.Namespace(which=argv[1], out=None, quick=False), ["--help"])
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if extra and not getattr(args, "forward", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "demo":
        return _cmd_demo(extra)
    if args.command == "bench":
        return _cmd_bench(args, extra)
    try:
        if args.command == "serve":
            return _cmd_serve(args)
        if args.command == "netprobe":
            return _cmd_netprobe(args)
        return _cmd_roofline(args) if args.command == "roofline" else _cmd_probe(args)
    except ValueError as e:  # bad names, malformed profile files, bad sizes: one clear line, no traceback
        print(f"flashpage {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
