"""Fixtures shared by several test modules: one 4-rank and one 8-rank world, one ``plait serve`` for the serving
tests, and the session's cache directory (never the real home)."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass

import pytest

from harness import PRELOAD
from shared_world import START_S, group_result, launch_groups

KEY = "sk-plait-test"
KV_BUDGET = 120  # < the context (128): a request may fit the context yet not the pool


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu",
                     help="device of the single-process device tests (tests/test_device_path.py): cpu or cuda[:N]")


@pytest.fixture(scope="session")
def device(request):
    """The torch device named by ``--device`` (bench/gpu_check.py runs the device tests with --device cuda)."""
    import torch

    dev = torch.device(request.config.getoption("--device"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        pytest.fail("--device cuda given but torch.cuda.is_available() is False")
    return dev


@pytest.fixture(scope="module", autouse=True)
def no_default_group_left():
    """A module that ran plait in this process (plait.init, plait.train.loop.train) leaves the default process
    group plait made, which stays for the process's life; it is destroyed after the module, so that a later module
    that makes its own world (test_device_path's, on the device's backend) starts from none."""
    import torch.distributed as dist

    before = dist.is_available() and dist.is_initialized()
    yield
    if not before and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session", autouse=True)
def one_intra_op_thread():
    """The test process's own computations (one-device references, the tokens a server should give) run on one
    intra-op thread, as plait's workers on a shared host do: the processes a test starts, and on a shared host
    others', hold the cores, and a second OpenMP thread of tiny operations spends its time waiting for a core
    its partner lost instead of computing. Workers and fork servers set their own count (plait.distributed)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def plait_cache(tmp_path_factory):
    """``PLAIT_CACHE_DIR`` for every test and the processes it starts, holding a synthetic profile of this
    host so that ``plait train`` does not calibrate in tests that do not test calibration."""
    from plait.calibrate import CACHE_ENV, cache_path, host_facts
    from profile_util import synthetic_profile

    root = tmp_path_factory.mktemp("plait-cache")
    old = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(root)
    facts = host_facts()
    synthetic_profile(facts, block=True, layers=True).save(cache_path(facts))  # complete: nothing to measure
    yield root
    if old is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = old


#: test module -> (the checks module whose rank_main its tests read, all run in the one launch of 4 ranks; the
#: seconds its group may take there: 3x its time at load 2-7 on 2 cores, at least 60)
WORLD4_GROUPS = {"test_pipeline": ("checks_pipeline", 190), "test_train": ("checks_train", 135),
                 "test_experts": ("checks_experts", 90), "test_optim": ("checks_optim", 60),
                 "test_llama_parallel": ("checks_llama", 60), "test_tp_layers": ("checks_tp", 60),
                 "test_context": ("checks_context", 75), "test_zero3": ("checks_zero3", 120),
                 "test_data_layouts": ("checks_data", 60), "test_context_close": ("checks_context_close", 60),
                 "test_regather": ("checks_regather", 60), "test_generate_eos": ("checks_generate", 60),
                 "test_library": ("checks_library", 60), "test_documents": ("checks_documents", 60)}
#: pytest-timeout's limit for the tests of those modules: the first of them to run sets the launch up (inside its
#: own limit), which may take every group's bound, and a new start after each group that overran
WORLD4_TIMEOUT_S = sum(bound for _m, bound in WORLD4_GROUPS.values()) + START_S + 30 * len(WORLD4_GROUPS)


@pytest.hookimpl(trylast=True)  # after -k and -m deselected theirs
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "world4" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(WORLD4_TIMEOUT_S))


@pytest.fixture(scope="session")
def families(tmp_path_factory):
    """Hugging Face folders of the model families (checks_families.FAMILIES), or None without transformers."""
    import checks_families

    if importlib.util.find_spec("transformers") is None:
        return None
    return checks_families.make_folders(tmp_path_factory.mktemp("families"))


@pytest.fixture(scope="session")
def world4_shared(request, tmp_path_factory):
    """One launch of 4 Gloo ranks for every test module of WORLD4_GROUPS collected in this session (starting a
    world costs ~5-15 s on 2 cores): each module's checks run in turn, its results under its name. A module's
    group that runs past its bound fails that module's tests, naming the check each rank was in; the groups after
    it run in a new launch (shared_world)."""
    wanted = {item.module.__name__ for item in request.session.items if "world4" in item.fixturenames}
    groups: dict[str, tuple[str, tuple]] = {}
    for name, (checks, _bound) in WORLD4_GROUPS.items():
        if name not in wanted:
            continue
        if name == "test_pipeline":
            folders = request.getfixturevalue("families")
            groups[name] = (checks, (None if folders is None else str(folders),))
        elif name in ("test_train", "test_zero3", "test_context", "test_data_layouts",
                      "test_generate_eos", "test_library"):  # a scratch folder
            groups[name] = (checks, (str(tmp_path_factory.mktemp(name)),))
        else:
            groups[name] = (checks, ())
    bounds = {name: float(bound) for name, (_c, bound) in WORLD4_GROUPS.items()}
    return launch_groups(groups, 4, bounds, str(tmp_path_factory.mktemp("world4-notes")), preload=PRELOAD)


@pytest.fixture(scope="module")
def world4(request, world4_shared):
    """This module's per-rank check results from the shared launch of 4 ranks."""
    return group_result(world4_shared, request.module.__name__)


#: the seconds the world of 8's checks may take: 5x their time at load ~3 on 2 cores (46 s)
WORLD8_BOUND_S = 240.0


@pytest.fixture(scope="session")
def world8(tmp_path_factory):
    """One launch of 8 Gloo ranks: every schedule over tp2·pp2·dp2 (tests/test_pipeline.py) and ZeRO-1/2 over
    dp2·tp2·pp2 and dp4·tp2 (tests/test_zero.py); each rank's dict of check results. Past its bound, the checks
    that ended keep their results and the others fail naming the check each rank was in (shared_world)."""
    groups = {"world8": ("checks_pipeline", (None, str(tmp_path_factory.mktemp("zero"))))}
    world = launch_groups(groups, 8, {"world8": WORLD8_BOUND_S}, str(tmp_path_factory.mktemp("world8-notes")),
                          preload=PRELOAD)
    return group_result(world, "world8")


@dataclass
class Served:
    server: object  # serve_util.Server
    client: object  # openai.OpenAI
    ref: object  # the same model on one device (plait.models.Llama)
    eos: int  # the model folder's end-of-sequence id, chosen so that ...
    eos_prompt: list[int]  # ... the greedy continuation of this prompt reaches it
    eos_at: int  # as its (eos_at + 1)-th token, and not before

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {KEY}"}


#: a prompt whose 8 greedy tokens the served model's EOS is chosen not to be among (tests/test_serve.py)
PLAIN_PROMPT = "def main(): pass"


@pytest.fixture(scope="session")
def served(tmp_path_factory):
    """The server, shared by every test that asks for it (starting one costs ~10 s)."""
    import httpx
    import openai

    from plait.generation.job import load_model
    from plait.tokenizers import ByteTokenizer
    from serve_util import Server, expected_ids, tiny_model

    tmp = tmp_path_factory.mktemp("serve")
    model_dir = tiny_model(tmp / "tiny", newlines=True)
    ref = load_model(str(model_dir))[0]
    prompt = ByteTokenizer().encode("the end is near")
    cont = expected_ids(ref, prompt, 24)
    plain = expected_ids(ref, ByteTokenizer().encode(PLAIN_PROMPT), 8)  # must run to its length: no EOS in it
    at = next(i for i in range(4, 24) if cont[i] not in cont[:i] and cont[i] not in plain)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": cont[at]}))
    server = Server(model_dir, tmp, "--pp", "2", "--max-batch", "8", "--kv-budget", str(KV_BUDGET),
                    "--max-tokens", "100", "--kv-block", "4", "--step-tokens", "16", "--api-key", KEY,
                    "--max-body-bytes", "65536")
    try:
        server.wait_healthy()
        # max_retries=0: a failed request fails its test. uvicorn closes a connection idle for 5 s; a client
        # that keeps idle connections as long (openai's default) may send a request on one just as the server
        # closes it ("Server disconnected without sending a response"), so this one drops them after 2 s.
        keepalive = httpx.Limits(max_connections=1000, max_keepalive_connections=100, keepalive_expiry=2.0)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60,
                               http_client=httpx.Client(limits=keepalive))
        yield Served(server, client, ref, cont[at], prompt, at)
    finally:
        server.kill()
