"""Draw docs/architecture.png: flashpage's packages and which imports which, read from the source.

Run from anywhere: ``.venv/bin/python docs/make_architecture_figure.py [--src DIR] [--out PATH]``.
The arrows are not drawn by hand: every ``import flashpage.X`` / ``from flashpage.X import`` (at
module level or inside a function) of ``src/flashpage`` is parsed with ``ast``, and one arrow is
drawn per (importing package, imported package) pair (the importing files are printed).
``LAYERS`` is the intended order, top to bottom; an import that points up that order is drawn in
red and printed, and the script exits 1, so the picture cannot hide a wrong-way import.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

REPO = Path(__file__).resolve().parent.parent

# The intended layers, top (imports the most) to bottom (imports nothing of flashpage): name, what
# the package is for (drawn in its box), and x position (chosen so that long arrows pass between boxes).
LAYERS: list[list[tuple[str, str, float]]] = [
    [("cli", "the `flashpage` command", 0.0)],
    [
        ("serve", "OpenAI HTTP server,\nmetrics, live page", -4.4),
        ("bench", "`flashpage bench`,\nbaselines, report", 4.4),
    ],
    [
        ("engine", "LLM, AsyncLLM, scheduler,\nsampler, model runner", -4.4),
        ("integrations", 'transformers\n"flashpage" attention', 4.4),
    ],
    [
        ("models", "Llama family,\nsafetensors / GGUF", -5.2),
        ("kv", "page layout,\nblock manager", -1.6),
        ("distributed", "ring / zigzag attention,\nnetprobe, tensor parallel", 2.2),
    ],
    [
        ("ops", "Triton kernels, flash-attn API,\nplan / run, dispatch", -3.4),
        ("bert_padding", "unpad_input /\npad_input", 4.4),
    ],
    [("roofline", "hardware profiles, FLOP/byte\nmodel, planner, probe", 0.0)],
]
COLORS = ["#8172b3", "#4c72b0", "#55a868", "#dd8452", "#c44e52", "#937860"]


def _package(path: Path, root: Path) -> str:
    parts = path.relative_to(root).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def import_edges(src: Path) -> dict[tuple[str, str], set[str]]:
    """(importer package, imported package) -> the importing files, from every .py under src/flashpage."""
    root = src / "flashpage"
    edges: dict[tuple[str, str], set[str]] = defaultdict(set)
    for f in sorted(root.rglob("*.py")):
        me = _package(f, root)
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.append(node.module)
                if node.module == "flashpage":  # from flashpage import ops
                    names += [f"flashpage.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level > 0:
                here = f.relative_to(root).parent.parts
                base = here[: len(here) - (node.level - 1)]
                names.append(".".join(["flashpage", *base, *([node.module] if node.module else [])]))
            elif isinstance(node, ast.Import):
                names += [a.name for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] == "flashpage" and len(parts) > 1 and parts[1] != me:
                    edges[(me, parts[1])].add(str(f.relative_to(root)))
    return edges


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "--src", type=Path, default=REPO / "src", help="the src/ directory to read (default: this tree)"
    )
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "architecture.png")
    args = p.parse_args()

    rank = {name: i for i, layer in enumerate(LAYERS) for name, _, _ in layer}
    pos: dict[str, tuple[float, float]] = {}
    width, height, row_gap = 2.9, 0.95, 1.75
    for i, layer in enumerate(LAYERS):
        for name, _, x in layer:
            pos[name] = (x, -i * row_gap)

    edges = import_edges(args.src)
    unknown = sorted({pkg for edge in edges for pkg in edge} - rank.keys())
    if unknown:
        print(f"packages not in LAYERS (add them): {unknown}")
        return 1
    wrong = sorted((a, b) for a, b in edges if rank[a] >= rank[b])

    fig, ax = plt.subplots(figsize=(11, 9.5))
    ax.set_xlim(-7.2, 6.4)
    ax.set_ylim(-(len(LAYERS) - 1) * row_gap - 1.0, 1.2)
    ax.axis("off")
    for i, layer in enumerate(LAYERS):
        for name, role, _ in layer:
            x, y = pos[name]
            ax.add_patch(
                FancyBboxPatch(
                    (x - width / 2, y - height / 2),
                    width,
                    height,
                    boxstyle="round,pad=0.02,rounding_size=0.12",
                    facecolor=COLORS[i],
                    edgecolor="black",
                    lw=0.8,
                    alpha=0.9,
                    zorder=3,
                )
            )
            label = f"{name}.py" if name in ("cli", "bert_padding") else f"{name}/"
            ax.text(
                x,
                y + 0.22,
                label,
                ha="center",
                va="center",
                fontsize=10,
                weight="bold",
                color="white",
                zorder=4,
            )
            ax.text(x, y - 0.17, role, ha="center", va="center", fontsize=7, color="white", zorder=4)
    for a, b in sorted(edges):
        (xa, ya), (xb, yb) = pos[a], pos[b]
        bad = (a, b) in wrong
        span = rank[b] - rank[a]
        bend = 0.0 if span == 1 else (0.2 if xb >= xa else -0.2)
        if span > 0:  # down: bottom edge -> top edge
            start, end = (xa, ya - height / 2), (xb, yb + height / 2)
        elif span < 0:  # up: top edge -> bottom edge
            start, end = (xa + 0.3, ya + height / 2), (xb + 0.3, yb - height / 2)
        else:  # same layer: side -> side, bowed below the row
            side = width / 2 if xb > xa else -width / 2
            start, end = (xa - side * 0.6, ya - height / 2), (xb + side * 0.6, yb - height / 2)
            bend = -0.3 if xb < xa else 0.3
        ax.add_patch(
            FancyArrowPatch(
                start,
                end,
                arrowstyle="-|>",
                mutation_scale=11,
                lw=2.0 if bad else (1.3 if span == 1 else 0.8),
                color="red" if bad else ("#333333" if span == 1 else "#777777"),
                alpha=0.9 if bad else (0.85 if span == 1 else 0.55),
                connectionstyle=f"arc3,rad={bend}",
                zorder=5 if bad else 2,
            )
        )
    verdict = (
        "red: imports against the layer order, " + ", ".join(f"{a} -> {b}" for a, b in wrong)
        if wrong
        else "imports only point down"
    )
    ax.set_title(
        "flashpage: packages and imports (arrow: importer -> imported)\n"
        f"read from src/flashpage by docs/make_architecture_figure.py; {verdict}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    for (a, b), files in sorted(edges.items()):
        print(f"{a:>12} -> {b:<12} {', '.join(sorted(files))}")
    print(f"wrote {args.out}")
    if wrong:
        print(f"imports against the layer order: {wrong}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
