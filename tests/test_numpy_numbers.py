"""numpy's integers and reals (from a config dict or a user's arithmetic) are numbers to every config plait takes:
accepted where Python's are, held as Python's (so they write as JSON and TOML), while a bool stays refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

import plait
from plait.generation import Sampling
from plait.models import LlamaConfig
from plait.parallel_config import ParallelConfig
from plait.schedules import build_schedule
from plait.sim import Costs
from plait.train.config import TrainConfig, toml_text, validate
from plait.verify import VerifyConfig, check

MODEL = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4)


def _plain(values: dict) -> None:
    """Every number in ``values`` is Python's, and they write as JSON."""
    json.dumps(values)
    numbers = [v for v in values.values() if isinstance(v, (int, float, np.generic)) and not isinstance(v, bool)]
    assert numbers and all(type(v) in (int, float) for v in numbers), values


def test_numpy_numbers_are_taken_as_python_numbers_and_bools_are_still_refused():
    i = np.int64
    sched = build_schedule("interleaved-1f1b", stages=i(2), microbatches=np.int32(4), virtual=i(2))
    assert (type(sched.num_ranks), type(sched.microbatches), type(sched.virtual)) == (int, int, int)
    sched.to_json()

    par = ParallelConfig(tp=i(2), pp=i(2), dp=i(-1), microbatches=i(4), zero=i(1))
    _plain(par.to_dict())
    assert par.resolve(i(8)).dp == 2

    llama = LlamaConfig(**{k: i(v) for k, v in MODEL.items()}, rope_theta=np.float32(1e4), sliding_window=i(8))
    _plain(llama.to_dict())

    sampling = Sampling(max_new_tokens=i(3), top_k=i(2), temperature=np.float32(0.5))
    sampling.check()
    _plain(vars(sampling))
    ids = plait.generate(plait.models.Llama(LlamaConfig(**MODEL)), [i(1), i(2)], max_new_tokens=i(2), top_k=i(2))
    assert len(ids) == 2 and all(type(t) is int for t in ids)

    train = TrainConfig(parallel=ParallelConfig(tp=1, pp=1, dp=1, microbatches=2), seq_len=i(32), batch_size=i(4),
                        steps=i(2), nproc=i(1), lr=np.float32(1e-3))
    validate(train)
    _plain(train.to_dict())
    assert "steps = 2\n" in toml_text({k: v for k, v in train.to_dict().items() if k != "data"})

    verify = VerifyConfig(parallel=ParallelConfig(tp=2, pp=1, dp=1, microbatches=2), seq_len=i(16), batch_size=i(4))
    check(verify)
    _plain(verify.to_dict())

    costs = Costs(forward=np.float32(1.0), backward=[i(2), i(3)])
    assert costs.durations(build_schedule("1f1b", 2, 2))["B"] == [2.0, 3.0]
    _plain({k: v for k, v in costs.to_dict().items() if not isinstance(v, list)})
    assert [type(x) for x in costs.to_dict()["backward"]] == [int, int]

    refused = [
        ("stages=True: must be an integer >= 1", lambda: build_schedule("1f1b", stages=True, microbatches=2)),
        ("tp=True: must be a positive integer", lambda: ParallelConfig(tp=True)),
        ("dp=True: must be a positive integer or -1", lambda: ParallelConfig(dp=True)),
        ("n_layers=True must be a positive integer", lambda: LlamaConfig(**{**MODEL, "n_layers": True})),
        ("sliding_window=0 must be a positive integer", lambda: LlamaConfig(**MODEL, sliding_window=0)),
        ("top_k=True: must be an integer >= 0", lambda: Sampling(top_k=True).check()),
        ("--steps True: must be a positive integer", lambda: validate(TrainConfig(steps=True))),
        ("--nproc True: must be a positive integer", lambda: validate(TrainConfig(nproc=True))),
        ("seq_len=True: must be an integer >= 1", lambda: check(VerifyConfig(seq_len=True))),
        ("forward=True: times must be finite numbers >= 0", lambda: Costs(forward=True).durations(sched)),
    ]
    for needle, build in refused:
        with pytest.raises(plait.ConfigError) as info:
            build()
        assert needle in str(info.value), (needle, str(info.value))
