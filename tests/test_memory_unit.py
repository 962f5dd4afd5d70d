"""Without processes: the saved-tensor meter (storages counted once, released after backward) and the check of
``activation_checkpointing``."""

from types import SimpleNamespace

import pytest
import torch

import plait
from plait import ConfigError
from plait.memory import CountsItsBytes, SavedTensorMeter, optimizer_bytes, storage_bytes
from plait.models import Llama, LlamaConfig
from plait.parallel_config import ParallelConfig


def test_meter_counts_storages_once_and_releases_them():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    meter = SavedTensorMeter(exclude=[w])
    with meter.hooks():
        h = x @ w            # saves x (64 floats) and w (excluded)
        a = h[:, :2]         # a view of h's storage
        y = (a * a).sum()    # saves the view twice: h's storage (32 floats) once
    assert meter.live == meter.peak == 4 * (32 + 32)
    y.backward()
    assert meter.live == 0 and meter.peak == 4 * 64  # autograd dropped what it saved


def test_storage_bytes_counts_views_once():
    buf = torch.zeros(100)
    assert storage_bytes([buf[:10], buf[50:], buf.view(10, 10), None]) == 400


def test_optimizer_bytes_takes_an_optimizer_s_own_count_else_its_state_tensors():
    class Counted:
        def memory_bytes(self) -> int:
            return 123

    w = torch.nn.Parameter(torch.zeros(8, 4))
    adam = torch.optim.AdamW([w])
    w.grad = torch.ones_like(w)
    adam.step()
    assert isinstance(Counted(), CountsItsBytes) and not isinstance(adam, CountsItsBytes)
    assert optimizer_bytes(Counted()) == 123
    assert optimizer_bytes(adam) == 2 * w.nbytes + adam.state[w]["step"].nbytes  # the two moments and the step
    assert optimizer_bytes(None) == 0


@pytest.mark.parametrize("value", ["selective-ish", "Full", 1, 0.5])
def test_unknown_activation_checkpointing_is_a_config_error(value):
    """Only True/False/"none"/"full" (a truthy 1 is refused, not taken for "full"); no process group needed."""
    ctx = SimpleNamespace(config=ParallelConfig(tp=1, pp=1, dp=1), world_size=1)
    model = Llama(LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=8))
    with pytest.raises(ConfigError, match="activation_checkpointing|recompute"):
        plait.parallelize(model, ctx, activation_checkpointing=value)
