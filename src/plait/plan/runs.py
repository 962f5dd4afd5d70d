"""The planner's prediction of a ``plait train`` run: its layout and batch as a planner Layout, on a calibrated host."""

from __future__ import annotations

from plait.plan.config import Cluster, Layout, Training
from plait.plan.estimate import Estimate, estimate
from plait.plan.model import Model
from plait.plan.profile import HostProfile


def train_layout(*, tp: int, pp: int, dp: int, schedule: str = "1f1b", virtual_stages: int | None = None,
                 sequence_parallel: bool = False, recompute: str = "none", zero: int = 0, microbatches: int = 1,
                 batch_size: int = 1) -> tuple[Layout, Training]:
    """The planner's Layout and Training of ``plait train``'s options (``batch_size`` sequences over ``dp``
    replicas, each cut into ``microbatches``; ``virtual_stages`` None: the schedule's own default).
    Without a pipeline the schedule only orders gradient accumulation: it is costed as 1F1B; sequence
    parallelism needs tp > 1 to change anything."""
    from plait.schedules import build_schedule

    mb = max(1, batch_size // (dp * microbatches))
    virtual = build_schedule(schedule, stages=pp, microbatches=microbatches, virtual=virtual_stages).virtual
    if pp == 1:
        schedule, virtual = "1f1b", 1
    layout = Layout(tp=tp, pp=pp, dp=dp, virtual=virtual, microbatch_size=mb,
                    sequence_parallel=sequence_parallel and tp > 1, recompute=recompute, zero=zero, schedule=schedule)
    return layout, Training(batch_size)


def predict_train(model: Model, profile: HostProfile | Cluster, layout: Layout, training: Training,
                  precision: str = "fp32") -> Estimate:
    """Step time, bubble and per-rank memory of ``plait train`` for ``layout`` on the calibrated host
    (``layout.world`` processes). Raises ConfigError if the profile lacks that process count."""
    cluster = profile if isinstance(profile, Cluster) else Cluster.from_profile(profile, layout.world)
    train = Training(training.global_batch, overlap_grad_reduce=True, precision=precision)
    return estimate(model, cluster, layout, train, exact=True)
