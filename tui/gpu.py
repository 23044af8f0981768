"""Device totals for the GPU panel: NVML (nvidia-ml-py) where it loads, and the host's RAM.

Inside a container NVML sees host PIDs, so per-job VRAM comes from the job's own metrics; this
panel shows only what each device has in total. With no GPU or no driver it says why.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DeviceInfo", "PanelData", "read_panel"]


@dataclass
class DeviceInfo:
    index: int
    name: str
    used: int
    total: int
    util: int | None = None
    temp: int | None = None
    power_w: float | None = None


@dataclass
class PanelData:
    devices: list[DeviceInfo] = field(default_factory=list)
    no_gpu: str | None = None  # why there is nothing to show
    host_used: int | None = None
    host_total: int | None = None


_lock = threading.Lock()
_nvml: Any = None
_nvml_error: str | None = None


def _init() -> Any:
    global _nvml, _nvml_error
    with _lock:
        if _nvml is None and _nvml_error is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                _nvml = pynvml
            except Exception as exc:  # no library, no driver, no device: all mean "no GPU here"
                _nvml_error = type(exc).__name__.removeprefix("NVMLError_") or str(exc)
        return _nvml


def _safe(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception:
        return None


def read_panel() -> PanelData:
    data = PanelData()
    try:
        import psutil

        vm = psutil.virtual_memory()
        data.host_used, data.host_total = int(vm.total - vm.available), int(vm.total)
    except Exception:
        pass
    nv = _init()
    if nv is None:
        data.no_gpu = f"no GPU (NVML: {_nvml_error})"
        return data
    count = _safe(nv.nvmlDeviceGetCount) or 0
    if not count:
        data.no_gpu = "no GPU (NVML sees no device)"
    for i in range(count):
        h = _safe(nv.nvmlDeviceGetHandleByIndex, i)
        if h is None:
            continue
        mem = _safe(nv.nvmlDeviceGetMemoryInfo, h)
        util = _safe(nv.nvmlDeviceGetUtilizationRates, h)
        name = _safe(nv.nvmlDeviceGetName, h) or f"GPU {i}"
        power = _safe(nv.nvmlDeviceGetPowerUsage, h)
        data.devices.append(DeviceInfo(
            index=i, name=name.decode() if isinstance(name, bytes) else str(name),
            used=int(mem.used) if mem else 0, total=int(mem.total) if mem else 0,
            util=int(util.gpu) if util else None,
            temp=_safe(nv.nvmlDeviceGetTemperature, h, 0),
            power_w=power / 1000 if power else None,
        ))
    return data
