"""The planner: hardware and model catalogues, memory and time models, layout search (no torch)."""

from plait.plan.catalogue import GPU, GPUS, INTERCONNECTS, Link, get_gpu
from plait.plan.cluster import Cluster
from plait.plan.config import Layout, Training
from plait.plan.estimate import Estimate, estimate
from plait.plan.explain import explain
from plait.plan.inference import InferenceEstimate, InferenceResult, Workload, plan_inference
from plait.plan.memory import Memory
from plait.plan.model import PRESETS, Model
from plait.plan.search import SearchResult, search
from plait.plan.topo import Topology, parse_topo

__all__ = [
    "GPU", "GPUS", "INTERCONNECTS", "PRESETS", "Cluster", "Estimate", "InferenceEstimate",
    "InferenceResult", "Layout", "Link", "Memory", "Model", "SearchResult", "Topology", "Training",
    "Workload", "estimate", "explain", "get_gpu", "parse_topo", "plan_inference", "search",
]
