"""``flashpage bench report``: ``benchmarks/README.md`` and the roofline plots from the result files,
and the regression check against the previously committed results.

Inputs: ``<results>/<bench>-<gpu>.json`` (DESIGN.md "Benchmark results") and, where ``flashpage bench
all`` measured one, ``<results>/probe-<gpu>.json`` (the run's hardware profile, with per-kernel
``efficiency``). Per GPU the README gets, per benchmark, one table: a line per problem shape, a
column per implementation (its figure and its % of the roofline measured on that GPU; ``missing`` /
``failed`` where a baseline did not run), and flashpage's ratio to the best baseline; under it a note
of at most three lines (what is measured, the summary, the baselines that did not run).

Regression check: every flashpage row is matched by (bench, implementation label, dtype, shape, pass)
with the rows of the same GPU at a git ref (``git show REF:benchmarks/results/...``, default HEAD);
a figure more than ``threshold`` (5%) below the old one is a regression. ``--check`` exits 1 on one.
The report also records each GPU's per-kernel efficiency (:func:`kernel_efficiency`) in its
``probe-<gpu>.json``, so results gathered in separate runs feed the planner too.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashpage.bench.common import NOT_MEASURED, repo_root

__all__ = [
    "METRICS",
    "Regression",
    "ResultSet",
    "find_regressions",
    "kernel_efficiency",
    "load_results",
    "main",
    "plot_gpu_roofline",
    "render_readme",
    "results_at_ref",
]

#: The figure each benchmark is compared on (higher is better) and its unit.
METRICS: dict[str, tuple[str, str]] = {
    "attention": ("tflops", "TFLOP/s"),
    "decode": ("tbps", "TB/s"),
    "prefill": ("tflops", "TFLOP/s"),
    "throughput": ("tokens_per_s", "tok/s"),
    "serve": ("tokens_per_s", "tok/s"),
}
#: The fields that name one problem of a benchmark (a table line).
SHAPE_KEYS: dict[str, tuple[str, ...]] = {
    "attention": ("d", "seqlen", "batch", "nheads", "causal", "pass"),
    "decode": ("batch", "ctx", "nheads", "nheads_k", "d"),
    "prefill": ("batch", "ctx", "seqlen", "nheads", "nheads_k", "d"),
    "throughput": ("model", "batch"),
    "serve": ("model", "concurrency", "requests"),
}
#: flashpage's headline row per benchmark: the variant that stands for "flashpage".
_PRIMARY_VARIANTS = (None, "", "planner", "paged-prefill")
#: What each benchmark measures: the first line of its note.
_BENCH_NOTES: dict[str, str] = {
    "attention": "FlashAttention fwd/bwd, bf16, 16k tokens total, model dim 2048; TFLOP/s from 4·b·h·s²·d "
    "(/2 causal, bwd 2.5x); % of the measured bf16 matmul peak.",
    "decode": "Paged decode, one new token per sequence, block size 16 (flashpage, gather-sdpa, flashinfer) vs "
    "contiguous KV (sdpa-*, flash-attn); TB/s of KV read; % of the measured copy bandwidth.",
    "prefill": "Chunked prefill: new tokens after a cached prefix, bottom-right causal; TFLOP/s over the "
    "visible pairs; % of the measured bf16 matmul peak.",
    "throughput": "Offline throughput, useful output tokens/s on the bench's request list (ignore_eos); "
    "% of the analytic roofline bound (measured bound: frac_of_measured_bound).",
    "serve": "Streaming completions over HTTP at fixed concurrency against flashpage serve; output tokens/s "
    "beside offline LLM.generate of the same requests in the same run.",
}
_ORDER = ("attention", "decode", "prefill", "throughput", "serve")


# ------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------
@dataclass
class ResultSet:
    """The result files of one GPU: their rows (each row knows its ``bench``), each file's env by
    bench, and the probe profile (a dict, as in ``probe-<gpu>.json``) when there is one."""

    gpu: str
    rows: list[dict[str, Any]]
    envs: dict[str, dict[str, Any]]
    profile: dict[str, Any] | None = None


def _split_name(stem: str) -> tuple[str, str] | None:
    """``"decode-h100"`` -> ``("decode", "h100")``; None for names that are not ``<bench>-<gpu>``."""
    if "-" not in stem:
        return None
    bench, gpu = stem.split("-", 1)
    return bench, gpu


def _add(sets: dict[str, ResultSet], name: str, data: Any) -> None:
    parts = _split_name(Path(name).stem)
    if parts is None or not isinstance(data, dict):
        return
    bench, gpu = parts
    rs = sets.setdefault(gpu, ResultSet(gpu, [], {}))
    if bench == "probe":
        rs.profile = data
        return
    if "rows" not in data:
        return
    rows = [r for r in data["rows"] if isinstance(r, dict)]
    rs.rows += rows
    for b in {r.get("bench", bench) for r in rows} or {bench}:
        rs.envs.setdefault(b, data.get("env") or {})


def load_results(results: Path) -> dict[str, ResultSet]:
    """Every ``<bench>-<gpu>.json`` (and ``probe-<gpu>.json``) directly under ``results``, by GPU."""
    sets: dict[str, ResultSet] = {}
    for path in sorted(Path(results).glob("*-*.json")):
        _add(sets, path.name, json.loads(path.read_text()))
    return sets


def results_at_ref(ref: str, results: Path) -> dict[str, ResultSet]:
    """The result files committed at git ``ref`` in ``results`` (a directory inside a git checkout),
    by GPU; empty when there is no checkout, no such ref or no such directory there."""
    d = Path(results).resolve()

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=d, capture_output=True, text=True, check=True).stdout

    try:
        rel = git("rev-parse", "--show-prefix").strip().rstrip("/")
        d = Path(git("rev-parse", "--show-toplevel").strip())  # ls-tree filters by the cwd otherwise
        names = git("ls-tree", "--name-only", f"{ref}:{rel}").split()
    except (OSError, subprocess.CalledProcessError):
        return {}
    sets: dict[str, ResultSet] = {}
    for name in names:
        if name.endswith(".json"):
            try:
                _add(sets, name, json.loads(git("show", f"{ref}:{rel}/{name}" if rel else f"{ref}:{name}")))
            except (subprocess.CalledProcessError, json.JSONDecodeError):
                continue
    return sets


# ------------------------------------------------------------------------------------------------
# Rows: labels, keys, figures
# ------------------------------------------------------------------------------------------------
def measured(row: dict[str, Any]) -> bool:
    """A row with a figure (not a missing / failed baseline)."""
    return row.get("status", "ok") not in NOT_MEASURED


def label(row: dict[str, Any]) -> str:
    """The implementation column a row goes to: the impl; flashpage's non-headline variants as
    ``flashpage/<variant>``; an fp8 KV row gets `` fp8``."""
    name = str(row.get("impl"))
    if name == "flashpage" and row.get("variant") not in _PRIMARY_VARIANTS:
        name += f"/{row['variant']}"
    if str(row.get("dtype", "")).startswith("fp8") or str(row.get("dtype", "")).startswith("float8"):
        name += " fp8"
    return name


def shape_key(row: dict[str, Any]) -> tuple[Any, ...]:
    """The problem a row measured (its table line)."""
    return tuple(row.get(k) for k in SHAPE_KEYS.get(str(row.get("bench")), ()))


def _shape_text(bench: str, key: tuple[Any, ...]) -> str:
    """A table line's short problem name."""
    v = dict(zip(SHAPE_KEYS.get(bench, ()), key))
    try:
        if bench == "attention":
            return (f"{v['pass']} d{v['d']} s{v['seqlen']} b{v['batch']} h{v['nheads']}"
                    f"{' causal' if v['causal'] else ''}")  # fmt: skip
        if bench == "decode":
            return f"b{v['batch']} ctx{v['ctx']} h{v['nheads']}/{v['nheads_k']} d{v['d']}"
        if bench == "prefill":
            cached = int(v["ctx"]) - int(v["seqlen"])
            return (
                f"b{v['batch']} {v['seqlen']} new + {cached} cached, h{v['nheads']}/{v['nheads_k']} d{v['d']}"
            )
        if bench == "throughput":
            return f"{v['model']}, {v['batch']} requests"
        if bench == "serve":
            return f"{v['model']}, concurrency {v['concurrency']}, {v['requests']} requests"
    except (KeyError, TypeError, ValueError):
        pass
    return " ".join(f"{n}={x}" for n, x in v.items() if x is not None)


def figure(row: dict[str, Any]) -> float | None:
    """The row's comparison figure (:data:`METRICS`), or None."""
    v = row.get(METRICS.get(str(row.get("bench")), ("", ""))[0])
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) and v > 0 else None


def _is_headline(row: dict[str, Any]) -> bool:
    return label(row) == "flashpage"


# ------------------------------------------------------------------------------------------------
# README
# ------------------------------------------------------------------------------------------------
def _fmt(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return ""
    if not measured(row):
        return str(row.get("status"))
    f = figure(row)
    if f is None:
        return ""
    frac = row.get("frac_of_roofline")
    return _fmt(f) + (f" ({100 * frac:.0f}%)" if isinstance(frac, (int, float)) else "")


def bench_table(bench: str, rows: Sequence[dict[str, Any]]) -> tuple[str, list[float], list[str]]:
    """The markdown table of one benchmark's rows; also flashpage's ratios to the best baseline (per
    line that has both) and the labels of baselines that did not run, with their reason."""
    unit = METRICS[bench][1]
    if bench == "serve":
        rows = _serve_rows(rows)
    labels: list[str] = []
    for r in sorted(rows, key=lambda r: (not label(r).startswith("flashpage"), label(r) != "flashpage")):
        if label(r) not in labels:
            labels.append(label(r))
    lines: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = {}
    for r in rows:
        cells = lines.setdefault(shape_key(r), {})
        lab = label(r)
        old = cells.get(lab)
        # Several rows of one label and shape (e.g. configs): keep the best measured one.
        if old is None or (measured(r) and (not measured(old) or (figure(r) or 0) > (figure(old) or 0))):
            cells[lab] = r
    head = ["shape", *labels, "flashpage / best baseline"]
    out = [
        f"{unit} (% of roofline) per implementation\n",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    ratios: list[float] = []
    for key, cells in lines.items():
        mine = cells.get("flashpage")
        base = [
            (figure(r), lab)
            for lab, r in cells.items()
            if not lab.startswith("flashpage") and measured(r) and figure(r) is not None
        ]
        ratio = ""
        if mine is not None and figure(mine) is not None and base:
            best, who = max(base, key=lambda t: t[0] or 0.0)
            q = figure(mine) / best  # type: ignore[operator]
            ratios.append(q)
            ratio = f"{q:.2f}x ({who})"
        out.append(
            "| " + " | ".join([_shape_text(bench, key), *(_cell(cells.get(x)) for x in labels), ratio]) + " |"
        )
    not_run: dict[str, str] = {}
    for r in rows:
        if not measured(r):
            not_run.setdefault(label(r), f"{r.get('status')}: {r.get('reason', '')}")
    return "\n".join(out) + "\n", ratios, [f"{k} ({v})" for k, v in not_run.items()]


def _serve_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Serve rows as table rows: each server level, with the offline ``LLM.generate`` run of the same
    requests (its ``offline_tokens_per_s``) as that line's baseline; failed offline runs kept."""
    out: list[dict[str, Any]] = []
    for r in rows:
        if r.get("mode") == "offline":
            if not measured(r):
                out.append({**r, "impl": "offline LLM.generate"})
            continue
        out.append(r)
        if isinstance(r.get("offline_tokens_per_s"), (int, float)):
            keep = {k: r.get(k) for k in ("bench", "model", "concurrency", "requests", "dtype")}
            out.append({**keep, "impl": "offline LLM.generate", "tokens_per_s": r["offline_tokens_per_s"]})
    return out


def bench_note(bench: str, rows: Sequence[dict[str, Any]], ratios: list[float], not_run: list[str]) -> str:
    """At most three lines: what is measured, the summary, the baselines that did not run."""
    lines = [_BENCH_NOTES.get(bench, "")]
    fracs = [
        r["frac_of_roofline"]
        for r in rows
        if _is_headline(r) and isinstance(r.get("frac_of_roofline"), (int, float))
    ]
    summary = []
    if ratios:
        g = math.exp(statistics.fmean(math.log(x) for x in ratios))
        if len(ratios) == 1:
            summary.append(f"flashpage / best baseline: {g:.2f}x")
        else:
            summary.append(f"flashpage / best baseline: geomean {g:.2f}x over {len(ratios)} shapes "
                           f"({min(ratios):.2f}x to {max(ratios):.2f}x)")  # fmt: skip
    if fracs:
        summary.append(f"flashpage median {100 * statistics.median(fracs):.0f}% of roofline")
    mb = [
        r["frac_of_measured_bound"]
        for r in rows
        if _is_headline(r) and isinstance(r.get("frac_of_measured_bound"), (int, float))
    ]
    if mb:
        summary.append(f"{100 * mb[0]:.0f}% of the measured bound")
    if summary:
        lines.append("; ".join(summary) + ".")
    if not_run:
        text = "Not measured: " + "; ".join(not_run)
        lines.append(text if len(text) <= 400 else text[:397] + "...")
    return "\n".join(x for x in lines if x)


def _gpu_title(rs: ResultSet) -> str:
    names = {e.get("gpu") for e in rs.envs.values() if e.get("gpu")}
    return f"{rs.gpu.upper()}" + (f" ({', '.join(sorted(map(str, names)))})" if names else "")


def _compute_peak(profile: dict[str, Any]) -> float | None:
    """The FLOP/s rows are fractions of (:func:`flashpage.bench.common.compute_dtype_key`)."""
    pf = profile.get("peak_flops") or {}
    key = "bf16" if "tf32" in pf or "fp32" not in pf else "fp32"
    return pf.get(key)


def _ceilings(rs: ResultSet) -> str:
    prof = rs.profile
    if prof:
        bf16 = _compute_peak(prof)
        eff = prof.get("efficiency") or {}
        text = (
            f"Measured roofline (`probe-{rs.gpu}.json`): {_fmt(bf16 / 1e12)} TFLOP/s matmul, "
            f"{_fmt(prof['hbm_bandwidth'] / 1e12)} TB/s copy"
        )
        sheet = next((e.get("datasheet") for e in rs.envs.values() if e.get("datasheet")), None)
        if sheet:
            text += f"; datasheet {_fmt(sheet['peak_tflops'])} TFLOP/s, {_fmt(sheet['peak_tbps'])} TB/s"
        if eff:
            text += "; kernel efficiency " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(eff.items()))
        return text + "."
    tf = next(
        (e["peak_tflops"] for e in rs.envs.values() if isinstance(e.get("peak_tflops"), (int, float))), None
    )
    tb = next(
        (e["peak_tbps"] for e in rs.envs.values() if isinstance(e.get("peak_tbps"), (int, float))), None
    )
    parts = ([f"{_fmt(tf)} TFLOP/s matmul"] if tf else []) + ([f"{_fmt(tb)} TB/s copy"] if tb else [])
    return ("Roofline recorded with the results: " + ", ".join(parts) + ".") if parts else ""


def render_readme(sets: dict[str, ResultSet], plots: dict[str, str] | None = None) -> str:
    """The whole ``benchmarks/README.md`` (``plots``: GPU -> PNG file name beside the README)."""
    out = [
        "# Benchmarks",
        "",
        'Generated by `flashpage bench report` from `results/*.json` (DESIGN.md "Benchmark results"); '
        "do not edit by hand. Run everything on a GPU with `flashpage bench all` (`--quick`: about 5 "
        "minutes); `flashpage bench report --check` flags a flashpage figure more than 5% below the "
        "committed one. Cells: figure (% of the roofline measured on that GPU). Findings and run history: "
        "`docs/perf-notes.md`.",
    ]
    for gpu in sorted(sets, key=lambda g: (g == "cpu", g)):
        rs = sets[gpu]
        if not rs.rows:
            continue
        out += ["", f"## {_gpu_title(rs)}", ""]
        ceil = _ceilings(rs)
        if ceil:
            out += [ceil, ""]
        if plots and gpu in plots:
            out += [f"![roofline {gpu}]({plots[gpu]})", ""]
        benches = sorted({str(r.get("bench")) for r in rs.rows}, key=lambda b: (*_ORDER, b).index(b))
        for bench in benches:
            if bench not in METRICS:
                continue
            rows = [r for r in rs.rows if r.get("bench") == bench]
            env = rs.envs.get(bench, {})
            out += [
                f"### {bench}",
                "",
                f"torch {env.get('torch')}, triton {env.get('triton')}, CUDA {env.get('cuda')}, "
                f"{env.get('date')}, commit {str(env.get('git_commit'))[:12]}",
                "",
            ]
            table, ratios, not_run = bench_table(bench, rows)
            out += [table, bench_note(bench, rows, ratios, not_run), ""]
    return "\n".join(out).rstrip() + "\n"


# ------------------------------------------------------------------------------------------------
# Regressions
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Regression:
    """A flashpage figure that fell by more than the threshold against the ref's."""

    gpu: str
    bench: str
    label: str
    shape: str
    old: float
    new: float

    @property
    def change(self) -> float:
        return self.new / self.old - 1.0

    def __str__(self) -> str:
        unit = METRICS.get(self.bench, ("", ""))[1]
        return (f"{self.gpu} {self.bench} {self.label} {self.shape}: {_fmt(self.old)} -> {_fmt(self.new)} {unit} "
                f"({100 * self.change:+.1f}%)")  # fmt: skip


def _match_key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row.get("bench"), label(row), row.get("dtype"), shape_key(row))


def find_regressions(
    new: dict[str, ResultSet], old: dict[str, ResultSet], threshold: float = 0.05
) -> list[Regression]:
    """flashpage rows of ``new`` whose figure is below ``(1 - threshold)`` x the matching row of
    ``old`` (same GPU, bench, label, dtype, shape). Rows without a match are not compared."""
    found: list[Regression] = []
    for gpu, rs in new.items():
        before = {
            _match_key(r): figure(r)
            for r in (old[gpu].rows if gpu in old else [])
            if str(r.get("impl")) == "flashpage" and measured(r)
        }
        for r in rs.rows:
            if str(r.get("impl")) != "flashpage" or not measured(r):
                continue
            was, now = before.get(_match_key(r)), figure(r)
            if was and now and now < (1.0 - threshold) * was:
                bench = str(r.get("bench"))
                found.append(Regression(gpu, bench, label(r), _shape_text(bench, shape_key(r)), was, now))
    return found


# ------------------------------------------------------------------------------------------------
# Measured efficiency and the roofline plot
# ------------------------------------------------------------------------------------------------
def _kernel_of(row: dict[str, Any]) -> str | None:
    """The planner kernel name a flashpage headline row measured (None for rows of no single kernel)."""
    if not _is_headline(row) or not measured(row):
        return None
    bench = row.get("bench")
    if bench == "attention":
        return "flash_fwd" if row.get("pass") == "fwd" else "flash_bwd"
    if bench == "decode":
        return "paged_decode_splitkv" if (row.get("num_splits") or 1) > 1 else "paged_decode"
    if bench == "prefill":
        return "paged_prefill"
    return None


def kernel_efficiency(rows: Iterable[dict[str, Any]]) -> dict[str, float]:
    """Per planner kernel, the median ``frac_of_roofline`` of flashpage's headline rows of it."""
    by: dict[str, list[float]] = {}
    for r in rows:
        k = _kernel_of(r)
        f = r.get("frac_of_roofline")
        if k and isinstance(f, (int, float)) and 0 < f <= 2:
            by.setdefault(k, []).append(float(f))
    return {k: statistics.median(v) for k, v in sorted(by.items())}


def _elt(row: dict[str, Any]) -> int:
    d = str(row.get("dtype", "bfloat16"))
    return 1 if d.startswith(("fp8", "float8")) else 4 if d in ("float32", "fp32") else 2


def flops_bytes(row: dict[str, Any]) -> tuple[float, float] | None:
    """``(FLOP, bytes)`` of one call of a kernel row (the benches' formulas), or None."""
    ms = row.get("ms")
    if not measured(row) or not isinstance(ms, (int, float)) or ms <= 0:
        return None
    try:
        b, d, h = int(row["batch"]), int(row["d"]), int(row["nheads"])
        hk, e = int(row.get("nheads_k") or h), _elt(row)
        bench = row.get("bench")
        if bench == "attention":
            s = int(row["seqlen"])
            flops = float(row["tflops"]) * ms * 1e9
            return flops, (4 if row.get("pass") == "fwd" else 8) * b * s * h * d * e
        if bench == "decode":
            ctx = int(row["ctx"])
            return 4.0 * b * h * ctx * d, 2.0 * b * ctx * hk * d * e
        if bench == "prefill":
            ctx, new = int(row["ctx"]), int(row["seqlen"])
            return float(row["tflops"]) * ms * 1e9, 2.0 * b * new * h * d * e + 2.0 * b * ctx * hk * d * e
    except (KeyError, TypeError, ValueError):
        return None
    return None


def _peaks(rs: ResultSet) -> tuple[float, float] | None:
    """(peak TFLOP/s, TB/s) of a GPU's roofline: its probe profile, else the peaks its envs recorded."""
    if rs.profile:
        peak = _compute_peak(rs.profile)
        if peak:
            return peak / 1e12, rs.profile["hbm_bandwidth"] / 1e12
    tf = next(
        (e["peak_tflops"] for e in rs.envs.values() if isinstance(e.get("peak_tflops"), (int, float))), None
    )
    tb = next(
        (e["peak_tbps"] for e in rs.envs.values() if isinstance(e.get("peak_tbps"), (int, float))), None
    )
    return (tf, tb) if tf and tb else None


def _point_label(row: dict[str, Any]) -> str:
    bench = row.get("bench")
    if bench == "attention":
        return f"{row.get('pass')} d{row.get('d')} {int(row.get('seqlen', 0)) // 1024}k{' c' if row.get('causal') else ''}"
    if bench == "decode":
        return f"dec b{row.get('batch')} {int(row.get('ctx', 0)) // 1024}k h{row.get('nheads')}/{row.get('nheads_k')}"
    return f"prefill d{row.get('d')} {row.get('seqlen')}+{int(row.get('ctx', 0)) - int(row.get('seqlen', 0))}"


def plot_gpu_roofline(rs: ResultSet, path: Path) -> Path | None:
    """Draw ``rs``'s measured roofline with every kernel row as a point at (FLOP/byte, TFLOP/s):
    flashpage filled circles (its headline rows labelled), each baseline its own marker. Returns the
    PNG path, or None when the GPU has no roofline or no kernel rows."""
    peaks = _peaks(rs)
    pts = [(r, fb) for r in rs.rows if (fb := flops_bytes(r)) is not None]
    if peaks is None or not pts:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    peak, bw = peaks
    ridge = peak / bw
    xs = [f / b for _, (f, b) in pts]
    lo, hi = min([*xs, ridge]) / 3, max([*xs, ridge]) * 3
    fig = Figure(figsize=(11, 7), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(grid, [min(peak, x * bw) for x in grid], color="black", lw=2,
            label=f"measured roofline: {peak:.0f} TFLOP/s, {bw:.2f} TB/s")  # fmt: skip
    ax.axvline(ridge, color="gray", ls="--", lw=1, label=f"ridge {ridge:.0f} FLOP/B")
    markers = ["s", "^", "v", "D", "P", "X", "<", ">", "h", "*"]
    colors = ["tab:blue", "tab:green", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
              "tab:cyan", "tab:gray", "navy"]  # fmt: skip
    impls = sorted({label(r) for r, _ in pts if not label(r).startswith("flashpage")})
    placed: list[tuple[float, float]] = []  # label anchors (log10 x, log10 y): no label over another

    def free(x: float, y: float) -> bool:
        lx, ly = math.log10(x), math.log10(y)
        if any(abs(lx - px) < 0.35 and abs(ly - py) < 0.07 for px, py in placed):
            return False
        placed.append((lx, ly))
        return True

    for i, name in enumerate(["flashpage", *impls]):
        sel = [(r, fb) for r, fb in pts if label(r) == name]
        x = [f / b for _, (f, b) in sel]
        y = [f / (r["ms"] * 1e-3) / 1e12 for r, (f, _b) in sel]
        if name == "flashpage":
            ax.scatter(x, y, marker="o", s=40, color="tab:red", zorder=4, label="flashpage")
            for r, xi, yi in zip((r for r, _ in sel), x, y):
                if free(xi, yi):
                    ax.annotate(
                        _point_label(r), (xi, yi), textcoords="offset points", xytext=(4, 3), fontsize=6
                    )
        else:
            c = colors[(i - 1) % len(colors)]
            ax.scatter(x, y, marker=markers[(i - 1) % len(markers)], s=24, facecolors="none", edgecolors=c,
                       zorder=3, label=name)  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(f"{_gpu_title(rs)}: decode left of the ridge (memory-bound), prefill/attention right")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


# ------------------------------------------------------------------------------------------------
# Command
# ------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Render the README and plots; compare with ``--baseline-ref``. Returns 1 with ``--check`` when a
    flashpage figure regressed, 2 on bad input, else 0."""
    p = argparse.ArgumentParser(prog="flashpage bench report", description=__doc__.split("\n\n")[0])
    root = repo_root()
    p.add_argument(
        "--results", type=Path, default=root / "benchmarks" / "results", help="result files directory"
    )
    p.add_argument(
        "--readme", type=Path, default=None, help="README to write (default: README.md in --results' parent)"
    )
    p.add_argument("--baseline-ref", default="HEAD", help="git ref of the results to compare with (HEAD)")
    p.add_argument("--threshold", type=float, default=0.05, help="regression threshold (0.05 = 5%%)")
    p.add_argument("--check", action="store_true", help="exit 1 when a flashpage figure regressed")
    p.add_argument("--no-plot", action="store_true", help="skip the roofline PNGs")
    args = p.parse_args(argv)
    if not args.results.is_dir():
        print(f"flashpage bench report: --results {args.results} is not a directory", file=sys.stderr)
        return 2
    readme = args.readme or args.results.parent / "README.md"
    sets = load_results(args.results)
    for gpu, rs in sets.items():  # the rows' measured kernel efficiency into the GPU's probe profile
        probe = args.results / f"probe-{gpu}.json"
        eff = kernel_efficiency(rs.rows)
        if rs.profile is not None and eff and rs.profile.get("efficiency") != eff:
            rs.profile["efficiency"] = eff
            probe.write_text(json.dumps(rs.profile, indent=1) + "\n")
            print(f"recorded kernel efficiency in {probe}")
    plots: dict[str, str] = {}
    if not args.no_plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("matplotlib missing (pip install 'flashpage[plot]'): no roofline plots", file=sys.stderr)
        else:
            for gpu, rs in sets.items():
                out = plot_gpu_roofline(rs, readme.parent / f"roofline-{gpu}.png")
                if out is not None:
                    plots[gpu] = out.name
                    print(f"drew {out}")
    readme.parent.mkdir(parents=True, exist_ok=True)
    readme.write_text(render_readme(sets, plots))
    print(f"wrote {readme}")
    before = results_at_ref(args.baseline_ref, args.results)
    regs = find_regressions(sets, before, args.threshold)
    for r in regs:
        print(f"REGRESSION {r}")
    if not before:
        print(f"no committed results at {args.baseline_ref} to compare with")
    elif not regs:
        print(f"no flashpage figure more than {100 * args.threshold:.0f}% below {args.baseline_ref}")
    return 1 if regs and args.check else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
