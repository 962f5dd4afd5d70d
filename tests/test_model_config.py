"""LlamaConfig names a setting it cannot build a model from (ConfigError) instead of failing later inside torch
(a ZeroDivisionError, a TypeError) or building a model that computes NaN (rope_theta 0) or ties what was not asked."""

import pytest

import plait
from plait.models import LlamaConfig


@pytest.mark.parametrize("kw,needle", [
    (dict(n_heads=0), "n_heads=0 must be a positive integer"),  # was a ZeroDivisionError from dim % n_heads
    (dict(vocab_size=2.5), "vocab_size=2.5 must be a positive integer"),
    (dict(n_layers=True), "n_layers=True must be a positive integer"),
    (dict(rope_theta=0.0), "rope_theta=0.0 must be a number > 0"),  # inverse frequencies of 1/0
    (dict(norm_eps=float("nan")), "norm_eps=nan must be a number >= 0"),
    (dict(tie_embeddings="no"), "tie_embeddings='no' must be True or False"),  # a non-empty string is truthy
])
def test_a_setting_that_builds_no_sound_model_is_named(kw, needle):
    with pytest.raises(plait.ConfigError) as info:
        LlamaConfig(**{**dict(vocab_size=64, dim=32, n_layers=2, n_heads=4), **kw})
    assert needle in str(info.value)
