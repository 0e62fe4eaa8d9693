"""Argument handling shared by the flash-attn compatible entry points.

flash-attn raises ``RuntimeError`` for a bad argument and its callers catch that; flashpage's checks
raise ``ValueError``/``TypeError``. :class:`FlashAttnError` is both a ``RuntimeError`` and a
``ValueError`` (and :class:`FlashAttnTypeError` also a ``TypeError``), so code written for either
library catches it; its message starts with the flash-attn argument it is about (``"block_table:
..."``). :func:`flash_attn_errors` converts the errors of one public function.
"""

from __future__ import annotations

import functools
import inspect
import numbers
import re
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch
from torch import Tensor

__all__ = ["FlashAttnError", "FlashAttnTypeError", "flash_attn_errors", "window_pair"]

P = ParamSpec("P")
R = TypeVar("R")


class FlashAttnError(RuntimeError, ValueError):
    """A bad argument to a flash-attn compatible function (a ``RuntimeError``, as flash-attn raises,
    and a ``ValueError``); the message starts with the argument's flash-attn name."""


class FlashAttnTypeError(FlashAttnError, TypeError):
    """A :class:`FlashAttnError` about an argument's type or dtype (also a ``TypeError``)."""


def _named(message: str, params: tuple[str, ...]) -> str:
    """``message`` led by the first of ``params`` it mentions and a colon: ``"x must be ..."``
    becomes ``"x: x must be ..."`` (unchanged when it names none or already starts so)."""
    found = [(m.start(), p) for p in params if (m := re.search(rf"(?<![\w.]){re.escape(p)}(?!\w)", message))]
    if not found:
        return message
    name = min(found)[1]
    return message if message.startswith(name + ":") else f"{name}: {message}"


def flash_attn_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorate a public entry point: the ``ValueError``/``TypeError`` it raises become
    :class:`FlashAttnError`/:class:`FlashAttnTypeError` naming the argument (the original is the
    ``__cause__``). Costs one ``try`` per call."""
    params = tuple(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except FlashAttnError:
            raise
        except TypeError as e:
            raise FlashAttnTypeError(_named(str(e), params)) from e
        except ValueError as e:
            raise FlashAttnError(_named(str(e), params)) from e

    return wrapper


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_int_scalar_tensor(x: Any) -> bool:
    return (
        isinstance(x, Tensor) and x.numel() == 1 and not x.dtype.is_floating_point and x.dtype != torch.bool
    )


def window_pair(window_size: Any) -> tuple[int, int]:
    """``window_size`` as a ``(left, right)`` pair of Python ints: flash-attn takes any length-2
    sequence of ints, a 2-element integer tensor included (its tests pass one; reading it is a host
    sync on a GPU tensor).

    Raises:
        FlashAttnError: not two integers.
    """
    if type(window_size) is tuple and len(window_size) == 2 and all(type(w) is int for w in window_size):
        return window_size  # the common call: nothing to convert
    if isinstance(window_size, Tensor):
        if window_size.numel() != 2 or window_size.dtype.is_floating_point or window_size.dtype == torch.bool:
            raise FlashAttnError(
                f"window_size: a tensor must hold 2 integers, got {window_size.dtype} "
                f"{tuple(window_size.shape)}"
            )
        left, right = window_size.reshape(2).tolist()
        return int(left), int(right)
    try:
        pair = tuple(window_size)
    except TypeError:
        pair = ()
    if len(pair) != 2 or not all(_is_int(w) or _is_int_scalar_tensor(w) for w in pair):
        raise FlashAttnError(f"window_size: must be a pair of ints (-1 = unbounded), got {window_size!r}")
    return int(pair[0]), int(pair[1])
