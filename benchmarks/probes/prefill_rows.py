"""Probe (not part of the library): only the chunked-prefill rows of ``flashpage bench decode``.

Runs :func:`flashpage.bench.decode.bench_prefill_shape` on the bench's prefill shapes (4 x 2048 new
tokens after a 2048-token paged prefix, GQA 32/8 d=128 and 16/4 d=256, bf16) with the bench's own
settings (round-robin rounds, 100 ms warm-up), and prints one JSON row per implementation: paged
prefill over 16-token and 128-token pages, the flash varlen kernel on contiguous K/V, SDPA. It takes
~20 s instead of the whole bench's ~90, for comparing builds (e.g. triton versions) on one machine.

Measured (H100, 2026-12-06, b640a36): see ``benchmarks/README.md``, "Triton 3.9 on the GPU".

Run on the GPU: ``PYTHONPATH=src python benchmarks/probes/prefill_rows.py [out.json]``.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from flashpage.bench.decode import _settings, _timer, bench_prefill_shape


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("prefill_rows.py needs a CUDA GPU")
    args = argparse.Namespace(quick=False, smoke=False, variants=False, rounds=None)
    st = _settings(args)
    device = torch.device("cuda")
    time_ms = _timer(device, st.warmup_ms, st.rep_ms)
    rows = []
    for shape in st.prefill:
        r, notes = bench_prefill_shape(shape, st, device, time_ms)
        rows += r
        for x in r:
            print(
                json.dumps({k: x.get(k) for k in ("impl", "variant", "d", "ms", "tflops", "ratio_vs_flash")})
            )
        for n in notes:
            print("note:", n)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "triton": __import__("triton").__version__,
                       "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
