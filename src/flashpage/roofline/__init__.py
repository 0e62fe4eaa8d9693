"""The roofline model: hardware ceilings, per-op FLOP/byte counts, and the kernel planner.

- :mod:`~flashpage.roofline.hardware`: :class:`HardwareProfile`, :func:`load_profile`, :func:`detect_profile`.
- :mod:`~flashpage.roofline.probe`: :func:`probe` measures the current device (``flashpage probe``).
- :mod:`~flashpage.roofline.model_shapes`: :class:`ModelShape`, :func:`get_model_shape`.
- :mod:`~flashpage.roofline.intensity`: FLOP/byte formulas, ridge, bound, :func:`workload_bound`.
- :mod:`~flashpage.roofline.planner`: :func:`plan_attention`, :func:`choose_num_splits`, :func:`plan`.
- :mod:`~flashpage.roofline.report`: the ``flashpage roofline`` table, JSON and plot.

This package imports nothing from ``ops``, ``kv`` or ``engine``, and imports torch only inside the
functions that measure hardware, so the planner stays cheap to import and call.
"""

from __future__ import annotations

from flashpage.roofline.hardware import (
    HardwareProfile,
    Interconnect,
    detect_profile,
    dtype_bytes,
    known_profile_names,
    load_profile,
    normalize_dtype,
    save_profile,
)
from flashpage.roofline.intensity import (
    OpCost,
    WorkloadBound,
    attention_chunked_prefill_cost,
    attention_cost,
    attention_decode_cost,
    attention_prefill_cost,
    bound,
    linear_cost,
    model_op_costs,
    ridge,
    workload_bound,
)
from flashpage.roofline.model_shapes import ModelShape, get_model_shape, known_model_names
from flashpage.roofline.planner import (
    KernelChoice,
    PlannedOp,
    choose_num_splits,
    plan,
    plan_attention,
    plan_model,
)
from flashpage.roofline.probe import probe

__all__ = [
    "HardwareProfile",
    "Interconnect",
    "KernelChoice",
    "ModelShape",
    "OpCost",
    "PlannedOp",
    "WorkloadBound",
    "attention_chunked_prefill_cost",
    "attention_cost",
    "attention_decode_cost",
    "attention_prefill_cost",
    "bound",
    "choose_num_splits",
    "detect_profile",
    "dtype_bytes",
    "get_model_shape",
    "known_model_names",
    "known_profile_names",
    "linear_cost",
    "load_profile",
    "model_op_costs",
    "normalize_dtype",
    "plan",
    "plan_attention",
    "plan_model",
    "probe",
    "ridge",
    "save_profile",
    "workload_bound",
]
