"""Repeat launches of a compiled Triton kernel without re-binding its arguments on every call.

``kernel[grid](*args, **kwargs)`` re-derives everything on each call: Triton binds the ~50
arguments of our attention kernels, specialises each (dtype, 16-byte alignment, ``== 1``,
multiple of 16), builds a cache key string, reads its knobs and only then launches: tens of
microseconds of host time, as long as a short kernel (figures: docs/perf-notes.md).

A :class:`LaunchCache` remembers per *launch key* (computed by the caller from what it already
knows: the validated problem, the tile config, dtypes, strides, pointer alignment) the compiled
kernel and its full argument list, with the per-call values (tensors, TMA descriptors, a few ints)
left as *slots*. A repeated call fills the slots and launches through ``CompiledKernel[grid]``, the
launcher Triton gives a precompiled kernel (it takes the current device and stream, so CUDA-graph
capture and ``torch.cuda.stream`` contexts work, and it honours Triton's launch hooks).

Contract for callers: ``key`` must determine every argument that is not a slot, the launch
options (``num_warps``, ``num_stages``) and the specialisation Triton derives from the slots: the
dtype and 16-byte alignment of each tensor (:func:`aligned`), and for each int slot whether it is
1, a multiple of 16 and which integer width it needs (:func:`int_spec`). Every tensor and tensor
descriptor argument must be a slot (checked when a plan is made). The first call of a key, and
every call under the Triton interpreter (which has no compiled kernel), goes through
``kernel[grid]`` unchanged.

A caller that launches the same thing many times with only some tensors changing (a decode plan
replayed layer after layer, step after step) can go one step further: ``launch(..., bind=positions)``
also returns a :class:`BoundLaunch`, the launch with every argument bound except those positions,
which :meth:`BoundLaunch.relaunch` fills and launches without building a key at all. The caller
then owns the key contract: it may relaunch only with values that specialise as the bound ones did.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from torch import Tensor

__all__ = [
    "KERNEL_OPTIONS",
    "BoundLaunch",
    "LaunchCache",
    "Memo",
    "aligned",
    "int_spec",
    "int_specs",
    "kernel_launches",
]

#: Compile options every flashpage kernel launch passes (``kernel[grid](..., **KERNEL_OPTIONS)``;
#: :class:`LaunchCache` adds them itself). ``enable_fp_fusion``: the kernels were tuned, and their
#: errors measured, with fused multiply-adds (the softmax's ``s * scale - m`` is one FFMA); triton
#: 3.9 warns at every compile that leaves it unset and says 3.10 will turn fusion off by default, so
#: it is pinned rather than left to the installed triton. Same code as the default of triton 3.6-3.9.
KERNEL_OPTIONS: Mapping[str, Any] = MappingProxyType({"enable_fp_fusion": True})

_I32_MIN, _I32_MAX = -(2**31), 2**31
_I64_MAX = 2**63


def int_spec(x: int) -> int:
    """Triton's specialisation class of an int argument: 1 (a constant), multiple of 16, and its
    width (i32 / i64 / u64), packed into one small int for launch keys."""
    if x == 1:
        return 1
    width = 0 if _I32_MIN <= x < _I32_MAX else (4 if x < _I64_MAX else 8)
    return width | (2 if x % 16 == 0 else 0)


def int_specs(values: Sequence[int]) -> tuple[int, ...]:
    """:func:`int_spec` of each of ``values`` (for a launch key)."""
    return tuple(map(int_spec, values))


def aligned(*tensors: Any) -> int:
    """Bit ``i`` set when ``tensors[i]``'s data pointer is 16-byte aligned (Triton specialises on it);
    a tensor descriptor counts by its base tensor."""
    bits = 0
    for i, t in enumerate(tensors):
        # Not isinstance(t, Tensor): Tensor's metaclass makes that check cost ~0.3 us per argument.
        try:
            ptr = t.data_ptr()
        except AttributeError:
            ptr = t.base.data_ptr()
        if not ptr & 15:
            bits |= 1 << i
    return bits


def _is_arg_object(x: Any) -> bool:
    """Tensors and tensor descriptors: per-call objects that must never be baked into a plan."""
    return isinstance(x, Tensor) or (hasattr(x, "base") and hasattr(x, "block_shape"))


class Memo:
    """A bounded memo of a pure host-side computation: ``get(key, compute)`` returns ``compute()``
    evaluated once per ``key`` (cleared when ``max_items`` keys are held, so a workload with many
    keys pays the computation again instead of growing without bound)."""

    def __init__(self, max_items: int = 512) -> None:
        self.max_items = max_items
        self._items: dict[Hashable, Any] = {}

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        self._items.clear()

    def get(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        try:
            return self._items[key]
        except KeyError:
            value = compute()  # may raise: nothing is stored then
            if len(self._items) >= self.max_items:
                self._items.clear()
            self._items[key] = value
            return value


class BoundLaunch:
    """One kernel launch with its grid and every argument bound except the ``positions`` given to
    :meth:`LaunchCache.launch` (emptied, so the launch keeps no per-call tensor alive).

    :meth:`relaunch` fills those positions and launches: on a GPU through the compiled kernel's
    launcher (``CompiledKernel[grid]``: current device and stream, launch hooks), under the Triton
    interpreter through ``kernel[grid]`` with the bound compile options, so the same code runs
    (and is tested) on both.
    """

    __slots__ = ("_args", "_positions", "_run")

    def __init__(self, run: Callable[..., Any], args: list[Any], positions: tuple[int, ...]) -> None:
        self._run = run
        self._positions = positions
        self._args = list(args)
        for i in positions:
            self._args[i] = None

    def relaunch(self, values: Sequence[Any]) -> None:
        """Launch again with ``values[i]`` as argument ``positions[i]``; the caller guarantees each
        specialises as the bound call's did (dtype, 16-byte alignment, int class)."""
        args = self._args.copy()
        for i, x in zip(self._positions, values, strict=True):
            args[i] = x
        self._run(*args)


@dataclass
class _Plan:
    kernel: Any  # triton.compiler.CompiledKernel
    template: list[Any]  # every kernel parameter in signature order; slots hold None
    slots: tuple[int, ...]


class LaunchCache:
    """Per-kernel memo of compiled launches (see the module doc for the key contract).

    Like Triton's own per-kernel compile cache it lives as long as the kernel; ``max_plans`` bounds
    it (the memo is cleared when full: a workload with many shapes pays the normal launch again).
    """

    def __init__(self, fn: Any, max_plans: int = 512) -> None:
        self.fn = fn
        self.max_plans = max_plans
        self._plans: dict[Hashable, _Plan] = {}
        self._memo = Memo(max_plans)
        params = list(inspect.signature(fn.fn).parameters.values()) if hasattr(fn, "fn") else []
        self._param_names = [p.name for p in params]
        self._defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        self._plans.clear()
        self._memo.clear()

    def remembered(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        """``compute()``, evaluated once per ``key`` (a per-launch-key decision such as a grid size
        taken from the compiled kernel: a dict lookup on later calls)."""
        return self._memo.get(key, compute)

    def launch(
        self,
        key: Hashable,
        grid: tuple[int, ...],
        slots: tuple[int, ...],
        values: Sequence[Any],
        build: Callable[[], tuple[list[Any], dict[str, Any]]],
        bind: tuple[int, ...] | None = None,
    ) -> BoundLaunch | None:
        """Launch the kernel on ``grid``.

        Args:
            key: the launch key (module doc); ``None`` disables the memo for this call (a caller
                that keeps the returned :class:`BoundLaunch` itself).
            slots: positions in ``build()``'s positional arguments of the per-call values.
            values: those values, in ``slots`` order (``values[i]`` is argument ``slots[i]``).
            build: returns ``(args, kwargs)`` exactly as for ``kernel[grid](*args, **kwargs)``;
                called only when the key has no plan yet.
            bind: positions (among ``slots``) a :class:`BoundLaunch` of this launch should leave
                open; ``None``: return nothing.
        Returns:
            The :class:`BoundLaunch` when ``bind`` is given, else ``None``.
        """
        plan = self._plans.get(key) if key is not None else None
        if plan is not None:
            run, args = self._replay(plan, grid, values)
            run(*args)
            return BoundLaunch(run, args, bind) if bind is not None else None
        args, kwargs = build()
        options = {**KERNEL_OPTIONS, **kwargs}
        kernel = self.fn[grid](*args, **options)
        if key is None and bind is None:
            return None
        plan = self._plan_of(kernel, args, kwargs, slots, values)
        if plan is not None and key is not None:
            self._store(key, plan)
        if bind is None:
            return None
        if plan is not None:
            return BoundLaunch(*self._replay(plan, grid, values), bind)
        return BoundLaunch(functools.partial(self.fn[grid], **options), args, bind)

    @staticmethod
    def _replay(
        plan: _Plan, grid: tuple[int, ...], values: Sequence[Any]
    ) -> tuple[Callable[..., Any], list[Any]]:
        """The compiled kernel's launcher for ``grid`` and its full argument list for ``values``."""
        args = plan.template.copy()
        for i, x in zip(plan.slots, values, strict=True):
            args[i] = x
        # CompiledKernel[grid] indexes grid[0..2] (JITFunction.run pads the grid itself).
        return plan.kernel[grid if len(grid) == 3 else (*grid, 1, 1)[:3]], args

    def compiled(
        self,
        key: Hashable,
        slots: tuple[int, ...],
        values: Sequence[Any],
        build: Callable[[], tuple[list[Any], dict[str, Any]]],
    ) -> Any:
        """The compiled kernel of ``key`` (compiled now, without a launch, if it has no plan yet;
        ``build`` as for :meth:`launch`), e.g. to size a grid by its occupancy; ``None`` where
        nothing is compiled (the Triton interpreter)."""
        plan = self._plans.get(key)
        if plan is not None:
            return plan.kernel
        warmup = getattr(self.fn, "warmup", None)
        if warmup is None:
            return None
        args, kwargs = build()
        kernel = warmup(*args, grid=(1,), **{**KERNEL_OPTIONS, **kwargs})
        self._remember(key, kernel, args, kwargs, slots, values)
        return kernel if hasattr(kernel, "packed_metadata") else None

    def _remember(
        self,
        key: Hashable,
        kernel: Any,
        args: list[Any],
        kwargs: dict[str, Any],
        slots: tuple[int, ...],
        values: Sequence[Any],
    ) -> None:
        plan = self._plan_of(kernel, args, kwargs, slots, values)
        if plan is not None:
            self._store(key, plan)

    def _store(self, key: Hashable, plan: _Plan) -> None:
        if len(self._plans) >= self.max_plans:
            self._plans.clear()
        self._plans[key] = plan

    def _plan_of(
        self,
        kernel: Any,
        args: list[Any],
        kwargs: dict[str, Any],
        slots: tuple[int, ...],
        values: Sequence[Any],
    ) -> _Plan | None:
        """The replayable launch of a compiled ``kernel`` (``None`` under the interpreter, or when a
        parameter has neither an argument nor a default)."""
        template = self._template(args, kwargs, slots, values)
        if kernel is not None and hasattr(kernel, "packed_metadata") and template is not None:
            return _Plan(kernel, template, slots)
        return None

    def _template(
        self, args: list[Any], kwargs: dict[str, Any], slots: tuple[int, ...], values: Sequence[Any]
    ) -> list[Any] | None:
        """The full parameter list with the slots emptied, or None when the call cannot be replayed
        (a parameter missing from ``args``/``kwargs`` without a default)."""
        for i, x in zip(slots, values, strict=True):
            if args[i] is not x:
                raise AssertionError(f"slot {i}: the value passed is not the launch's argument {i}")
        slot_set = set(slots)
        for i, x in enumerate(args):
            if i not in slot_set and _is_arg_object(x):
                raise AssertionError(f"argument {i} is a tensor but not a slot: a plan would keep it")
        tail = []
        for name in self._param_names[len(args) :]:
            if name in kwargs:
                tail.append(kwargs[name])
            elif name in self._defaults:
                tail.append(self._defaults[name])
            else:
                return None
        template = list(args) + tail
        for i in slots:
            template[i] = None
        return template


def kernel_launches(kernel: Any) -> LaunchCache:
    """The :class:`LaunchCache` of ``kernel``: kept on the kernel object itself, as Triton keeps its
    compile cache there, and made on first use. Each kernel has one, shared by every call site."""
    cache = getattr(kernel, "_flashpage_launches", None)
    if cache is None:
        cache = LaunchCache(kernel)
        kernel._flashpage_launches = cache
    return cache
