"""``flashpage bench all [--quick] [--out DIR]``: probe this machine, then run every benchmark it supports.

1. ``probe`` measures the machine's ceilings (matmul FLOP/s per dtype, copy bandwidth) and writes
   ``<out>/probe-<gpu>.json``; every benchmark gets it as ``--profile``, so every bound and
   ``frac_of_roofline`` of the run is of the GPU it ran on (the datasheet is kept beside it in each
   result's ``env``).
2. Each benchmark of :data:`REGISTRY` runs in this process, in order, under a progress bar:
   attention (fwd/bwd), decode (and chunked prefill), offline throughput, and serve once its module
   exists. Each writes ``<out>/<bench>-<gpu>.json``; its baselines (SDPA backends, FlexAttention,
   ``transformers`` generate; flash-attn, FlashInfer, vLLM when importable) run in the same process,
   and one that is missing or fails is a row with ``status`` and ``reason``.
3. A benchmark whose module or extra is missing is skipped and said so; one that raises becomes a
   ``failed`` flashpage row in its result file, and the run goes on.
4. The headline rows' median ``frac_of_roofline`` per kernel goes into the profile's ``efficiency``
   (``flashpage roofline --hardware <out>/probe-<gpu>.json`` plans with it).

A benchmark plugs in with a :class:`BenchEntry`: its module's ``main(argv) -> int`` accepts
``--out DIR``, ``--quick`` and, unless ``takes_profile`` is False, ``--profile FILE`` (plus the
entry's extra arguments) and writes its result files into ``DIR``. Without CUDA only the entries with ``cpu_args`` run (CPU modes), the
others are skipped. ``--quick`` fits in about 5 minutes on one H100/H200.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flashpage.bench.common import failure_reason, gpu_slug, results_dir, status_row

__all__ = ["REGISTRY", "BenchEntry", "BenchOutcome", "main", "run_all", "write_probe"]


@dataclass(frozen=True)
class BenchEntry:
    """One benchmark of ``bench all``.

    Attributes:
        name: the ``flashpage bench <name>`` name.
        module: the module whose ``main(argv)`` runs it.
        results: the ``<bench>`` names of the files it writes (a failure is recorded in the first).
        requires: modules that must be importable (an extra), else the entry is skipped.
        gpu_args / quick_args: arguments on a GPU, added with ``--quick``.
        cpu_args: arguments without CUDA; None: the entry needs a GPU.
        takes_profile: its ``main`` accepts ``--profile FILE`` (the run's probe).
    """

    name: str
    module: str
    results: tuple[str, ...]
    requires: tuple[str, ...] = ()
    gpu_args: tuple[str, ...] = ()
    quick_args: tuple[str, ...] = ("--quick",)
    cpu_args: tuple[str, ...] | None = None
    takes_profile: bool = True


#: Every benchmark ``bench all`` knows, in run order. ``serve`` is skipped when the server extra
#: (fastapi, uvicorn, aiohttp) is missing; its rows are throughput, not fractions of a roofline.
REGISTRY: tuple[BenchEntry, ...] = (
    BenchEntry("attention", "flashpage.bench.attention", ("attention",)),
    BenchEntry("decode", "flashpage.bench.decode", ("decode", "prefill")),
    BenchEntry("throughput", "flashpage.bench.throughput", ("throughput",), cpu_args=("--cpu-hf",)),
    BenchEntry(
        "serve",
        "flashpage.bench.serve",
        ("serve",),
        requires=("fastapi", "uvicorn", "aiohttp"),
        cpu_args=(),
        takes_profile=False,
    ),
)


@dataclass
class BenchOutcome:
    """What happened to one entry: ``ran`` (with its exit status), ``skipped`` or ``failed``."""

    name: str
    state: str
    rc: int = 0
    reason: str = ""
    seconds: float = 0.0
    files: list[str] = field(default_factory=list)


def _importable(name: str) -> bool:
    """``name`` can be imported (already imported, or found on the path), without importing it."""
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package is missing, or a module without a spec
        return False


def _missing(entry: BenchEntry, cuda: bool) -> str | None:
    """Why ``entry`` cannot run here (None when it can)."""
    if not _importable(entry.module):
        return f"{entry.module} does not exist (yet)"
    for req in entry.requires:
        if not _importable(req):
            return f"needs {req} (an optional extra), which is not installed"
    if not cuda and entry.cpu_args is None:
        return "needs a CUDA GPU"
    return None


def write_probe(out: Path, quick: bool) -> Path:
    """Measure this device with ``probe`` and write ``<out>/probe-<gpu>.json``; returns the path.
    On a GPU the full probe (matmul up to 16384, a 2 GiB copy: the peaks the rows are fractions of)
    even with ``quick``; on CPU the quick one."""
    from flashpage.roofline.hardware import save_profile
    from flashpage.roofline.probe import probe

    prof = probe(quick=quick and not torch.cuda.is_available())
    return save_profile(prof, out / f"probe-{gpu_slug()}.json")


def record_efficiency(probe_path: Path, out: Path) -> dict[str, float]:
    """Put the per-kernel median ``frac_of_roofline`` of this GPU's result files in ``out`` into the
    profile at ``probe_path`` (its ``efficiency``); returns it."""
    from flashpage.bench.report import kernel_efficiency, load_results

    rs = load_results(out).get(gpu_slug())
    eff = kernel_efficiency(rs.rows) if rs else {}
    data = json.loads(probe_path.read_text())
    if eff:
        data["efficiency"] = eff
        probe_path.write_text(json.dumps(data, indent=1) + "\n")
    return eff


def _record_failure(entry: BenchEntry, out: Path, reason: str) -> Path:
    """A result file for a benchmark that raised: one ``failed`` flashpage row, so the table says so."""
    from flashpage.bench.common import env_info, write_results

    bench = entry.results[0]
    return write_results(
        bench, [status_row(bench, "flashpage", "failed", reason)], env_info(None, None), out_dir=out
    )


@contextlib.contextmanager
def _progress(total: int, enabled: bool) -> Iterator[Any]:
    """A tqdm bar on stderr (a no-op object when disabled or tqdm is missing)."""

    class _Null:
        def update(self, n: int = 1) -> None: ...
        def set_postfix_str(self, s: str) -> None: ...
        def write(self, s: str) -> None:
            print(s, file=sys.stderr, flush=True)

    if not enabled:
        yield _Null()
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield _Null()
        return
    bar = tqdm(total=total, desc="bench all", unit="step", file=sys.stderr, dynamic_ncols=True)
    try:
        yield bar
    finally:
        bar.close()


def run_all(
    out: Path,
    quick: bool = False,
    only: Iterable[str] | None = None,
    registry: Sequence[BenchEntry] = REGISTRY,
    probe: Callable[[Path, bool], Path] = write_probe,
    progress: bool = True,
    profile: Path | None = None,
) -> list[BenchOutcome]:
    """Probe, then run every entry of ``registry`` (``only``: just those names) that can run here;
    returns one outcome per entry (skipped ones included). Never raises for a benchmark's failure.
    ``profile``: a probe profile of this GPU measured earlier (a run split over several commands
    shares one), copied to ``<out>/probe-<gpu>.json`` instead of probing again."""
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    wanted = set(only) if only else None
    entries = [e for e in registry if wanted is None or e.name in wanted]
    outcomes: list[BenchOutcome] = []
    with _progress(len(entries) + 1, progress) as bar:
        bar.set_postfix_str("probe")
        t0 = time.perf_counter()
        if profile is not None:
            probe_path = out / f"probe-{gpu_slug()}.json"
            if Path(profile).resolve() != probe_path.resolve():
                probe_path.write_text(Path(profile).read_text())
        else:
            probe_path = probe(out, quick)
        bar.write(f"probe: {probe_path} ({time.perf_counter() - t0:.0f} s)")
        bar.update(1)
        for entry in entries:
            bar.set_postfix_str(entry.name)
            why = _missing(entry, cuda)
            if why is not None:
                outcomes.append(BenchOutcome(entry.name, "skipped", reason=why))
                bar.write(f"{entry.name}: skipped ({why})")
                bar.update(1)
                continue
            args = ["--out", str(out), *(["--profile", str(probe_path)] if entry.takes_profile else [])]
            args += list(entry.gpu_args if cuda else entry.cpu_args or ())
            args += list(entry.quick_args) if quick else []
            t0 = time.perf_counter()
            try:
                rc = int(importlib.import_module(entry.module).main(args) or 0)
                outcome = BenchOutcome(entry.name, "ran", rc=rc)
            except (Exception, SystemExit) as e:  # one benchmark's crash must not end the run
                reason = failure_reason(e)
                outcome = BenchOutcome(entry.name, "failed", rc=1, reason=reason)
                _record_failure(entry, out, reason)
            finally:
                if cuda:
                    torch.cuda.empty_cache()
            outcome.seconds = time.perf_counter() - t0
            outcome.files = [str(p) for b in entry.results if (p := out / f"{b}-{gpu_slug()}.json").exists()]
            outcomes.append(outcome)
            bar.write(
                f"{entry.name}: {outcome.state} rc={outcome.rc} in {outcome.seconds:.0f} s {outcome.reason}"
            )
            bar.update(1)
    eff = record_efficiency(probe_path, out)
    if eff:
        print("measured kernel efficiency: " + ", ".join(f"{k} {v:.2f}" for k, v in eff.items()))
    return outcomes


def main(argv: list[str] | None = None) -> int:
    """Run ``bench all``; exit status: the worst of the benchmarks' (1 when one failed), 0 when all
    that could run succeeded (skipped ones do not count)."""
    p = argparse.ArgumentParser(prog="flashpage bench all", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small shape lists (about 5 minutes on an H100/H200)")
    p.add_argument("--out", type=Path, default=None, help="results directory (default benchmarks/results)")
    p.add_argument("--only", default=None, help="comma list of benchmarks to run (default: all)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="use this probe profile of this GPU (from an earlier bench all / probe) instead of probing",
    )
    args = p.parse_args(argv)
    names = [e.name for e in REGISTRY]
    only = [x for x in args.only.split(",") if x] if args.only else None
    bad = [x for x in only or [] if x not in names]
    if bad:
        print(
            f"flashpage bench all: --only: unknown {', '.join(bad)}; known: {', '.join(names)}",
            file=sys.stderr,
        )
        return 2
    t0 = time.perf_counter()
    if args.profile is not None and not args.profile.is_file():
        print(f"flashpage bench all: --profile {args.profile} does not exist", file=sys.stderr)
        return 2
    outcomes = run_all(
        results_dir(args.out), args.quick, only, progress=not args.no_progress, profile=args.profile
    )
    print(f"\nbench all in {time.perf_counter() - t0:.0f} s:")
    for o in outcomes:
        print(f"  {o.name:12s} {o.state:8s} rc={o.rc} {o.seconds:6.0f} s  {o.reason or ', '.join(o.files)}")
    print("render the tables: flashpage bench report" + (f" --results {args.out}" if args.out else ""))
    return max([o.rc for o in outcomes], default=0)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
