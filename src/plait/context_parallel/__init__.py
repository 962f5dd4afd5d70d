"""Context parallelism: every sequence split over the CP group, attention across it (layout, comms, attention)."""

from plait.context_parallel.attention import apply_context_parallel, check_context_parallel
from plait.context_parallel.layout import (
    attention_pairs,
    gather_sequence,
    local_positions,
    shard_sequence,
)

__all__ = ["apply_context_parallel", "check_context_parallel", "attention_pairs", "gather_sequence",
           "local_positions", "shard_sequence"]
