"""ParallelModel.train_step of a language model names a batch it cannot read (ConfigError, before any collective):
token ids that are not [batch, seq] integers, or targets shaped unlike the inputs."""

import pytest
import torch

import plait
from plait.models import Llama, LlamaConfig

X = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("inputs,targets,shown", [
    (X[0], X[0], "inputs (8,) torch.int64"),  # one sequence without its batch dimension
    (X, X[:, :7], "targets (4, 7) torch.int64"),
    (X[None], X[None], "inputs (1, 4, 8)"),
    (X.float(), X, "inputs (4, 8) torch.float32"),
    (X, X.to(torch.int16), "targets (4, 8) torch.int16"),  # token ids are int64 or int32, as an embedding takes
])
def test_a_batch_that_is_not_token_ids_is_named(inputs, targets, shown):
    with plait.init(tp=1, pp=1, dp=1) as ctx:
        pm = plait.parallelize(Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)), ctx)
        with pytest.raises(plait.ConfigError, match="integer token ids") as info:
            pm.train_step(inputs, targets)
        assert shown in str(info.value)
        assert pm.train_step(X, X) > 0  # the same model still trains on a proper batch


@pytest.mark.parametrize("inputs,shown", [
    (X[0], "inputs (8,) torch.int64: a language model takes integer token ids"),
    (X.float(), "inputs (4, 8) torch.float32: a language model takes integer token ids"),
    (X.to(torch.int16), "inputs (4, 8) torch.int16"),  # an embedding takes int64 or int32 ids only
    (X + 64, "inputs contain token ids outside the vocabulary [0, 64) (min 64"),
])
def test_eval_step_names_a_batch_that_is_not_token_ids(inputs, shown):
    with plait.init(tp=1, pp=1, dp=1) as ctx:
        pm = plait.parallelize(Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)), ctx)
        with pytest.raises(plait.ConfigError) as info:
            pm.eval_step(inputs)
        assert shown in str(info.value)
        assert pm.eval_step(X).shape == (4, 8, 64)
