"""Tensor and sequence parallelism: conjugate collectives, parallel layers, vocabulary-parallel loss."""

from plait.tensor_parallel.comms import (
    copy_to_tp,
    gather_last,
    gather_seq,
    reduce_from_tp,
    reduce_scatter_seq,
    scatter_last,
    scatter_seq,
)
from plait.tensor_parallel.heads import ReplicatedHeadsLinear
from plait.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPShardedModule,
    VocabParallelEmbedding,
    is_tp_partial,
    mark_tp_partial,
    sync_tp_partial_grads,
)
from plait.tensor_parallel.loss import vocab_parallel_cross_entropy

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ReplicatedHeadsLinear",
    "TPShardedModule", "vocab_parallel_cross_entropy", "copy_to_tp", "reduce_from_tp", "gather_last",
    "scatter_last", "gather_seq", "reduce_scatter_seq", "scatter_seq", "mark_tp_partial", "is_tp_partial",
    "sync_tp_partial_grads",
]
