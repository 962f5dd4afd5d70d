"""A peer that dies in a collective ends the survivor with a CommError naming the collective, its group's global
ranks and the member it lost, not the backend's bare RuntimeError ("Connection closed by peer")."""

import os
import subprocess
import sys

import pytest

import checks_faults
from harness import PRELOAD
from plait.distributed.launch import free_port, run_world
from plait.errors import CommError, CommTimeoutError, collective_error, comm_wait, rank_list


@pytest.mark.parametrize("where,names", [
    ("tp", "tp all-reduce of partial outputs (forward of g) over global ranks 0,1"),
    ("tp-pp", "pipeline rank 0, action 0F0 (#0): tp all-reduce of partial outputs (forward of g) over global "
              "ranks 0,1 failed"),  # one line: not the pipeline's explanation of a transfer and its schedule grid
    ("dp", "dp all-reduce of gradients (bucket of "),
    ("norm", "all-reduce of the gradient norm over global ranks 0,1"),
    ("save", "barrier before checkpoint 1's snapshot over global ranks 0,1"),
    ("trace", "pp barrier of a traced step over global ranks 0,1"),
    ("full-state", "pp all-gather of the full state over global ranks 0,1"),
    ("verify", "barrier at the end of plait verify's comparison over global ranks 0,1"),
    ("measure", "broadcast of whether to measure this host (rank 0's cache decides for everyone) over global "
                "ranks 0,1"),
    ("predict", "broadcast of rank 0's prediction of the run over global ranks 0,1"),
    ("cp-allgather", "cp all-gather of keys over global ranks 0,1"),  # was "tp all-gather"
    ("cp-ring", "the context-parallel ring's "),  # was gloo's words alone, in a pipeline transfer's explanation
])
def test_a_peer_dead_at_a_collective_is_named_with_the_collective(where, names):
    values = run_world(checks_faults.dead_at_collective, 4 if where == "tp-pp" else 2, where, timeout_s=120,
                       return_failures=True, allow_dead=True, preload=PRELOAD)
    waiter = values[0]
    assert waiter["raised"] in ("CommError", "CommTimeoutError"), waiter
    message = waiter["message"]
    assert names in message and (where == "cp-ring" or "over global ranks 0,1 " in message), message  # a p2p wait
    assert "global rank 1 " in message and "\n" not in message, message


def test_a_peer_dead_at_the_vocabulary_parallel_loss_is_named_with_it(monkeypatch):
    """The loss of TP-sharded logits all-reduces their maximum, then the softmax sums, over the TP group."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from plait.tensor_parallel.loss import vocab_parallel_cross_entropy

    def closed(*args, **kwargs):
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:26505. GLHF!")
    monkeypatch.setattr(dist, "all_reduce", closed)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [0, 1])
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    ctx = SimpleNamespace(tp_size=2, tp_group=object(), tp_rank=0)
    with pytest.raises(CommError) as info:
        vocab_parallel_cross_entropy(torch.zeros(3, 4), torch.zeros(3, dtype=torch.long), ctx)  # type: ignore[arg-type]
    assert str(info.value) == ("tp all-reduce of the logits' maximum (vocabulary-parallel loss) over global ranks 0,1 "
                               "failed (did global rank 1 die?): Connection closed by peer [127.0.0.1]:26505")
    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda *args, **kwargs: calls.append(1) if not calls else closed())
    with pytest.raises(CommError, match=r"^tp all-reduce of the softmax sums \(vocabulary-parallel loss\) over "):
        vocab_parallel_cross_entropy(torch.zeros(3, 4), torch.zeros(3, dtype=torch.long), ctx)  # type: ignore[arg-type]


def test_an_error_of_the_call_itself_is_not_read_as_a_lost_peer():
    """A collective that fails for its own reason (a wrong tensor, out of memory) keeps its error: only the
    transport's errors (Gloo's, torch's distributed kinds, a timeout) are asked whether a peer died."""
    import torch.distributed as dist

    from plait.distributed.collectives import backend_failure, collective

    def wrong():
        raise RuntimeError("Tensors must be contiguous")
    with pytest.raises(RuntimeError, match="^Tensors must be contiguous$") as info:
        collective("tp all-reduce", None, wrong)
    assert not isinstance(info.value, CommError)
    assert backend_failure(RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer"))
    assert backend_failure(dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp: unhandled system error"))
    assert backend_failure(RuntimeError("Timed out waiting 3000ms for recv operation to complete"))
    assert not backend_failure(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))


def test_a_collective_error_says_what_timed_out_or_failed_and_whom_it_lost():
    gloo = RuntimeError("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                        "[127.0.0.1]:38061: Connection reset by peer. This is typically caused by a remote worker "
                        "hanging or bugs in the application.\nCheck the logs of the remote worker. GLHF!")
    err = collective_error("dp all-reduce of gradients", [0, 1], 0, gloo)
    assert type(err) is CommError
    assert str(err) == ("dp all-reduce of gradients over global ranks 0,1 failed (did global rank 1 die?): "
                        "Read error [127.0.0.1]:38061: Connection reset by peer")
    late = RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 3000ms for recv operation "
                        "to complete")
    err = collective_error("tp all-gather", [4, 5, 6, 7], 5, late)
    assert isinstance(err, CommTimeoutError)
    assert str(err) == ("tp all-gather over global ranks 4-7 timed out (is one of global ranks 4,6,7 stuck or "
                        "dead?): Timed out waiting 3000ms for recv operation to complete")
    assert rank_list([0, 1, 2, 3, 6, 8, 9]) == "0-3,6,8,9"


def test_a_point_to_point_wait_s_error_keeps_the_gist_of_the_backend_s_words():
    """A p2p wait's CommError carried Gloo's whole text: its source path and "This is typically caused by ... GLHF!
    🏖️" after the line that matters."""
    def closed():
        raise RuntimeError("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                           "[127.0.0.1]:26505. This is typically caused by a remote worker crashing. Check the logs "
                           "of the remote worker before reporting an error. GLHF! 🏖️")

    with pytest.raises(CommError) as info:
        comm_wait(closed, "the tokens of prompt 0", 1, 3.0, me="generate: pipeline rank 0")
    assert str(info.value) == ("generate: pipeline rank 0: the tokens of prompt 0 from global rank 1 failed (did that "
                               "rank die?): Connection closed by peer [127.0.0.1]:26505")


# plait's CLI as torchrun runs it, except that global rank 1 kills itself (SIGKILL) at its optimizer step
KILLED_AT_THE_STEP = """
import os, signal
from plait.cli.main import main
if os.environ["RANK"] == "1":
    import plait.optim.optimizer as o
    o.ParallelOptimizer.step = lambda self: os.kill(os.getpid(), signal.SIGKILL)
main()
"""


def test_under_torchrun_a_peer_killed_at_a_collective_ends_the_survivor_in_one_line_naming_it(tmp_path):
    """Rank 0 waits in the gradient-norm all-reduce that rank 1 never joins: it ended in Gloo's bare
    RuntimeError traceback ("Connection reset by peer"), and now says which collective over which ranks."""
    (tmp_path / "killed_at_step.py").write_text(KILLED_AT_THE_STEP)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    env.pop("PLAIT_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), "-m", "killed_at_step", "train", "--tp", "1", "--pp", "1", "--dp", "2",
                           "--steps", "2", "--seq-len", "32", "--batch-size", "4", "--microbatches", "2",
                           "--eval-every", "0", "--max-data-mb", "0.3", "--sample-tokens", "0", "--cluster", "none"],
                          cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: rank 0: ")]
    assert len(lines) == 1, proc.stderr[-4000:]
    assert lines[0].startswith("error: rank 0: CommError: all-reduce of the gradient norm over global ranks 0,1 "
                               "failed (did global rank 1 die?): "), lines
    assert "[rank0]: Traceback" not in proc.stderr, proc.stderr[-4000:]
