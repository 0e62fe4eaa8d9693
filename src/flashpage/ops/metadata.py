"""Attention metadata for one engine step over a flattened token batch.

The engine packs the new tokens of ``B`` sequences into one batch of ``T`` tokens. Sequence ``b``
contributes ``q_len[b] = cu_seqlens_q[b+1] - cu_seqlens_q[b]`` new tokens whose K/V are written to
the paged cache at ``slot_mapping`` before attention; its queries then attend to the first
``seqlens_k[b]`` cached tokens (its prefix plus the new tokens), causally, bottom-right aligned.
Decode is the case ``q_len == 1`` for every sequence; a plain prefill is ``seqlens_k == q_len``.

Page layout (see ``flashpage.kv``): per layer ``k_cache, v_cache (num_blocks, block_size, nheads_k, d)``;
flat slot ``s`` is ``cache.view(-1, nheads_k, d)[s]``, i.e. block ``s // block_size``, offset
``s % block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:
    from flashpage.ops.paged_plan import DecodePlan


@dataclass(frozen=True)
class TorchStepIndices:
    """Index tensors of the PyTorch attention path that depend only on the step's metadata.

    Attributes:
        block_size, window_left: what they were built for (a layer with others rebuilds them).
        table: ``(B, nblk)`` int64 block ids.
        seq, row: ``(T,)`` padded (sequence, query row) of each packed query.
        mask: ``(B, max_q, max_k)`` bool: lengths, causal, left window.
    """

    block_size: int
    window_left: int
    table: Tensor
    seq: Tensor
    row: Tensor
    mask: Tensor


@dataclass
class AttentionMetadata:
    """Per-step inputs shared by every attention layer of the model.

    Attributes:
        slot_mapping: ``(T,)`` int64 flat cache slot of each new token; ``-1`` skips the write.
        block_table: ``(B, max_blocks_per_seq)`` int32 physical block ids per sequence.
        seqlens_k: ``(B,)`` int32 context length of each sequence after this step's tokens.
        cu_seqlens_q: ``(B + 1,)`` int32 prefix sums of the new-token counts.
        max_seqlen_q: largest ``q_len`` (host int, so launches need no device sync).
        max_seqlen_k: largest ``seqlens_k`` (host int).
        decode_only: every sequence has exactly one new token.
        prefix_free: no sequence has cached tokens before this step (``seqlens_k == q_len``), so
            attention can run on the new K/V directly (the flash varlen kernel).
        num_splits: split-KV count for decode when no ``decode_plan`` is given (0 = the planner's
            choice).
        decode_plan: the step's decode plan (split count, heads per program, workspace and bound
            launch), shared by every layer; the engine plans it once per decode step, the Triton
            path plans it on the first layer when absent. Valid across CUDA-graph replays.
        torch_indices: index tensors of the PyTorch path, built by its first layer; values of this
            forward's tensors, so :meth:`begin_forward` drops them.
    """

    slot_mapping: Tensor
    block_table: Tensor
    seqlens_k: Tensor
    cu_seqlens_q: Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    decode_only: bool = False
    prefix_free: bool = False
    num_splits: int = 0
    decode_plan: DecodePlan | None = field(default=None, repr=False, compare=False)
    torch_indices: TorchStepIndices | None = field(default=None, repr=False, compare=False)

    def begin_forward(self) -> None:
        """Drop what was derived from tensor values (a replayed step reuses this object with new
        buffer contents); the decode plan depends on shapes only and stays."""
        self.torch_indices = None

    @property
    def num_seqs(self) -> int:
        """Number of sequences ``B`` in the step."""
        return int(self.seqlens_k.shape[0])

    @property
    def num_tokens(self) -> int:
        """Number of new tokens ``T`` in the step."""
        return int(self.slot_mapping.shape[0])
