"""The context-parallel collectives: the K/V all-gather and the ring's point-to-point block exchange.

gather_kv: all-gather of keys or values along the sequence over the CP group; its backward is the
           conjugate reduce-scatter (each rank's K/V gradient is the sum of what every rank's queries
           sent back), the same autograd function as sequence parallelism's all-gather
           (plait.tensor_parallel.comms.gather_seq)
Ring:      each rank passes a message to the next CP rank and receives the previous rank's, with
           ``isend``/``irecv`` pairs issued in an order that cannot deadlock (never ``batch_isend_irecv``,
           which can hang on Gloo)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from plait.errors import CommError, comm_wait
from plait.tensor_parallel import comms as tp_comms


def gather_kv(x: torch.Tensor, group, what: str) -> torch.Tensor:
    """[B, h_kv, S/cp, hd] on each rank -> [B, h_kv, S, hd] (rank 0's tokens, then rank 1's, ...); ``what`` ("keys")
    names it in a failure's CommError ("cp all-gather of keys")."""
    return tp_comms.gather_seq(x, group, 2, (f"cp all-gather of {what}", f"cp reduce-scatter of {what}' gradients"))


class Ring:
    """Point-to-point exchange around the CP group: send to rank r+1, receive from rank r-1 (mod cp)."""

    def __init__(self, group, timeout_s: float):
        ranks = dist.get_process_group_ranks(group)
        self.size, self.index = len(ranks), ranks.index(dist.get_rank())
        self.group, self.timeout_s = group, timeout_s  # the group's own timeout, which ends a wait
        self.next, self.prev = ranks[(self.index + 1) % self.size], ranks[(self.index - 1) % self.size]

    def start(self, tensors: list[torch.Tensor], tag: int, what: str) -> RingTransfer:
        """Send ``tensors`` (one flat message, ``what`` in words: "keys and values") to the next rank and receive
        the same shapes from the previous; a wait that fails names ``what`` and the peer (plait.errors.comm_wait).

        Even ranks post their send first, odd ranks their receive first: on backends whose point-to-point
        operations block until matched (NCCL's send waits for the peer's receive), every send then meets a
        posted receive, for any ring size; Gloo's are asynchronous either way. ``tag`` keeps two transfers
        in flight at once apart (keys/values and their gradients).
        """
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        recv = torch.empty_like(flat)
        send_first = self.index % 2 == 0
        works: list[tuple[dist.Work | None, str, int | None]] = []  # (None only off the group: never here)
        for op in (("send", "recv") if send_first else ("recv", "send")):
            if op == "send":
                works.append((dist.isend(flat, dst=self.next, group=self.group, tag=tag),
                              f"the context-parallel ring's send of its {what} to global rank {self.next}", None))
            else:
                works.append((dist.irecv(recv, src=self.prev, group=self.group, tag=tag),
                              f"the context-parallel ring's {what}", self.prev))
        return RingTransfer(works, flat, recv, [(t.shape, t.numel()) for t in tensors], self.timeout_s)


class RingTransfer:
    """A transfer in flight; ``wait()`` returns the received tensors (shapes of the ones sent)."""

    def __init__(self, works: list[tuple[dist.Work | None, str, int | None]], sent: torch.Tensor, recv: torch.Tensor,
                 shapes: list[tuple[torch.Size, int]], timeout_s: float):
        self.works, self.sent, self.recv, self.shapes = works, sent, recv, shapes  # ``sent`` alive until done
        self.timeout_s = timeout_s

    def wait(self) -> list[torch.Tensor]:
        for work, what, peer in self.works:
            if work is None:
                continue
            try:
                comm_wait(work.wait, what, peer, self.timeout_s)
            except CommError as exc:  # inside a pipeline action: a collective that names whom it lost itself
                exc.collective = what
                raise
        out, offset = [], 0
        for shape, n in self.shapes:
            out.append(self.recv[offset:offset + n].view(shape))
            offset += n
        return out
