"""The roofline report behind ``flashpage roofline``: a table, the JSON contract, and a log-log plot.

JSON (DESIGN.md "CLI" contract): one object with ``hardware``, ``model``, the run settings and a
list under ``"ops"`` whose items have at least ``phase``, ``op``, ``intensity`` (FLOP/byte),
``ridge`` (FLOP/byte), ``bound`` (``"compute"`` | ``"memory"``) and ``kernel``; they also carry
``num_splits``, ``flops`` and ``bytes`` (per call), ``count`` (calls per forward),
``attainable_tflops``, ``time_ms`` (all calls, roofline least time) and ``shape``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashpage.roofline.hardware import HardwareProfile, normalize_dtype
from flashpage.roofline.model_shapes import ModelShape
from flashpage.roofline.planner import PlannedOp, plan_model

__all__ = ["RooflineReport", "build_report", "format_table", "plot_roofline", "report_json"]


@dataclass(frozen=True)
class RooflineReport:
    """Everything ``flashpage roofline`` prints: settings and the planned ops of every phase."""

    model: ModelShape
    profile: HardwareProfile
    dtype: str
    batch: int
    seq: int
    chunk: int
    ops: tuple[PlannedOp, ...]

    @property
    def ridge(self) -> float:
        return self.profile.ridge(self.dtype)


def build_report(
    model: ModelShape,
    profile: HardwareProfile,
    *,
    batch: int = 8,
    seq: int = 4096,
    chunk: int = 512,
    dtype: Any = "bf16",
) -> RooflineReport:
    """Plan every phase of ``model`` on ``profile`` (see :func:`flashpage.roofline.planner.plan_model`)."""
    key = normalize_dtype(dtype)
    ops = plan_model(model, profile, batch=batch, seq=seq, chunk=chunk, dtype=key)
    return RooflineReport(model, profile, key, batch, seq, chunk, tuple(ops))


def _row(op: PlannedOp) -> dict[str, Any]:
    c, k = op.cost, op.choice
    return {
        "phase": k.phase,
        "op": k.op,
        "intensity": k.intensity,
        "ridge": k.ridge,
        "bound": k.bound,
        "kernel": k.kernel,
        "num_splits": k.num_splits,
        "flops": c.flops,
        "bytes": c.bytes,
        "count": c.count,
        "attainable_tflops": op.attainable_flops / 1e12,
        "time_ms": op.time_s * 1e3,
        "efficiency": op.efficiency,
        "shape": c.detail,
    }


def report_json(report: RooflineReport) -> dict[str, Any]:
    """The JSON object of the DESIGN.md contract (``{"hardware", "model", ..., "ops": [...]}``)."""
    p = report.profile
    return {
        "hardware": {
            "name": p.name,
            "source": p.source,
            "peak_tflops": p.peak(report.dtype) / 1e12,
            "bandwidth_tbps": p.hbm_bandwidth / 1e12,
            "ridge": report.ridge,
            "num_sms": p.num_sms,
        },
        "model": report.model.to_dict(),
        "dtype": report.dtype,
        "batch": report.batch,
        "seq": report.seq,
        "chunk": report.chunk,
        "ops": [_row(op) for op in report.ops],
    }


def _fmt_flops(x: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g} "


def format_table(report: RooflineReport) -> str:
    """A plain-text table: one line per phase/op with intensity, ridge, bound, attainable FLOP/s, kernel."""
    p = report.profile
    head = (
        f"roofline: model {report.model.name}  hardware {p.name}  dtype {report.dtype}  "
        f"batch {report.batch}  seq {report.seq}  chunk {report.chunk}\n"
        f"peak {p.peak(report.dtype) / 1e12:.4g} TFLOP/s, bandwidth {p.hbm_bandwidth / 1e12:.4g} TB/s, "
        f"ridge {report.ridge:.1f} FLOP/B  ({p.source})\n"
    )
    measured = bool(p.efficiency)
    cols = ("phase", "op", "shape", "FLOP/B", "ridge", "bound", "attainable", "time (ms)", "kernel")
    if measured:  # a profile with measured kernel efficiencies: show the fraction each op is scaled by
        cols = (*cols, "eff")
    rows = []
    for op in report.ops:
        k = op.choice
        kernel = k.kernel + (f" x{k.num_splits}" if k.num_splits > 1 else "")
        rows.append(
            (
                k.phase,
                op.cost.op,
                op.cost.detail,
                f"{k.intensity:.1f}",
                f"{k.ridge:.1f}",
                k.bound,
                _fmt_flops(op.attainable_flops) + "FLOP/s",
                f"{op.time_s * 1e3:.3g}",
                kernel,
                *((f"{op.efficiency:.2f}",) if measured else ()),
            )
        )
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    body = [line(cols), line(["-" * w for w in widths])]
    prev = None
    for r in rows:
        if prev is not None and r[0] != prev:
            body.append("")
        body.append(line(r))
        prev = r[0]
    return head + "\n" + "\n".join(body) + "\n"


def plot_roofline(report: RooflineReport, path: str | os.PathLike[str]) -> Path:
    """Draw the roofline (log-log) with every op as a labelled point; write a PNG to ``path``.

    Uses matplotlib's Agg canvas directly (no pyplot, no global backend switch).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:  # matplotlib is the optional "plot" extra
        raise RuntimeError("--plot needs matplotlib (pip install 'flashpage[plot]')") from e

    p = report.profile
    peak, bw = p.peak(report.dtype), p.hbm_bandwidth
    xs = [op.choice.intensity for op in report.ops]
    lo = min([*xs, report.ridge]) / 4
    hi = max([*xs, report.ridge]) * 4
    fig = Figure(figsize=(9, 6), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(grid, [min(peak, x * bw) / 1e12 for x in grid], color="black", lw=2, label=f"{p.name} roofline")
    ax.axvline(report.ridge, color="gray", ls="--", lw=1, label=f"ridge {report.ridge:.0f} FLOP/B")
    colors = {"prefill": "tab:red", "decode": "tab:blue", "chunked_prefill": "tab:green"}
    for op in report.ops:
        k = op.choice
        y = op.attainable_flops / 1e12
        ax.scatter([k.intensity], [y], color=colors.get(k.phase, "tab:gray"), zorder=3)
        ax.annotate(
            f"{k.phase}/{k.op}", (k.intensity, y), textcoords="offset points", xytext=(4, -10), fontsize=7
        )
    for phase, c in colors.items():
        ax.scatter([], [], color=c, label=phase)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel(f"attainable TFLOP/s ({report.dtype})")
    ax.set_title(f"{report.model.name} on {p.name}: batch {report.batch}, seq {report.seq}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    out = Path(path)
    if out.parent and not out.parent.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out
