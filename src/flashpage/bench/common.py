"""Shared plumbing for benchmarks: environment record, roofline of this machine, result files.

Every benchmark writes ``benchmarks/results/<bench>-<gpu>.json`` as one object
``{"env": {...}, "rows": [...]}`` (DESIGN.md "Benchmark results"); ``flashpage bench report``
renders ``benchmarks/README.md`` from those files. Rows are validated by :func:`validate_rows`: a
measured row carries ``frac_of_roofline`` (:func:`roofline_fraction`, against the profile measured on
the GPU it ran on, :func:`run_profile`); a baseline that is missing or failed is a row with ``status``
(``"missing"`` / ``"failed"``) and ``reason`` (:func:`status_row`), never dropped.
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from flashpage.roofline.hardware import HardwareProfile


def repo_root() -> Path:
    """The checkout's root (where ``benchmarks/`` lives): the nearest parent holding pyproject.toml."""
    here = Path(__file__).resolve()
    for p in here.parents:
        if (p / "pyproject.toml").exists():
            return p
    return Path.cwd()


def gpu_slug() -> str:
    """Short device name for result file names: ``h200``, ``h100``, ``a100``, ``cpu``..."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    for key in ("h200", "h100", "a100", "l40s", "4090", "b200", "gh200"):
        if key in name:
            return key
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=repo_root(), capture_output=True, text=True, check=True
    ).stdout.strip()


def git_commit() -> str:
    """The measured code's commit: ``FLASHPAGE_GIT_COMMIT`` if set (a copy of the tree on another
    machine may carry a stale ``.git``), else the checkout's HEAD with ``+dirty`` when the tracked
    files differ from it; ``unknown`` outside git."""
    env = os.environ.get("FLASHPAGE_GIT_COMMIT")
    if env:
        return env
    try:
        head = _git("rev-parse", "--short=12", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}+dirty" if dirty else head


def ptxas_version() -> str | None:
    """The CUDA release (e.g. ``"13.4"``) of the ``ptxas`` triton compiles kernels for this GPU with;
    ``None`` without a CUDA GPU or when triton's NVIDIA backend cannot say.

    Kernel speed depends on it as much as on the triton version: triton 3.9 compiles sm_90 with its
    bundled CUDA 13.4 ``ptxas-blackwell`` (3.6: its CUDA 12.8 ``ptxas``), and one H100 run of 3.9
    with a CUDA 12.9 ptxas read the flash varlen kernel 15% slower than with its own
    (docs/perf-notes.md, "Triton 3.9 on the GPU")."""
    if not torch.cuda.is_available():
        return None
    try:
        from triton.backends.nvidia.compiler import get_ptxas_version

        major, minor = torch.cuda.get_device_capability()
        text = str(get_ptxas_version(major * 10 + minor))
    except (ImportError, AttributeError, OSError, RuntimeError, subprocess.CalledProcessError):
        return None
    found = re.search(r"cuda_(\d+\.\d+)", text) or re.search(r"release (\d+\.\d+)", text)
    return found[1] if found else (text.strip().splitlines() or [None])[-1]


def env_info(
    peak_tflops: float | None, peak_tbps: float | None, profile: HardwareProfile | None = None
) -> dict[str, Any]:
    """The ``env`` object of a result file. Peaks are the measured roofline ceilings (bf16 matmul
    TFLOP/s, copy TB/s); with ``profile`` given they are its figures and the datasheet's sit beside
    them. Beyond DESIGN.md's fields: ``ptxas`` (:func:`ptxas_version`), and with a profile
    ``profile`` (its name) and ``datasheet`` (``{"profile", "peak_tflops", "peak_tbps"}`` or None)."""
    import triton

    env: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d"),
        "git_commit": git_commit(),
        "peak_tflops": peak_tflops,
        "peak_tbps": peak_tbps,
        "ptxas": ptxas_version(),
    }
    if profile is not None:
        env["peak_tflops"], env["peak_tbps"] = profile_peaks(profile)
        env["profile"] = profile.name
        sheet = datasheet_for(profile)
        env["datasheet"] = (
            None
            if sheet is None
            else {
                "profile": sheet.name,
                "peak_tflops": profile_peaks(sheet)[0],
                "peak_tbps": profile_peaks(sheet)[1],
            }
        )
    return env


# ------------------------------------------------------------------------------------------------
# The roofline of the machine a benchmark runs on
# ------------------------------------------------------------------------------------------------
def compute_dtype_key(profile: HardwareProfile) -> str:
    """The dtype key whose peak stands for "compute" in frac_of_roofline: bf16 on GPUs (every GPU
    benchmark runs bf16; a GPU profile has a tf32 path), fp32 on CPUs (where the smoke runs compute
    in fp32), bf16 when a profile has no fp32 figure."""
    return "bf16" if "tf32" in profile.peak_flops or "fp32" not in profile.peak_flops else "fp32"


def profile_peaks(profile: HardwareProfile) -> tuple[float, float]:
    """``(peak TFLOP/s of the compute dtype, bandwidth TB/s)`` of ``profile``."""
    return profile.peak(compute_dtype_key(profile)) / 1e12, profile.hbm_bandwidth / 1e12


def datasheet_for(profile: HardwareProfile) -> HardwareProfile | None:
    """The datasheet profile of the GPU ``profile`` was measured on (None for CPUs / unknown GPUs)."""
    from flashpage.roofline.hardware import load_profile, profile_from_gpu_name

    name = profile.details.get("datasheet_profile")
    if name:
        try:
            return load_profile(str(name))
        except ValueError:
            return None
    dev = profile.details.get("device_name")
    return profile_from_gpu_name(str(dev)) if dev else None


def run_profile(path: str | os.PathLike[str] | None, quick: bool = False) -> HardwareProfile:
    """The roofline a benchmark scores its rows against: the profile JSON at ``path`` (``flashpage
    bench all`` measures it once with ``probe`` and hands it to every benchmark), else this device
    measured now by :func:`flashpage.roofline.probe.probe` (``quick``: a few seconds). Never a
    datasheet: a row's fraction must be of the machine it ran on."""
    from flashpage.roofline.hardware import load_profile
    from flashpage.roofline.probe import probe

    if path is not None:
        return load_profile(path)
    return probe(quick=quick)


def roofline_fraction(flops: float, nbytes: float, seconds: float, profile: HardwareProfile) -> float:
    """Fraction of the roofline reached by an op of ``flops`` FLOP moving ``nbytes`` bytes in
    ``seconds``: its FLOP/s over the measured peak when compute-bound, its bytes/s over the measured
    bandwidth when memory-bound; i.e. achieved / ``min(peak, intensity * bandwidth)`` =
    ``max(flop_rate / peak, byte_rate / bandwidth)``."""
    if seconds <= 0:
        raise ValueError(f"seconds: must be > 0, got {seconds}")
    peak = profile.peak(compute_dtype_key(profile))
    return max(flops / seconds / peak, nbytes / seconds / profile.hbm_bandwidth)


# ------------------------------------------------------------------------------------------------
# Rows: measured, missing, failed
# ------------------------------------------------------------------------------------------------
#: Benchmark names a row's ``bench`` may take (DESIGN.md "Benchmark results").
ROW_BENCHES: tuple[str, ...] = ("attention", "decode", "prefill", "throughput", "serve")
#: ``status`` values of a row that carries no measurement.
NOT_MEASURED: tuple[str, ...] = ("missing", "failed")


def status_row(bench: str, impl: str, status: str, reason: str, **fields: Any) -> dict[str, Any]:
    """A row for a baseline that did not run: ``status`` ``"missing"`` (not installed / not
    supported here) or ``"failed"`` (it raised, e.g. out of memory), with a one-line ``reason``."""
    if status not in NOT_MEASURED:
        raise ValueError(f"status: expected one of {', '.join(NOT_MEASURED)}, got {status!r}")
    return {
        "bench": bench,
        "impl": impl,
        **fields,
        "status": status,
        "reason": " ".join(reason.split())[:240],
    }


def failure_reason(exc: BaseException) -> str:
    """``"<ExceptionType>: <first line>"`` (out of memory spelled as such)."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{'out of memory: ' if is_oom(exc) else ''}{type(exc).__name__}: {first}"[:240]


def is_oom(exc: BaseException) -> bool:
    """True for a CUDA (or CPU allocator) out-of-memory error."""
    oom = getattr(torch.cuda, "OutOfMemoryError", None)
    if oom is not None and isinstance(exc, oom):
        return True
    return isinstance(exc, (RuntimeError, MemoryError)) and (
        isinstance(exc, MemoryError) or "out of memory" in str(exc).lower()
    )


def run_with_batch_fallback(
    run: Callable[[int], Any], batch: int, free: Callable[[], None] | None = None
) -> tuple[Any, int, list[int]]:
    """``run(batch)``, halving ``batch`` after each out-of-memory error until it fits.

    Returns ``(result, batch that ran, batches that ran out of memory)``. Other errors propagate, as
    does the OOM at batch 1. ``free`` (default: ``torch.cuda.empty_cache`` on CUDA) runs after each
    OOM so the next try starts from a clean allocator."""
    if batch < 1:
        raise ValueError(f"batch: must be >= 1, got {batch}")
    tried: list[int] = []
    while True:
        try:
            return run(batch), batch, tried
        except Exception as e:
            if not is_oom(e) or batch == 1:
                raise
            tried.append(batch)
            batch //= 2
        # Outside the handler: the failed try's traceback (and the tensors its frames hold) is gone.
        gc.collect()
        if free is not None:
            free()
        elif torch.cuda.is_available():
            torch.cuda.empty_cache()


#: Keys every measured row needs beyond ``bench`` and ``impl``.
_MEASURED_KEYS = ("frac_of_roofline",)
#: One of these figures makes a row measured.
_FIGURES = ("ms", "tokens_per_s", "tflops", "tbps")


def validate_rows(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Problems with ``rows`` against the result format (empty when none): every row has ``bench``
    (one of :data:`ROW_BENCHES`) and ``impl``; a row with ``status`` missing/failed has a
    ``reason``; any other row has a figure (``ms`` / ``tokens_per_s`` / ...) and, except serve rows
    (throughput at a concurrency), a finite ``frac_of_roofline`` > 0."""
    import math

    problems: list[str] = []
    for i, r in enumerate(rows):
        where = f"rows[{i}] ({r.get('bench')}/{r.get('impl')})"
        if r.get("bench") not in ROW_BENCHES:
            problems.append(f"{where}: bench must be one of {', '.join(ROW_BENCHES)}")
        if not isinstance(r.get("impl"), str) or not r.get("impl"):
            problems.append(f"{where}: impl missing")
        status = r.get("status", "ok")
        if status in NOT_MEASURED:
            if not isinstance(r.get("reason"), str) or not r["reason"]:
                problems.append(f"{where}: status {status} needs a reason")
            continue
        if status != "ok":
            problems.append(f"{where}: unknown status {status!r}")
        if not any(isinstance(r.get(k), (int, float)) for k in _FIGURES):
            problems.append(f"{where}: no measured figure ({', '.join(_FIGURES)})")
        for k in _MEASURED_KEYS:
            if r.get("bench") == "serve":  # throughput at a concurrency: no roofline of its own
                continue
            v = r.get(k)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                problems.append(f"{where}: {k} must be a finite number > 0, got {v!r}")
    return problems


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A GitHub markdown table of ``rows`` restricted to ``columns`` (floats to 3 significant digits)."""

    def fmt(x: Any) -> str:
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
        return "" if x is None else str(x)

    head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    return head + "".join("| " + " | ".join(fmt(r.get(c)) for c in columns) + " |\n" for r in rows)


def results_dir(out_dir: Path | None = None) -> Path:
    """Where result files go: ``out_dir``, else ``benchmarks/results`` of the checkout."""
    return out_dir if out_dir is not None else repo_root() / "benchmarks" / "results"


def write_results(
    bench: str,
    rows: list[dict[str, Any]],
    env: dict[str, Any],
    table_columns: Sequence[str] | None = None,
    out_dir: Path | None = None,
    note: str = "",
) -> Path:
    """Write ``<out_dir>/<bench>-<gpu>.json`` (default dir ``benchmarks/results``); returns its path.

    ``note`` and ``table_columns`` are kept in ``env`` (the run's own remarks and the columns its
    console table printed). Rows that :func:`validate_rows` finds fault with are reported on stderr. ``benchmarks/README.md`` is rendered from these files by ``flashpage
    bench report``, never edited by a run.
    """
    env = dict(env)
    if note:
        env["note"] = note
    if table_columns:
        env["table_columns"] = list(table_columns)
    path = results_dir(out_dir) / f"{bench}-{gpu_slug()}.json"
    for problem in validate_rows(rows):  # written anyway: a half-right file beats a lost run
        print(f"warning: {path.name}: {problem}", file=sys.stderr, flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"env": env, "rows": rows}, indent=1) + "\n")
    return path


def make_timer(device: torch.device, warmup_ms: int, rep_ms: int) -> Callable[[Callable[[], Any]], float]:
    """Median milliseconds of a call: :func:`do_bench_ms` on CUDA (``warmup_ms`` / ``rep_ms``), the
    median of 3 wall-clock runs after one warm-up elsewhere (CPU smoke runs and tests)."""
    if device.type == "cuda":
        return lambda fn: do_bench_ms(fn, warmup=warmup_ms, rep=rep_ms)

    def wall(fn: Callable[[], Any]) -> float:
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[1]

    return wall


def do_bench_ms(fn: Callable[[], Any], warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn`` on the GPU (``triton.testing.do_bench``, warm-up first)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def round_robin(
    items: Sequence[Any],
    measure: Callable[[Any], Any],
    rounds: int,
    on_error: Callable[[Any, Exception], None],
) -> list[list[Any] | None]:
    """``measure(item)`` of every item in ``rounds`` rounds, each round every item once in order (so
    a drift of the GPU's clocks or power state over a shape's minute reaches each alike). Returns
    each item's per-round results, or ``None`` for an item whose ``measure`` raised: it is reported to
    ``on_error`` once and left out of later rounds."""
    results: list[list[Any] | None] = [[] for _ in items]
    for _ in range(rounds):
        for i, item in enumerate(items):
            got = results[i]
            if got is None:
                continue
            try:
                got.append(measure(item))
            except Exception as e:
                results[i] = None
                on_error(item, e)
    return results


def graph_ms(
    fn: Callable[[], Any], device: torch.device, time_ms: Callable[[Callable[[], Any]], float], reps: int = 1
) -> float | None:
    """Milliseconds per call of ``fn`` replayed from a CUDA graph holding ``reps`` calls: GPU time
    without host cost (and proof that ``fn`` is capturable). ``None`` off CUDA or when the capture
    fails."""
    if device.type != "cuda":
        return None
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm: compilation and allocations outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        return time_ms(graph.replay) / reps
    except Exception:  # capture unsupported here
        return None
