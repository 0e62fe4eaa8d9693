"""Shared plumbing for benchmarks: environment record, result files, markdown tables.

Every benchmark writes ``benchmarks/results/<bench>-<gpu>.json`` as one object
``{"env": {...}, "rows": [...]}`` (DESIGN.md "Benchmark results") and refreshes its table in
``benchmarks/README.md`` between ``<!-- bench:<name> -->`` markers.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch


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
    (benchmarks/README.md, "Triton 3.9 on the GPU")."""
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


def env_info(peak_tflops: float | None, peak_tbps: float | None) -> dict[str, Any]:
    """The ``env`` object of a result file. Peaks are the measured (or profile) roofline ceilings.
    Beyond DESIGN.md's fields: ``ptxas`` (:func:`ptxas_version`)."""
    import triton

    return {
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


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A GitHub markdown table of ``rows`` restricted to ``columns`` (floats to 3 significant digits)."""

    def fmt(x: Any) -> str:
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
        return "" if x is None else str(x)

    head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    return head + "".join("| " + " | ".join(fmt(r.get(c)) for c in columns) + " |\n" for r in rows)


def write_results(
    bench: str,
    rows: list[dict[str, Any]],
    env: dict[str, Any],
    table_columns: Sequence[str] | None = None,
    out_dir: Path | None = None,
    note: str = "",
) -> Path:
    """Write the result JSON and refresh the benchmark's table in ``benchmarks/README.md``.

    The table's columns and note are kept in ``env`` (``table_columns``, ``note``) so the table can be
    rebuilt from the JSON alone (:func:`refresh_readme_table`, ``flashpage bench table FILE``), e.g.
    after a GPU run wrote its JSON somewhere else. With ``out_dir`` set the README is left alone.

    Returns the path of the JSON file.
    """
    root = repo_root()
    env = dict(env)
    if note:
        env["note"] = note
    if table_columns:
        env["table_columns"] = list(table_columns)
    path = (out_dir or root / "benchmarks" / "results") / f"{bench}-{gpu_slug()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"env": env, "rows": rows}, indent=1) + "\n")
    if table_columns and out_dir is None:
        refresh_readme_table(path)
    return path


def refresh_readme_table(result_json: Path, readme: Path | None = None) -> Path:
    """Rewrite the table of ``result_json`` (``<bench>-<gpu>.json``) in ``benchmarks/README.md``.

    The table sits between ``<!-- bench:<bench>-<gpu> -->`` markers (appended when missing); its
    columns come from ``env["table_columns"]`` (default: every key of the first row).
    """
    data = json.loads(Path(result_json).read_text())
    env, rows = data["env"], data["rows"]
    name = Path(result_json).stem
    bench = name.rsplit("-", 1)[0]
    columns = env.get("table_columns") or (list(rows[0]) if rows else [])
    readme = readme or repo_root() / "benchmarks" / "README.md"
    readme.parent.mkdir(parents=True, exist_ok=True)
    text = readme.read_text() if readme.exists() else "# Benchmarks\n"
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    body = (
        f"{start}\n### {bench} on {env.get('gpu')} (torch {env.get('torch')}, triton {env.get('triton')}, "
        f"{env.get('date')}, commit {env.get('git_commit')})\n\n{env.get('note', '')}\n\n"
        f"{markdown_table(rows, columns)}{end}"
    )
    if start in text and end in text:
        text = text[: text.index(start)] + body + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + body + "\n"
    readme.write_text(text)
    return readme


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
