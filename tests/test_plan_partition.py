"""The pipeline cut the planner costs (``Layout.partition``): plait's balanced one, equal counts, explicit counts."""

import pytest

from plait.errors import ConfigError
from plait.plan import Cluster, Layout, Model, Training, estimate
from plait.plan.config import check
from plait.plan.memory import max_rank_params
from plait.plan.published import runs
from plait.plan.stages import layout_stages

# eight small layers and a vocabulary large enough that the head weighs more than a layer
MODEL = Model(8, 256, 4, 32000, 128, name="cut-test")


def test_uniform_and_explicit_cuts():
    assert layout_stages(Model(10, 256, 4, 1000, 128), Layout(pp=4, dp=1, partition="uniform")).chunk_layers \
        == (2, 2, 3, 3)  # equal counts, the surplus on the last chunks
    assert Layout(pp=4, partition=[3, 2, 2, 1]) == Layout(pp=4, partition=(3, 2, 2, 1))  # as JSON gives it back
    st = layout_stages(MODEL, Layout(pp=4, partition=(3, 2, 2, 1)))
    assert st.chunk_layers == (3, 2, 2, 1) and st.rank_layers == (3, 2, 2, 1)
    # interleaved: chunk c on rank c mod pp
    st = layout_stages(MODEL, Layout(pp=2, virtual_stages=2, schedule="interleaved-1f1b", partition=(1, 3, 3, 1)))
    assert st.rank_layers == (4, 4)
    # plait's balanced cut charges the head to the last chunk: it takes fewer layers there than the equal cut
    assert layout_stages(MODEL, Layout(pp=4)).chunk_layers[-1] < 2


def test_the_cut_reaches_memory_and_time():
    layer, embedding = MODEL.layer_params(), MODEL.embedding_params()
    # rank 0: three layers and the embedding; the last rank: one layer, the final norm and the (untied) head
    most = max_rank_params(MODEL, Layout(pp=4, partition=(3, 2, 2, 1)))
    assert most == 3 * layer + embedding > layer + MODEL.head_params()
    small_head = Model(8, 1024, 8, 1000, 512)
    cluster, training = Cluster("a100-80gb", 4), Training(global_batch=16)
    even = estimate(small_head, cluster, Layout(pp=4, microbatch_size=1, partition="uniform"), training)
    heavy = estimate(small_head, cluster, Layout(pp=4, microbatch_size=1, partition=(5, 1, 1, 1)), training)
    # the five-layer chunk sets the pipeline's pace: 16 micro-batches of 5 layers against 2 (plus fill and drain)
    assert heavy.step_time_s > 2 * even.step_time_s


def test_bad_cuts_are_refused_naming_the_parameter():
    with pytest.raises(ConfigError, match="partition: 'even' is not one of balanced, uniform"):
        Layout(pp=2, partition="even")
    bad = check(MODEL, Cluster("a100-80gb", 4), Layout(pp=4, partition=(3, 3, 1, 0)), Training(global_batch=8))
    assert bad is not None and bad[0] == "partition"
    assert "give 4 positive layer counts" in bad[1] and "summing to 8" in bad[1]
    with pytest.raises(ConfigError, match="partition: 'uniform' is planned but the runtime runs balanced"):
        Layout(pp=2, partition="uniform").to_parallel_config()
    assert Layout(pp=2, partition="uniform").short() == "tp1 pp2 dp1 mb1 norc z0 cut uniform 1f1b (plan-only)"


def test_published_rows_cut_as_their_stacks_do():
    rows = {r.label: r for r in runs()}
    bloom = rows["BLOOM 176B on 384 A100"]  # "pp rank 0: [embed | 5 transformer blocks] ... pp rank 11: [5 ...]"
    assert layout_stages(bloom.model, bloom.layout).chunk_layers == (5,) + (6,) * 10 + (5,)
    search = rows["BLOOM 181B search: dp8 tp2 pp24 mbs1"]  # DeepSpeed's type:transformer: 3 layers a stage
    assert set(layout_stages(search.model, search.layout).chunk_layers) == {3}
    dgx = rows["llama3-405b on 512 H100, BF16"]  # the embedding and the loss counted as a layer each
    cut = layout_stages(dgx.model, dgx.layout).chunk_layers
    assert cut[0] == cut[-1] == 1 and set(cut[1:-1]) == {2} and sum(cut) == 126
    seventy = rows["llama3-70b on 64 H100, BF16"]  # Megatron-Core's equal counts: 80 layers in 20 chunks
    assert set(layout_stages(seventy.model, seventy.layout).chunk_layers) == {4}
