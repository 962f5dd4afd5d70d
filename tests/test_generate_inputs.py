"""plait.generate's calling forms (str in, str out; ids in, ids out; lists of either; a tensor of ids) and its
refusals of prompts the model cannot read: ids outside its vocabulary, a byte-encoded string for one under 256."""

import pytest
import torch

import plait
from plait.models import Llama, LlamaConfig


def model(vocab: int) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=vocab, dim=32, n_layers=2, n_heads=4, max_seq_len=16))


def test_strings_give_strings_and_ids_give_ids_one_or_a_list():
    m = model(256)
    text, ids = plait.generate(m, "def ", max_new_tokens=3), plait.generate(m, [100, 101, 102, 32], max_new_tokens=3)
    assert isinstance(text, str)
    assert isinstance(ids, list) and len(ids) == 3 and all(isinstance(t, int) for t in ids)
    assert ids == plait.generate(m, [list(b"def ")], max_new_tokens=3)[0]  # "def " is these ids, greedy
    assert plait.generate(m, torch.tensor([100, 101, 102, 32]), max_new_tokens=3) == ids  # a tensor of ids too
    assert plait.generate(m, torch.tensor([[100, 101, 102, 32]]), max_new_tokens=3) == [ids]
    both = plait.generate(m, ["def ", "ab"], max_new_tokens=3)
    assert isinstance(both, list) and len(both) == 2 and all(isinstance(t, str) for t in both)


@pytest.mark.parametrize("vocab,prompt,needle", [
    (64, [1, 2, 70], "[0, 64); got ids from 1 to 70"),
    (64, [[1], [2, -3]], "[0, 64); got ids from -3 to 2"),
    (64, "def ", "[0, 64); got ids from 32 to 102"),  # UTF-8 bytes past a 64-token vocabulary
])
def test_token_ids_outside_the_vocabulary_are_a_config_error(vocab, prompt, needle):
    with pytest.raises(plait.ConfigError, match="prompt token ids must lie in the model's vocabulary") as info:
        plait.generate(model(vocab), prompt, max_new_tokens=2)
    assert needle in str(info.value)


@pytest.mark.parametrize("kw,needle", [({"max_new_tokens": 2.5}, "max_new_tokens=2.5: must be an integer >= 0"),
                                       ({"top_k": 1.5}, "top_k=1.5: must be an integer >= 0"),
                                       ({"temperature": float("nan")}, "temperature=nan: must be a number >= 0")])
def test_sampling_settings_that_are_not_counts_are_named(kw, needle):
    with pytest.raises(plait.ConfigError) as info:
        plait.generate(model(256), "def ", **kw)
    assert needle in str(info.value)
