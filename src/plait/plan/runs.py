"""The planner's prediction of a ``plait train`` run: its layout and batch as a planner Layout, on a calibrated host."""

from __future__ import annotations

from plait.parallel_config import ParallelConfig
from plait.plan.cluster import Cluster
from plait.plan.config import Layout, Training
from plait.plan.documents import DocumentLengths
from plait.plan.eager import RUNTIME_ELEMENTWISE
from plait.plan.estimate import Estimate, estimate
from plait.plan.host.profile import HostProfile
from plait.plan.model import Model
from plait.plan.optimizers import RUNTIME_MASTERS


def train_layout(parallel: ParallelConfig, batch_size: int, document_mask: bool = False,
                 documents: DocumentLengths | None = None) -> tuple[Layout, Training]:
    """The planner's Layout and Training of a ``plait train`` run (``parallel`` resolved: dp known;
    ``batch_size`` sequences over dp replicas, each cut into its micro-batches; ``Layout.from_parallel_config``),
    its element-wise kernels plait's own eager ones (``plan.eager``), its master weights where plait.optim keeps
    them (``Training.masters``), attending within documents with ``document_mask`` (``--document-mask``) as
    ``documents`` cut its rows (``Training.documents``)."""
    m = parallel.num_microbatches
    layout = Layout.from_parallel_config(parallel, max(1, batch_size // (parallel.dp * m)))
    return layout, Training(batch_size, precision=parallel.precision, elementwise=RUNTIME_ELEMENTWISE,
                            masters=RUNTIME_MASTERS, document_mask=document_mask,
                            documents=documents if document_mask else None)


def predict_train(model: Model, profile: HostProfile | Cluster, layout: Layout, training: Training) -> Estimate:
    """Step time, bubble and per-rank memory of ``plait train`` for ``layout`` on the calibrated host
    (``layout.world`` processes). Raises ConfigError if the profile lacks that process count."""
    cluster = profile if isinstance(profile, Cluster) else Cluster.from_profile(profile, layout.world)
    return estimate(model, cluster, layout, training, exact=True)
