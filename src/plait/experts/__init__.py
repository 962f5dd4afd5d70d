"""Expert parallelism: EP-sharded mixture-of-experts layers with all-to-all token dispatch."""

from plait.experts.comms import all_to_all, exchange_counts, gather_rows
from plait.experts.dispatch import dispatch_combine
from plait.experts.layer import ExpertParallelMoE, apply_expert_parallel, check_experts, check_model_experts

__all__ = ["ExpertParallelMoE", "all_to_all", "apply_expert_parallel", "check_experts", "check_model_experts",
           "dispatch_combine", "exchange_counts", "gather_rows"]
