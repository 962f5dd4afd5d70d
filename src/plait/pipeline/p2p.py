"""Point-to-point transport between pipeline ranks: tagged async isend/irecv, shape negotiation, timeouts.

Every message has a tag unique within a step (kind, chunk, micro-batch), so receives can be posted
early and in any order: nothing depends on matching order, and no ``batch_isend_irecv`` is used (it can
hang on Gloo). Shapes and dtypes cross once per activation boundary and input shape in a small header
message; they are sent again when the sequence length (or any input shape) changes.

Tag matching is Gloo's: NCCL ignores tags. On GPUs the messages therefore travel on a Gloo group over the same
ranks (``ParallelContext.p2p_group``), staged through host memory: a device-to-host copy before each send and
a host-to-device copy after each receive.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait.errors import CommError, comm_wait

ACT, GRAD, HEADER, LOSS = 0, 1, 2, 3
_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32]
_HEADER_LEN = 10


@dataclass
class PendingRecv:
    work: object
    buffer: torch.Tensor
    src: int
    what: str


class Transport:
    """Sends and receives of one rank for one pipeline schedule (chunk count and micro-batches fixed)."""

    def __init__(self, num_chunks: int, microbatches: int, device: torch.device, timeout_s: float,
                 group: dist.ProcessGroup | None = None):
        self.num_chunks, self.microbatches = num_chunks, microbatches
        self.device, self.timeout_s = device, timeout_s
        self.timeout = datetime.timedelta(seconds=timeout_s)
        # the group's own send/recv (its ranks are the global ranks): torch.distributed's isend/irecv
        # re-check the group and the tensor on every call, a measurable share of a small message's cost
        world = group if group is not None else dist.group.WORLD
        assert world is not None, "torch.distributed is initialised before a Transport"
        self.world = world
        # Gloo moves host tensors: a GPU's messages are staged through host buffers
        self.wire = device if dist.get_backend(world) != "gloo" or device.type == "cpu" else torch.device("cpu")
        # in-flight sends: (work, buffer, destination, index of the destination's action that consumes it)
        self.sends: list[tuple[object, torch.Tensor, int, int]] = []
        self.loss_sends: list[tuple[object, torch.Tensor]] = []  # 8 bytes each, waited at the step's end
        self.pending: dict[tuple[int, int, int], PendingRecv] = {}
        self.shapes: dict[tuple[int, int], tuple[tuple[int, ...], torch.dtype]] = {}  # (kind, chunk)
        self.sent_headers: set[tuple[int, int]] = set()

    def reset_shapes(self) -> None:
        """Forget negotiated shapes (called when the input shape changes)."""
        self.shapes.clear()
        self.sent_headers.clear()

    def tag(self, kind: int, chunk: int, mb: int) -> int:
        return (kind * self.num_chunks + chunk) * self.microbatches + mb + 1

    # ----------------------------------------------------------------------------------------- send
    def send(self, tensor: torch.Tensor, dst: int, kind: int, chunk: int, mb: int, consumer: int = -1) -> None:
        """Asynchronously send ``tensor`` for (kind, chunk, mb) to global rank ``dst``, where the action at
        index ``consumer`` of ``dst``'s list will use it (see ``release``)."""
        tensor = tensor.detach().to(self.wire).contiguous()
        try:
            if kind == ACT and (kind, chunk) not in self.sent_headers:
                header = _encode_header(tensor).to(self.wire)
                self.sends.append((self.world.send([header], dst, self.tag(HEADER, chunk, 0)), header, dst, consumer))
                self.sent_headers.add((kind, chunk))
            self.sends.append((self.world.send([tensor], dst, self.tag(kind, chunk, mb)), tensor, dst, consumer))
        except RuntimeError as exc:
            raise CommError(f"sending to rank {dst} failed (is it still running?): {exc}") from exc

    def release(self, peer: int, done_before: int) -> None:
        """Free the buffers of sends to ``peer`` consumed by its actions before index ``done_before``.

        A message from ``peer`` produced by its action ``done_before`` proves (ranks run their lists in
        order) that every earlier action of ``peer`` finished, so those sends were received and ``wait``
        returns at once. Gloo reports a send as complete only once ``wait`` is called, so without this
        every buffer sent in a step (one activation or gradient per micro-batch) would live to its end.
        """
        keep = []
        for entry in self.sends:
            work, _, dst, consumer = entry
            if dst == peer and 0 <= consumer < done_before:
                self._wait(work, "a send already received", peer)
            else:
                keep.append(entry)
        self.sends = keep

    def wait_sends(self) -> None:
        for work, *_ in self.sends + self.loss_sends:
            self._wait(work, "send", -1)
        self.sends.clear()
        self.loss_sends.clear()

    # ------------------------------------------------------------------------------------- the loss
    def send_loss(self, loss: torch.Tensor, dsts: list[int]) -> None:
        """Send the step's loss (a float64 scalar) to ``dsts`` as soon as it is known; waited at the step's end."""
        value = loss.detach().to(self.wire, torch.float64).reshape(1).clone()  # never aliases the running sum
        for dst in dsts:
            try:
                self.loss_sends.append((self.world.send([value], dst, self.tag(LOSS, 0, 0)), value))
            except RuntimeError as exc:
                raise CommError(f"sending the step's loss to rank {dst} failed (is it still running?): {exc}") from exc

    def post_loss(self, src: int) -> None:
        buf = torch.empty(1, dtype=torch.float64, device=self.wire)
        try:
            work = self.world.recv([buf], src, self.tag(LOSS, 0, 0))
        except RuntimeError as exc:
            raise CommError(f"receiving the step's loss from rank {src} failed (is it still running?): {exc}") from exc
        self.pending[(LOSS, 0, 0)] = PendingRecv(work, buf, src, "the step's loss")

    def wait_loss(self) -> torch.Tensor:
        pending = self.pending.pop((LOSS, 0, 0))
        self._wait(pending.work, pending.what, pending.src)
        return pending.buffer[0].to(self.device)

    # -------------------------------------------------------------------------------------- receive
    def known_shape(self, kind: int, chunk: int) -> bool:
        return (kind, chunk) in self.shapes

    def set_shape(self, kind: int, chunk: int, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> None:
        self.shapes[(kind, chunk)] = (tuple(shape), dtype)

    def post(self, src: int, kind: int, chunk: int, mb: int) -> bool:
        """Post the receive for (kind, chunk, mb) if its shape is known; returns whether it is posted."""
        key = (kind, chunk, mb)
        if key in self.pending:
            return True
        if (kind, chunk) not in self.shapes:
            return False
        shape, dtype = self.shapes[(kind, chunk)]
        buf = torch.empty(shape, dtype=dtype, device=self.wire)
        what = f"{'activation' if kind == ACT else 'gradient'} of chunk {chunk}, micro-batch {mb}"
        try:
            work = self.world.recv([buf], src, self.tag(kind, chunk, mb))
        except RuntimeError as exc:
            raise CommError(f"posting the receive of the {what} from rank {src} failed (did it die?): {exc}") from exc
        self.pending[key] = PendingRecv(work, buf, src, what)
        return True

    def recv(self, src: int, kind: int, chunk: int, mb: int) -> torch.Tensor:
        """Block until (kind, chunk, mb) from global rank ``src`` has arrived and return it."""
        if (kind, chunk) not in self.shapes:
            header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.wire)
            work = self.world.recv([header], src, self.tag(HEADER, chunk, 0))
            self._wait(work, f"the shape header of chunk {chunk}", src)
            self.shapes[(kind, chunk)] = _decode_header(header)
        self.post(src, kind, chunk, mb)
        pending = self.pending.pop((kind, chunk, mb))
        self._wait(pending.work, pending.what, src)
        return pending.buffer.to(self.device)

    def _wait(self, work, what: str, peer: int) -> None:
        """Wait for ``work`` (``what``, from global rank ``peer``; -1: none), as plait.errors.comm_wait."""
        comm_wait(lambda: work.wait(self.timeout), what, peer if peer >= 0 else None, self.timeout_s)


def _encode_header(t: torch.Tensor) -> torch.Tensor:
    if t.dim() > _HEADER_LEN - 2:
        raise ValueError(f"pipeline activations may have at most {_HEADER_LEN - 2} dimensions")
    values = [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    return torch.tensor(values + [0] * (_HEADER_LEN - len(values)), dtype=torch.int64)


def _decode_header(h: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    values = h.tolist()
    return tuple(values[2:2 + values[1]]), _DTYPES[values[0]]
