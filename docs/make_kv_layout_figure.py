"""Draw docs/kv-layout.png: the paged KV layout and the measured KV waste of the block manager.

Run from anywhere: ``.venv/bin/python docs/make_kv_layout_figure.py [--out PATH]``. The waste panel
reruns the workload of ``tests/kv/test_waste.py`` (200 requests, prompts 64-1024, outputs 32-512,
block size 16) and prints the figures quoted in docs/kv-layout.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Rectangle

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # for tests.kv.test_waste (the workload the test asserts on)
sys.path.insert(0, str(REPO / "src"))

from tests.kv.test_waste import run_workload  # noqa: E402

from flashpage.kv import BlockManager  # noqa: E402

BS = 4  # block size drawn (the real minimum is 8; 4 keeps the picture readable)


def _draw_layout(ax: plt.Axes) -> None:
    """Two sequences sharing a 2-block prefix, their block tables and the physical pool."""
    bm = BlockManager(num_blocks=10, block_size=8)  # real manager decides the ids drawn
    a = [*range(16), 100, 101, 102]
    bm.allocate(0, a)
    bm.commit(0, a)
    b = [*range(16), *range(200, 210)]
    bm.allocate(1, b)
    tables = {0: (bm.block_table(0), len(a)), 1: (bm.block_table(1), len(b))}
    colors = {0: "#4c72b0", 1: "#dd8452"}
    shared = "#55a868"
    ax.set_xlim(-0.5, 10.7)
    ax.set_ylim(-3.4, 4.6)
    ax.axis("off")
    ax.set_title("Paged KV layout: block tables -> physical blocks", fontsize=10)
    # Physical pool: one row of num_blocks blocks, each block_size slots (drawn as 4 cells).
    y_pool = -2.2
    ax.text(-0.4, y_pool + 1.05, "k_cache[layer]  (num_blocks, block_size, nheads_k, head_dim)", fontsize=7.5)
    fill: dict[int, tuple[int, str]] = {}
    for sid, (table, n) in tables.items():
        for j, blk in enumerate(table):
            used = min(8, n - 8 * j)
            col = shared if bm.ref_count(blk) > 1 else colors[sid]
            fill[blk] = (max(used, fill.get(blk, (0, ""))[0]), col)
    for blk in range(bm.num_blocks):
        x = blk * 1.05
        used, col = fill.get(blk, (0, "white"))
        for c in range(BS):
            on = c < -(-used * BS // 8)
            ax.add_patch(
                Rectangle(
                    (x + c * 0.25, y_pool),
                    0.25,
                    0.8,
                    facecolor=col if on else "white",
                    edgecolor="black",
                    lw=0.6,
                )
            )
        ax.text(x + 0.5, y_pool - 0.3, f"{blk}", ha="center", fontsize=7)
        if bm.ref_count(blk) > 1:
            ax.text(
                x + 0.5, y_pool - 0.65, f"ref={bm.ref_count(blk)}", ha="center", fontsize=6.5, color=shared
            )
    ax.text(
        -0.4,
        y_pool - 1.1,
        "block id   (a cell = 2 token slots here; slot = id*block_size + offset)",
        fontsize=7,
    )
    # Block tables.
    for sid, (table, n) in tables.items():
        y = 3.2 - sid * 1.6
        ax.text(-0.4, y + 0.95, f"seq {sid}: {n} tokens, block_table[{sid}] = {table}", fontsize=7.5)
        for j, blk in enumerate(table):
            x = 1.2 + j * 0.9
            col = shared if bm.ref_count(blk) > 1 else colors[sid]
            ax.add_patch(Rectangle((x, y), 0.8, 0.7, facecolor=col, edgecolor="black", lw=0.6, alpha=0.85))
            ax.text(x + 0.4, y + 0.35, str(blk), ha="center", va="center", fontsize=8, color="white")
            ax.add_patch(
                FancyArrowPatch(
                    (x + 0.4, y),
                    (blk * 1.05 + 0.5, y_pool + 0.8),
                    arrowstyle="->",
                    mutation_scale=7,
                    lw=0.6,
                    color=col,
                    alpha=0.7,
                )
            )
    ax.text(
        6.2,
        2.6,
        "green: prefix-cache hit,\nshared (refcount 2)\nblank cells: waste\n(< 1 block per sequence)",
        fontsize=7,
    )


def _draw_waste(ax: plt.Axes) -> dict[str, float]:
    res = run_workload(num_requests=200, num_blocks=2048, block_size=16, seed=0)
    steps = range(len(res.running))
    n = len(res.contiguous_waste)
    ax.plot(steps, [100 * w for w in res.waste], label=f"paged, block 16 (peak {100 * res.peak_waste:.1f}%)")
    ax.plot(range(n), [100 * w for w in res.reserve_waste], label="contiguous, reserve prompt+max_tokens")
    ax.plot(range(n), [100 * w for w in res.contiguous_waste], label="contiguous, reserve max_model_len")
    ax.axhline(4, color="gray", ls="--", lw=0.8)
    ax.text(len(res.waste) * 0.02, 5, "4% (vLLM)", fontsize=7, color="gray")
    ax.set_xlabel("decode step")
    ax.set_ylabel("KV slots allocated but empty (%)")
    ax.set_ylim(0, 100)
    ax.set_title("KV waste, 200 requests (prompt 64-1024, output 32-512)", fontsize=10)
    ax.legend(fontsize=7, loc="upper right")
    return {
        "peak_paged_waste": res.peak_waste,
        "mean_paged_waste": res.mean_waste,
        "mean_reserve_waste": statistics.mean(res.reserve_waste),
        "mean_contiguous_waste": statistics.mean(res.contiguous_waste),
        "preemptions": float(res.preemptions),
        "prefix_hit_rate": res.hit_rate,
        "steps": float(res.steps),
        "tokens_generated": float(res.tokens_generated),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "kv-layout.png")
    args = p.parse_args()
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw={"width_ratios": [1.25, 1]})
    _draw_layout(ax0)
    stats = _draw_waste(ax1)
    fig.tight_layout()
    fig.savefig(args.out, dpi=130)
    for k, v in stats.items():
        print(f"{k}: {v:.4f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
