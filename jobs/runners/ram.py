"""How much host RAM a train or infer job has, and whether its transformer's weights fit in it.

The job's RAM is the smallest of what is set:
- `resources.ram` in the spec (the most this job may hold, RSS)
- `$OFFLOAD_JOBS_RAM_BUDGET` (the same, from the environment: emulates a smaller box in tests and benches)
- what the box can give: this process's RSS now plus `MemAvailable` (/proc/meminfo), or plus the
  headroom under the job's cgroup `memory.max` (a container, a systemd scope) where that is less

`decide_tier` is the decision, a pure function of the numbers: the weights stay in RAM (the engine's
pinned arena or its bounce store) when what the process holds, the weights and a margin fit in the
job's RAM; otherwise they stream from disk. An explicit `offload.lazy_load` is obeyed either way.
`disk_max_memory` sizes the disk tier's pinned bytes from what is left. Stdlib only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from byte_sizes import parse_bytes
from jobs.runners.errors import SetupError

__all__ = ["RAM_BUDGET_ENV", "TIER_RAM", "TIER_DISK", "JobRam", "TierDecision", "job_ram", "ram_margin", "decide_tier",
           "disk_max_memory", "env_ram_budget", "mem_available", "cgroup_headroom"]

RAM_BUDGET_ENV = "OFFLOAD_JOBS_RAM_BUDGET"
TIER_RAM = "ram"  # the engine's PinnedArena or, past the pinned limit, its bounce store
TIER_DISK = "disk"  # the engine's DiskStore over the model cache's shards
# What the job still allocates after the decision: CUDA's lazily loaded kernels, a checkpoint's
# optimizer state copied to the host, the LoRA file, Python's own growth.
MARGIN_MIN = 512 << 20
MARGIN_FRACTION = 1 / 10


@dataclass(frozen=True)
class JobRam:
    bytes: int  # the most RSS the job may reach
    source: str  # what set it: resources.ram, $OFFLOAD_JOBS_RAM_BUDGET, MemAvailable or the cgroup's memory.max


@dataclass(frozen=True)
class TierDecision:
    tier: str  # TIER_RAM or TIER_DISK
    reason: str
    weight_bytes: int
    held_bytes: int
    ram_bytes: int
    margin_bytes: int

    @property
    def available_bytes(self) -> int:
        """What the job's RAM leaves beyond what the process already holds."""
        return self.ram_bytes - self.held_bytes

    @property
    def headroom_bytes(self) -> int:
        """What is left for the weights (or the disk tier's cache) after the margin."""
        return self.ram_bytes - self.held_bytes - self.margin_bytes


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def ram_margin(ram_bytes: int) -> int:
    return max(MARGIN_MIN, int(ram_bytes * MARGIN_FRACTION))


def decide_tier(weight_bytes: int, held_bytes: int, ram_bytes: int, margin_bytes: int,
                lazy_load: bool | None = None) -> TierDecision:
    """RAM or disk for `weight_bytes` of weights, in a process holding `held_bytes` of a job RAM of
    `ram_bytes`, leaving `margin_bytes` free; `lazy_load` is the spec's (None: decide by RAM)."""
    nums = dict(weight_bytes=weight_bytes, held_bytes=held_bytes, ram_bytes=ram_bytes, margin_bytes=margin_bytes)
    need = held_bytes + weight_bytes + margin_bytes
    if lazy_load is True:
        return TierDecision(TIER_DISK, "offload.lazy_load: true", **nums)
    if lazy_load is False:
        why = "offload.lazy_load: false" + (f" (the weights may not fit: {_gib(need)} needed, {_gib(ram_bytes)} "
                                            "of job RAM)" if need > ram_bytes else "")
        return TierDecision(TIER_RAM, why, **nums)
    if need <= ram_bytes:
        return TierDecision(TIER_RAM, f"the weights ({_gib(weight_bytes)}) fit: {_gib(held_bytes)} held + the weights "
                                      f"+ a {_gib(margin_bytes)} margin <= {_gib(ram_bytes)} of job RAM", **nums)
    return TierDecision(TIER_DISK, f"the weights ({_gib(weight_bytes)}) do not fit: {_gib(held_bytes)} held + the "
                                   f"weights + a {_gib(margin_bytes)} margin > {_gib(ram_bytes)} of job RAM", **nums)


def disk_max_memory(headroom_bytes: int, streamed_bytes: int, largest_unit_bytes: int, min_slots: int,
                    want_slots: int) -> int:
    """The disk tier's `max_memory` (its staging slots and its cache) from what the job's RAM leaves:
    at least `min_slots` staging slots (the engine refuses fewer), at most every streamed unit cached
    with `want_slots` staging slots on top (more would sit unused)."""
    floor = min_slots * largest_unit_bytes
    ceiling = streamed_bytes + want_slots * largest_unit_bytes
    return min(max(headroom_bytes, floor), ceiling)


def env_ram_budget(environ: dict[str, str] | None = None) -> int | None:
    """$OFFLOAD_JOBS_RAM_BUDGET in bytes (None: unset); a bad value is a SetupError naming the variable."""
    raw = (os.environ if environ is None else environ).get(RAM_BUDGET_ENV)
    if raw is None or not raw.strip():
        return None
    try:
        return parse_bytes(raw.strip())
    except ValueError as exc:
        raise SetupError(f"{RAM_BUDGET_ENV}: {exc}") from None


def mem_available(meminfo: str = "/proc/meminfo") -> int | None:
    """MemAvailable in bytes (None where the kernel does not say)."""
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cgroup_headroom(root: str = "/sys/fs/cgroup") -> int | None:
    """What this process's cgroup (v2) still allows under memory.max: the limit less what is charged
    and cannot be reclaimed (inactive page cache can); None without a limit."""
    try:
        rel = next((line.split("::", 1)[1].strip() for line in Path("/proc/self/cgroup").read_text().splitlines()
                    if line.startswith("0::")), "/")
        d = Path(root) / rel.lstrip("/")
        limit = (d / "memory.max").read_text().strip()
        if limit == "max":
            return None
        current = int((d / "memory.current").read_text())
        stat = dict(line.split() for line in (d / "memory.stat").read_text().splitlines() if line.count(" ") == 1)
        return max(0, int(limit) - current + int(stat.get("inactive_file", 0)))
    except (OSError, ValueError, StopIteration):
        return None


def job_ram(spec_ram: int | None, held_bytes: int, environ: dict[str, str] | None = None) -> JobRam:
    """The job's RAM (see the module docstring) for a process holding `held_bytes` now."""
    candidates: list[JobRam] = []
    if spec_ram is not None:
        candidates.append(JobRam(spec_ram, "resources.ram"))
    env = env_ram_budget(environ)
    if env is not None:
        candidates.append(JobRam(env, f"${RAM_BUDGET_ENV}"))
    avail = mem_available()
    if avail is not None:
        candidates.append(JobRam(held_bytes + avail, "MemAvailable"))
    cg = cgroup_headroom()
    if cg is not None:
        candidates.append(JobRam(held_bytes + cg, "the cgroup's memory.max"))
    if not candidates:  # no /proc: nothing says the weights do not fit
        return JobRam(1 << 62, "unknown")
    return min(candidates, key=lambda r: r.bytes)
