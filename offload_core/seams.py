"""The engine as each of its collaborators sees it: one narrow Protocol per collaborator.

``Binder``, ``Masters``, ``Replanner`` and ``OptimizerOffload`` are built by the engine and call
back into it, but each touches only a few of its parts. Each Protocol below lists exactly those,
so a reader sees what a collaborator may reach, and a test checks that they reach no further
(tests/offload_core/test_seams.py). ``OffloadEngine`` satisfies all four.

The parts' types come in under ``TYPE_CHECKING`` only: this module imports nothing of the engine
at run time, so every collaborator can import it without a cycle.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch import nn

    from .binding import Binder
    from .config import OffloadConfig
    from .hoststore import HostStore
    from .lockstep import Lockstep
    from .masters import Masters
    from .parking import Parking
    from .quant import UnitWidener
    from .schedule import Schedule
    from .slots import Slot, SlotRing
    from .stats import Counters, TimingLog
    from .transfer import Transfer
    from .units import Unit

__all__ = ["BinderHost", "MastersHost", "ReplanHost", "OptimizerHost"]


@runtime_checkable
class BinderHost(Protocol):
    """What ``Binder`` (binding.py) reaches: the device and model, a unit's slot, and the write-back path."""

    device: torch.device
    model: nn.Module
    treat_as_inference: bool
    units: list[Unit]
    lock: threading.RLock
    counters: Counters
    ring: SlotRing
    store: HostStore
    transfer: Transfer
    masters: Masters
    lockstep: Lockstep | None
    parking: Parking | None  # park_saved_tensors: saved activations held in host memory (parking.py)

    def use(self, u: Unit, backward: bool = False) -> Slot: ...

    def delay(self) -> None: ...


@runtime_checkable
class MastersHost(Protocol):
    """What ``Masters`` (masters.py) reaches: the streamed units, their host store and device copies."""

    model: nn.Module
    units: list[Unit]
    streamed: list[Unit]
    store: HostStore
    transfer: Transfer
    widener: UnitWidener
    binder: Binder

    def in_use(self, uid: int) -> bool: ...

    def invalidate(self, uid: int) -> None: ...


@runtime_checkable
class ReplanHost(Protocol):
    """What ``Replanner`` (replan.py) reaches: the measurements, the ring and schedule it resizes."""

    config: OffloadConfig
    device: torch.device
    units: list[Unit]
    streamed: list[Unit]
    counters: Counters
    timing: TimingLog | None
    ring: SlotRing
    schedule: Schedule
    prediction: dict[str, Any]
    widener: UnitWidener

    def resident_device_bytes(self) -> int: ...

    def kept_units(self) -> frozenset[int]: ...

    def keep_cost(self, uid: int) -> int: ...

    def keep_unit(self, uid: int) -> None: ...

    def unkeep_unit(self, uid: int) -> None: ...

    def bound_uids(self) -> set[int]: ...

    def resize_ring(self, n: int, keep: Iterable[int] = ()) -> None: ...

    def in_call(self) -> bool: ...

    def synchronize(self) -> None: ...

    def refill(self) -> None: ...


@runtime_checkable
class OptimizerHost(Protocol):
    """What ``OptimizerOffload`` (optim_offload.py) reaches: the trainable streamed tensors' masters,
    the gradient copies, and the start of each step."""

    config: OffloadConfig
    model: nn.Module
    is_cuda: bool
    streamed: list[Unit]
    store: HostStore
    transfer: Transfer
    binder: Binder
    masters: Masters

    def invalidate(self, uid: int) -> None: ...

    def add_cycle_callback(self, cb: Callable[[], None]) -> None: ...

    def remove_cycle_callback(self, cb: Callable[[], None]) -> None: ...
