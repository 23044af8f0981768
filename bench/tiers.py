"""Link tiers (``--link-gbps 13,25,50,real``): our engine again at emulated slower links, each tier
judged against its own floor.

How a tier is emulated: the engine's ``debug_link_gbps`` (offload_core/link.py). After each H2D
copy our engine queues, a spin kernel holds the copy stream for the time the slower link would have
needed on top (``nbytes / asked - nbytes / real``, the real rate measured once per process). So the
unit's ready event, the next copy, a bounce buffer's reuse and the copy-rate timing all see the
slower link, and the planner plans for it. Not modelled: D2H copies (real rate), the host side
(fills, launches), per-transfer latency.

- Only our engine's copies are paced: the peers' rows are n/a at an emulated tier, and so are
  ``ours-tuned`` (its own sweep) and ``ours-seed`` (the seed's call, which takes no option).
- Resident crosses no link: it runs once per workload and its row stands in every tier.
- Each tier's floor is max(resident, bytes that must cross / the tier's rate), the rate being the
  asked one (or the paced copies' own, where they ran faster); the real tier keeps the probe's.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from .floor import derive
from .peers import NotApplicable, Variant, ours_variant, registration_fails

__all__ = ["TIER_TARGET", "at_tier", "derive_tiers", "parse_link_gbps", "tier_label", "tier_row"]

# issue 29: at the engine's defaults, every row of every tier <= 1.05x its own floor
TIER_TARGET = 1.05
TIER_TARGETS = {("p1", "ours"), ("flux-dev-lora-8g", "ours")}


def parse_link_gbps(text: str) -> list[float | None]:
    """``"13,25,50,real"`` -> [13.0, 25.0, 50.0, None]; a ValueError names the bad item."""
    tiers: list[float | None] = []
    for item in (t.strip().lower() for t in text.split(",")):
        if not item:
            continue
        if item == "real":
            g = None
        else:
            try:
                g = float(item)
            except ValueError:
                raise ValueError(f"--link-gbps: {item!r} is neither a rate in GB/s nor 'real'") from None
            if not math.isfinite(g) or g <= 0:
                raise ValueError(f"--link-gbps: {item!r} must be a rate in GB/s above 0")
        if g in tiers:
            raise ValueError(f"--link-gbps: {item!r} is given twice")
        tiers.append(g)
    if not tiers:
        raise ValueError("--link-gbps: no tier given (e.g. 13,25,50,real)")
    return tiers


def tier_label(gbps: float | None) -> str:
    return "real" if gbps is None else f"{gbps:g} GB/s"


def at_tier(variant: Variant, gbps: float | None) -> Variant:
    """The variant paced at ``gbps`` (None: as it is); NotApplicable where only a real link makes sense."""
    if gbps is None:
        return variant
    if variant.family != "ours":
        raise NotApplicable(f"only our engine's copies are paced at an emulated link ({tier_label(gbps)})")
    if variant.name == "ours-tuned" or variant.config.get("as_written"):
        raise NotApplicable(f"{variant.name} takes no engine option: run at the real link only")
    cfg = {k: v for k, v in variant.config.items() if k != "registration"}
    paced = ours_variant(variant.name, **cfg, debug_link_gbps=gbps)
    # a host whose registration fails stays one at every tier (the key is the bench's, not an engine option)
    return registration_fails(paced) if "registration" in variant.config else paced


def tier_row(row: dict[str, Any], gbps: float | None) -> dict[str, Any]:
    """``row`` tagged with its tier (a copy: a resident row stands in every tier)."""
    out = copy.deepcopy(row)
    out["tier"] = tier_label(gbps)
    out["link_gbps"] = gbps
    return out


def derive_tiers(rows: list[dict[str, Any]], metas: dict[str, dict[str, Any]], ceiling: dict[str, Any],
                 tiers: list[float | None]) -> list[dict[str, Any]]:
    """Floors and ratios per tier, in place in the rows; returns each tier's floors and rate.

    The real tier derives into ``metas`` and ``ceiling`` themselves (the header's); an emulated one
    into copies."""
    out = []
    for g in tiers:
        label = tier_label(g)
        mine = [r for r in rows if r.get("tier") == label]
        t_metas = metas if g is None else copy.deepcopy(metas)
        t_ceiling = ceiling if g is None else {k: v for k, v in ceiling.items() if not k.startswith("floor_")}
        derive(mine, t_metas, t_ceiling, link_gbps=g)
        for r in mine:
            if r.get("status") == "ok" and (r["workload"], r["variant"]) in TIER_TARGETS:
                r["target_x_floor"] = TIER_TARGET
                r["meets_target"] = r["x_floor"] is not None and r["x_floor"] <= TIER_TARGET
        ours = [r["stats"] for r in mine if r.get("family") == "ours" and r.get("status") == "ok" and r.get("stats")]
        paced = [st["h2d_gbps"] for st in ours if st.get("h2d_gbps")]
        real = [st["link_real_gbps"] for st in ours if st.get("link_real_gbps")]
        out.append({"tier": label, "link_gbps": g, "floor_h2d_gbps": t_ceiling["floor_h2d_gbps"],
                    "floor_rate": t_ceiling["floor_rate"], "workloads": t_metas,
                    # what the engine measured: its copies' rate, and (paced) its probe of the real link
                    "engine_h2d_gbps": [min(paced), max(paced)] if paced else None,
                    "engine_real_link_gbps": max(real) if real else None})
    return out
