"""Beyond one device over ``torch.distributed`` (NCCL on GPUs, gloo on CPU): tensor parallelism.

``LLM(..., tensor_parallel_size=N)`` uses :mod:`flashpage.distributed.tensor_parallel`.
"""

from flashpage.distributed.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    head_split,
    shard_model_,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "TensorParallel", "head_split", "shard_model_"]
