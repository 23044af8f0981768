"""Parking: large saved activations held in host memory from the forward until the backward needs them.

With ``park_saved_tensors=True`` the engine's saved-tensor hooks (``Binder.pack_saved``, entered for
every forward with grad under the engine, each layer-major worker's included) copy each saved
activation of at least ``PARK_MIN`` bytes, or a view of a storage that large (the view would keep
all of it alive), to host memory and let the device copy go; the backward's
unpack copies it back on the stream that asks for it. Weights are never parked (streamed ones are
saved as references to their unit; resident ones are parameters).

Why: layer-major accumulation (lockstep.py) keeps every micro-batch's saved activations until the
one backward, K times a single micro-batch's. With checkpointing those are each block's inputs:
at Flux-dev dims 57 blocks x about 28 MB a micro-batch, 6.4 GB for K=4, more than an 8 GiB card
has beside the ring. Parked, they cost a D2H copy in the forward (on a stream of its own, beside
the weights' H2D copies: the link is full duplex) and an H2D copy in the backward.

- The D2H copy waits for the tensor's producer, runs on the parking stream into pinned memory
  (pageable where the host refuses to pin more, said once), and keeps the device memory from
  reuse until it is done (``record_stream``); the unpack waits for it on the device.
- Only contiguous tensors are parked: an expanded view (stride 0) would grow to its full size.
- On the CPU (``target_device="cpu"``) a parked tensor is a copy: nothing is saved, the hooks'
  path is the same (the CPU tests check the gradients bitwise).
- The backward unpacks in about the reverse order of the parking (the last unit's inputs first, and
  layer-major, micro-batch K's first): each unpack brings the ``AHEAD`` tensors parked just before it
  back on the parking stream, so their H2D copies run beside the backward's compute rather than in
  front of it. A tensor unpacked out of that order is copied back then (on the stream that asks).
  Only pinned host copies are brought back ahead (a pageable copy would hold the host thread).
- Under an emulated slower link (``debug_link_gbps``, link.py) the H2D copy back is paced like a
  weight's (held on the stream it runs on); the D2H copy is not (the pacer models H2D only). Not
  modelled: that on a real link those bytes also take their time from the weights' copies.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from torch import nn

__all__ = ["PARK_MIN", "Parked", "Parking"]

PARK_MIN = 4 << 20  # bytes: a block's input at Flux-dev dims is ~28 MB; the small ones are not worth a copy
AHEAD = 4  # parked tensors brought back ahead of their unpack (a micro-batch's inputs of a unit, and the next's)


class Parked:
    """A saved tensor's host copy, the event after its D2H copy, and where it goes back to; once brought back
    ahead, the device copy and the event after it."""

    __slots__ = ("host", "event", "device", "pos", "back", "back_event", "__weakref__")

    def __init__(self, host: torch.Tensor, event: Any, device: torch.device, pos: int = -1) -> None:
        self.host, self.event, self.device, self.pos = host, event, device, pos
        self.back: torch.Tensor | None = None
        self.back_event: Any = None


class Parking:
    def __init__(self, device: torch.device, counters: Any) -> None:
        self.device = device
        self.counters = counters
        self.pacer: Any = None  # the engine's LinkPacer under debug_link_gbps (set after the engine makes it)
        self.is_cuda = device.type == "cuda"
        self.pin = self.is_cuda
        self._stream: Any = None
        self._order: list[weakref.ref[Parked]] = []  # the parked tensors, in parking order (CUDA only)

    @staticmethod
    def wants(t: torch.Tensor) -> bool:
        # by its storage too: a small view keeps its whole storage alive (Flux's single blocks return their
        # 512 text tokens as a view of the 4608-token output: 3 MB that held 27 MB a block and micro-batch)
        return (not isinstance(t, nn.Parameter) and t.is_contiguous()
                and max(t.numel() * t.element_size(), t.untyped_storage().nbytes()) >= PARK_MIN)

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        if self.pin:
            try:
                return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            except RuntimeError as exc:  # the host pins no more (WSL2's cap): pageable, slower, said once
                self.pin = False
                warnings.warn(f"park_saved_tensors: pinning host memory failed ({str(exc).splitlines()[0]}); "
                              "parking in pageable memory (synchronous copies)", RuntimeWarning, stacklevel=3)
        return torch.empty(t.shape, dtype=t.dtype)

    def park(self, t: torch.Tensor) -> Parked:
        host = self._host(t)
        event = None
        if self.is_cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            s = self._stream
            s.wait_stream(torch.cuda.current_stream(t.device))  # the tensor's producer first
            with torch.cuda.stream(s):
                host.copy_(t, non_blocking=host.is_pinned())
                event = torch.cuda.Event()
                event.record(s)
            t.record_stream(s)  # its memory is not reused before the copy is done
        else:
            host.copy_(t)
        self.counters.parked_tensors += 1
        self.counters.parked_bytes += host.numel() * host.element_size()
        p = Parked(host, event, t.device)
        return self._track(p) if event is not None else p

    def _track(self, p: Parked) -> Parked:
        """Note ``p`` in the parking order (what the backward will want back ahead of its unpack)."""
        if self._order and self._order[-1]() is None:
            self._order = []  # the last forward's parked tensors went without a backward (a failed step)
        p.pos = len(self._order)
        self._order.append(weakref.ref(p))
        return p

    def unpark(self, p: Parked) -> torch.Tensor:
        if p.event is None:
            return p.host
        current = torch.cuda.current_stream(p.device)
        if p.back is not None:  # brought back ahead, on the parking stream
            out, p.back = p.back, None
            current.wait_event(p.back_event)
            out.record_stream(current)  # allocated on the parking stream, used (and freed) on this one
        else:
            current.wait_event(p.event)
            if self.pacer is None:
                out = p.host.to(p.device, non_blocking=p.host.is_pinned())
            else:
                with torch.cuda.device(p.device):  # paced on the stream the copy is queued on
                    out = torch.empty_like(p.host, device=p.device)  # the layout .to() gives
                    self.pacer.copy(out, p.host)
        self._bring_back_before(p)
        return out

    def _bring_back_before(self, p: Parked) -> None:
        """Start the H2D copies of the tensors parked just before ``p`` (the backward's next ones)."""
        s = self._stream
        for q in self._ahead(p):
            if not q.host.is_pinned():
                continue
            with torch.cuda.stream(s):
                s.wait_event(q.event)
                back = torch.empty(q.host.shape, dtype=q.host.dtype, device=q.device)
                if self.pacer is not None:
                    self.pacer.copy(back, q.host)
                else:
                    back.copy_(q.host, non_blocking=True)
                q.back_event = torch.cuda.Event()
                q.back_event.record(s)
            q.back = back

    def _ahead(self, p: Parked) -> list[Parked]:
        """The ``AHEAD`` tensors parked just before ``p`` that are not back yet, nearest first; the ones
        parked after ``p`` are forgotten (unpacked already, or never to be)."""
        order = self._order
        if not 0 <= p.pos < len(order) or order[p.pos]() is not p:
            return []  # parked before the list was last started anew (see _track): nothing known around it
        del order[p.pos:]
        return [q for q in (ref() for ref in reversed(order[-AHEAD:])) if q is not None and q.back is None]
