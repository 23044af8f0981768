"""The target device: which one it is, what it lets this process allocate, and its peak.

``torch.cuda.mem_get_info`` reports the whole card. A process capped with
``torch.cuda.set_per_process_memory_fraction`` may allocate only that fraction of the total, and
torch's allocator enforces the cap on what it has reserved; so the limit is the smaller of the cap
and what this process holds plus what the card still has free. On the CPU there is no such limit
(None): the engine then keeps its ring as configured.
"""

from __future__ import annotations

import torch

from .errors import DeviceUnavailableError

__all__ = ["alloc_retries", "limit_bytes", "peak_bytes", "reset_peak", "resolve_device"]


def resolve_device(target: str | torch.device) -> torch.device:
    try:
        dev = torch.device(target)
    except (RuntimeError, TypeError):
        raise DeviceUnavailableError(f"target_device: {target!r} is not a device name") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailableError(
                f"target_device: {target!r} asked for, but this machine has no CUDA device "
                "(use target_device='cpu' to run the same path on the CPU)"
            )
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise DeviceUnavailableError(f"target_device: {target!r} does not exist ({torch.cuda.device_count()} CUDA devices)")
        return torch.device("cuda", index)
    if dev.type != "cpu":
        raise DeviceUnavailableError(f"target_device: {target!r} is not supported (use 'cuda' or 'cpu')")
    return dev


def _fraction(device: torch.device) -> float:
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if get is None:
        return 1.0
    try:
        return float(get(device))
    except (RuntimeError, TypeError):
        return 1.0


def limit_bytes(device: torch.device) -> int | None:
    """Bytes this process may have allocated on ``device`` at most (None off a card)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    cap = int(_fraction(device) * total)
    return min(cap, torch.cuda.memory_reserved(device) + int(free))


def peak_bytes(device: torch.device) -> int | None:
    """Peak allocated bytes since the last reset_peak (None off a card).

    Read from the allocator's nested statistics: ``max_memory_allocated`` flattens all of them in
    Python first, and the replanner reads this at every use while it decides."""
    if device.type != "cuda":
        return None
    try:
        return int(torch.cuda.memory_stats_as_nested_dict(device)["allocated_bytes"]["all"]["peak"])
    except (KeyError, TypeError):  # not initialized yet: an empty dict
        return int(torch.cuda.max_memory_allocated(device))


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def alloc_retries(device: torch.device) -> int | None:
    """How often torch's allocator has had to free its cache and try again to fit an allocation (None
    off a card): each retry synchronizes the device, so a ring that causes them costs more than it saves."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))
