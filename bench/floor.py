"""The floor each row is judged against, the acceptance targets, and the derived ratios.

floor = max(resident time, bytes that must cross PCIe / measured pinned H2D rate), the rate being
the pinned-copy probe's, or our engine's own copy rate in the same run where that was faster. At an
emulated link tier (``--link-gbps``) the asked rate stands in for the probe's.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .models import tensor_bytes
from .workloads import Workload

__all__ = ["TARGETS", "derive", "workload_meta"]

# Acceptance targets (issues 3 and 9), as ratios to the row's floor (for our rows: their own floor,
# the bytes that configuration streams; it is never above the workload floor, so never easier).
TARGETS: dict[tuple[str, str], float] = {
    ("p1", "ours"): 1.03,  # issue 9: "P1 still <= 1.03x" at the defaults
    ("p1", "ours-tuned"): 1.05,
    ("p1", "ours-budget50"): 1.05,
    ("p1", "ours-fp8"): 0.60,  # against the bf16 floor of the bytes it streams
    ("p2", "ours"): 1.05,  # issue 9: the defaults
    ("p2", "ours-tuned"): 1.10,
    ("p3", "ours-seed"): 2.0,  # issue 9: the seed's toy unchanged
    ("p3", "ours"): 2.0,
    ("p3", "ours-tuned"): 2.0,
    ("flux-dev-lora-8g", "ours"): 1.08,  # issue 9: the defaults, under an 8 GiB cap
    ("flux-dev-infer-8g", "ours-fp8"): 0.55,  # issue 30: fp8 inference against the bf16 copy floor
}
# vram_budget rows: peak allocated VRAM must stay within the budget times this.
BUDGET_SLACK = 1.01


def _largest(modules: list[nn.Module]) -> int:
    return max((tensor_bytes(m) for m in modules), default=0)


def workload_meta(wl: Workload, master: nn.Module) -> dict[str, Any]:
    blocks = [b for m in master.modules() if isinstance(m, nn.ModuleList) for b in m]
    leaves = [m for m in master.modules() if not list(m.children()) and any(True for _ in m.parameters(recurse=False))]
    return {
        "title": wl.title,
        "train": wl.train,
        "weight_bytes": tensor_bytes(master),
        "streamed_bytes": wl.streamed_bytes(master),
        "h2d_crossings": wl.h2d_crossings,
        "d2h_crossings": wl.d2h_crossings,
        "must_cross_bytes": wl.must_cross_bytes(master),
        "floor_note": wl.floor_note,
        "largest_block_bytes": _largest(blocks),
        "largest_leaf_bytes": _largest(leaves),
        **wl.info,
    }


def _ms(nbytes: float, gbps: float) -> float:
    return nbytes / (gbps * 1e9) * 1e3


def derive(rows: list[dict[str, Any]], metas: dict[str, dict[str, Any]], ceiling: dict[str, Any],
           link_gbps: float | None = None) -> None:
    """Fill floor_ms, x_resident, x_floor, target and the VRAM bound into rows and metas, in place.

    The copy rate of the floors is the probe's, unless our engine's own copies (timed per copy,
    within 0.5% of torch.profiler) ran faster in the same run: a probe that read low would lift
    every floor and flatter every ratio (on 2026-12-01 one read 49.3 GB/s while the engine copied at
    54.7, and P1 looked like 0.93x). The rate used is in ``ceiling["floor_h2d_gbps"]``.

    ``link_gbps`` (an emulated link tier, ``--link-gbps``): the asked rate takes the probe's place,
    with the same rule: paced copies that ran faster than asked set the floor instead.
    """
    if link_gbps is not None:
        probe, source = float(link_gbps), "the emulated link's asked rate"
        ceiling["link_gbps"] = probe
    else:
        probe, source = ceiling.setdefault("probe_h2d_gbps", ceiling["h2d_gbps"]), "the probe"
    engine = [r["stats"]["h2d_gbps"] for r in rows
              if r.get("family") == "ours" and r.get("status") == "ok"
              and isinstance((r.get("stats") or {}).get("h2d_gbps"), (int, float))]
    gbps = max([probe] + [g for g in engine if g > 0])
    ceiling["floor_h2d_gbps"] = gbps
    ceiling["floor_rate"] = source if gbps == probe else f"our engine's copies (faster than {source})"
    for name, meta in metas.items():
        res = next((r for r in rows if r["workload"] == name and r["variant"] == "resident" and r.get("status") == "ok"), None)
        meta["resident_ms"] = res["time_ms"] if res else None
        meta["bytes_ms"] = _ms(meta["must_cross_bytes"], gbps)
        meta["floor_ms"] = max(meta["bytes_ms"], meta["resident_ms"] or 0.0)
        if name == "p3" and ceiling.get("bidir_gbps"):
            # Not used for ratios: the forward H2D alone, then the backward H2D overlapping the grad D2H.
            w = meta["streamed_bytes"]
            meta["floor_optimistic_ms"] = max(meta["resident_ms"] or 0.0, _ms(w, gbps) + _ms(2 * w, ceiling["bidir_gbps"]))
        if res and res.get("peak_vram_bytes") is not None:
            meta["activation_bytes"] = res["peak_vram_bytes"] - res.get("vram_baseline_bytes", 0) - meta["weight_bytes"]

    for r in rows:
        meta = metas[r["workload"]]
        if r.get("status") != "ok":
            continue
        floor = meta["floor_ms"]
        bytes_ms = meta["bytes_ms"]
        basis = "workload floor"
        streamed = (r.get("stats") or {}).get("streamed_bytes")
        if r.get("family") == "ours" and isinstance(streamed, (int, float)):
            # Judged against what this configuration must move: its streamed bytes (in the compute
            # dtype, so fp8 is held to the bf16 floor) times the crossings. Resident strays and
            # sticky units lower it; never higher than the workload floor.
            crossings = meta["h2d_crossings"] + meta["d2h_crossings"]
            own = min(streamed * crossings, meta["must_cross_bytes"])
            bytes_ms = _ms(own, gbps)
            floor = max(meta["resident_ms"] or 0.0, bytes_ms)
            basis = "own floor: streamed bytes x crossings"
            if r.get("config", {}).get("weight_dtype") == "float8_e4m3fn":
                basis = "own bf16 floor: streamed bytes (bf16) x crossings"
        r["floor_ms"] = floor
        r["floor_basis"] = basis
        r["x_floor"] = r["time_ms"] / floor if floor else None
        r["x_workload_floor"] = r["time_ms"] / meta["floor_ms"] if meta.get("floor_ms") else None
        r["x_resident"] = r["time_ms"] / meta["resident_ms"] if meta.get("resident_ms") else None
        pr = r.get("paired")
        if pr:
            # the same floor, with the resident time taken in turn with ours (see runner._paired)
            r["floor_paired_ms"] = max(pr["resident_median_ms"], bytes_ms)
            r["x_floor_paired"] = pr["ours_median_ms"] / r["floor_paired_ms"]
        target = TARGETS.get((r["workload"], r["variant"]))
        if target is not None:
            r["target_x_floor"] = target
            r["meets_target"] = r["x_floor"] is not None and r["x_floor"] <= target
        budget = (r.get("config") or {}).get("vram_budget")
        if isinstance(budget, (int, float)) and not isinstance(budget, bool) and r.get("peak_vram_bytes") is not None:
            # process-wide peak allocated against the budget (the engine's budget counts activations too)
            r["peak_over_budget"] = r["peak_vram_bytes"] / budget
            r["within_budget"] = r["peak_over_budget"] <= BUDGET_SLACK
        _vram_bound(r, meta)


def _vram_bound(r: dict[str, Any], meta: dict[str, Any]) -> None:
    """P1: peak VRAM <= (prefetch + 1) x the largest unit + what stays resident + activations."""
    if r["workload"] != "p1" or r.get("family") != "ours" or r.get("peak_vram_bytes") is None:
        return
    act = meta.get("activation_bytes")
    if act is None:
        return
    largest = (r.get("stats") or {}).get("slot_bytes")  # the largest unit that moves
    if not isinstance(largest, (int, float)):
        gran = r.get("config", {}).get("offload_granularity", "block")
        largest = meta["largest_leaf_bytes"] if gran == "leaf" else meta["largest_block_bytes"]
    slots = (r.get("stats") or {}).get("slot_count")  # the ring as it ended (grown into free VRAM, or pinned)
    prefetch = int(slots) - 1 if isinstance(slots, (int, float)) else int(r.get("config", {}).get("prefetch") or 2)
    resident = (r.get("stats") or {}).get("resident_bytes") or 0
    budget = r.get("config", {}).get("vram_budget")
    if isinstance(budget, (int, float)):
        # the budget bounds the whole peak, activations included
        bound, basis = budget * BUDGET_SLACK, "vram_budget x 1.01 (activations included)"
    else:
        staging = (r.get("stats") or {}).get("staging_bytes") or 0
        bound = (prefetch + 1) * largest + resident + staging + act
        basis = "ring slots x largest unit + resident + activations"
        if staging:
            basis = basis.replace(" + activations", " + 2 fp8 staging buffers + activations")
    peak = r["peak_vram_bytes"] - r.get("vram_baseline_bytes", 0)
    r["vram_bound_bytes"] = bound
    r["vram_bound_basis"] = basis
    r["vram_within_bound"] = peak <= bound
