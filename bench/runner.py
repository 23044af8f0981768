"""Run one variant on a fresh copy of a workload's master model and measure it."""

from __future__ import annotations

import copy
import math
import statistics
import time
import traceback
from typing import Any

import torch
from torch import nn

from offload_core.compiled import inductor_cache

from .measure import free_device, host_rss, profile_copies, sync, time_steps
from .models import tensor_bytes
from .peers import TUNE_GRID, NotApplicable, Session, Variant, ours_variant, resident_variant
from .workloads import Workload

__all__ = ["Reference", "run_variant", "run_tuned"]

# Engine counters whose growth over the timed steps is reported per step.
_COUNTERS = ("h2d_bytes", "h2d_count", "d2h_bytes", "stall_ms", "prefetch_misses")
MAX_SETTLE_STEPS = 16  # warm-up steps past --warmup while the engine still chooses its plan


class Reference:
    """What resident produced, for the bit-for-bit comparison."""

    def __init__(self) -> None:
        self.output: torch.Tensor | None = None  # inference: the last timed output
        self.trajectory: torch.Tensor | None = None  # training: the loss of every step


def _step_fn(wl: Workload, sess: Session, inputs: dict[str, torch.Tensor]):
    if not wl.train:

        def infer() -> torch.Tensor:
            with torch.no_grad():
                return wl.forward(sess.model, inputs)

        return infer

    def train() -> torch.Tensor:
        if sess.micro_batches > 1:
            # one optimizer step over K copies of the inputs; the mean of K equal losses is the loss
            k = sess.micro_batches
            losses = sess.accumulate([inputs] * k, lambda b: wl.loss(sess.model, b) / k)
            sess.optimizer.step()
            sess.optimizer.zero_grad(set_to_none=True)
            return torch.stack(losses).sum().detach().clone()
        loss = wl.loss(sess.model, inputs)
        loss.backward()
        if sess.after_backward is not None:
            sess.after_backward()
        sess.optimizer.step()
        sess.optimizer.zero_grad(set_to_none=True)
        # clone: mse_loss's 0-d result keeps its whole elementwise buffer as storage (torch 2.11-2.13),
        # so keeping the loss of every timed step would hold that buffer per step on the device
        return loss.detach().clone()

    return train


def _numeric(stats: dict[str, Any]) -> dict[str, Any]:
    """The JSON-friendly part of an engine stats dict; 'units' is summarized, not copied."""
    out: dict[str, Any] = {}
    for k, v in stats.items():
        if isinstance(v, (bool, int, float, str)) or v is None:
            out[k] = v
    plan = stats.get("plan")
    if isinstance(plan, dict):
        out.update({f"plan_{k}": v for k, v in plan.items() if isinstance(v, (bool, int, float, str))})
    units = stats.get("units")
    if units is not None:
        sizes = _unit_sizes(units)
        out["units_count"] = len(units) if hasattr(units, "__len__") else None
        out["largest_unit_bytes"] = max(sizes) if sizes else None
    return out


def _unit_sizes(units: Any) -> list[int]:
    items = units.values() if isinstance(units, dict) else units
    sizes = []
    for u in items:
        if isinstance(u, (int, float)):
            sizes.append(int(u))
        elif isinstance(u, dict):
            for key in ("bytes", "nbytes", "size_bytes", "weight_bytes"):
                if isinstance(u.get(key), (int, float)):
                    sizes.append(int(u[key]))
                    break
        else:
            for key in ("bytes", "nbytes", "size_bytes"):
                if isinstance(getattr(u, key, None), (int, float)):
                    sizes.append(int(getattr(u, key)))
                    break
    return sizes


def _compare(row: dict[str, Any], wl: Workload, result: torch.Tensor, ref: Reference, variant: Variant) -> None:
    want = ref.trajectory if wl.train else ref.output
    if want is None:
        return
    got = result.float()
    if wl.train and got.shape[1:] == want.shape[1:] and got.shape[0] != want.shape[0]:
        # a variant warmed up longer (until its plan settled): the steps both ran are compared
        n = min(got.shape[0], want.shape[0])
        got, want = got[:n], want[:n]
        row["trajectory_steps_compared"] = n
    if got.shape != want.shape:
        row["bitwise_equal"] = False
        row["max_abs_diff"] = math.inf
        return
    diff = (got - want).abs()
    if wl.train:
        # Step 1 runs on identical weights: its loss must match bit for bit. Later steps also
        # test the optimizer, whose CPU and GPU kernels may round differently.
        row["bitwise_equal"] = bool(torch.equal(got[0], want[0]))
        row["trajectory_bitwise_equal"] = bool(torch.equal(got, want))
        row["max_abs_diff"] = float(diff.max())
        row["max_rel_diff"] = float((diff / want.abs().clamp_min(1e-12)).max())
        return
    row["max_abs_diff"] = float(diff.max())
    row["rel_l2_err"] = float(diff.norm() / want.norm().clamp_min(1e-12))
    if variant.config.get("weight_dtype") == "float8_e4m3fn":
        row["bitwise_equal"] = None  # different weights by design; the error is what counts
    else:
        row["bitwise_equal"] = bool(torch.equal(got, want))


def run_variant(
    wl: Workload,
    master: nn.Module,
    inputs: dict[str, torch.Tensor],
    variant: Variant,
    device: torch.device,
    *,
    warmup: int,
    repeats: int,
    ref: Reference | None,
    profile: bool = True,
    paired: int = 0,
) -> dict[str, Any]:
    row: dict[str, Any] = {"workload": wl.name, "variant": variant.name, "family": variant.family, "config": dict(variant.config)}
    weight_bytes = tensor_bytes(master)
    free_device(device)
    rss0 = host_rss()
    sess: Session | None = None
    model: nn.Module | None = None
    step = None
    started = time.perf_counter()
    capped = _cap(wl, variant, device)
    if capped:
        row["vram_cap_bytes"] = wl.vram_cap_bytes
    try:
        model = copy.deepcopy(master)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        vram0 = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        sync(device)
        t0 = time.perf_counter()
        sess = variant.setup(model, wl, device)
        sync(device)
        row["setup_s"] = time.perf_counter() - t0
        row["setup_s_per_gb"] = row["setup_s"] / (weight_bytes / 1e9)
        row["config"].update({k: v for k, v in sess.config.items() if isinstance(v, (bool, int, float, str)) or v is None})
        if sess.note:
            row["note"] = sess.note
        step = _step_fn(wl, sess, inputs)

        warm_results = []
        if warmup:
            # the first step on its own: a compiled variant compiles in it (how many of inductor's
            # graphs came from its on-disk cache says whether that compile was cold)
            cache0 = inductor_cache()
            t1 = time.perf_counter()
            warm_results.append(step())
            sync(device)
            row["first_step_s"] = time.perf_counter() - t1
            if variant.config.get("compile"):
                row["inductor_cache"] = {k: v - cache0.get(k, 0) for k, v in inductor_cache().items()}
        warm_results += [step() for _ in range(warmup - len(warm_results))]
        # Steady state: an engine still choosing its plan (growth rounds, a retry) is not timed yet.
        while sess.planning is not None and sess.planning() and len(warm_results) < warmup + MAX_SETTLE_STEPS:
            warm_results.append(step())
        row["warmup_steps"] = len(warm_results)
        sync(device)
        stats0 = sess.stats() if sess.stats else None
        timing, results = time_steps(step, device, repeats)
        stats1 = sess.stats() if sess.stats else None

        row["times_ms"] = timing.wall_ms
        row["event_times_ms"] = timing.event_ms
        row["time_ms"] = timing.median_ms
        if device.type == "cuda":
            row["peak_vram_bytes"] = torch.cuda.max_memory_allocated(device)
            row["vram_baseline_bytes"] = vram0
        row["rss_over_weight"] = (host_rss() - rss0) / weight_bytes
        if stats1 is not None:
            row["stats"] = _numeric(stats1)
            # OFFLOAD_LINK_TRACE: the copy stream's busy and idle ms (link.py), per timed step too
            traced = tuple(k for k in stats1 if k.startswith("link_trace_"))
            if stats1.get("link_trace_dropped"):  # the trace filled up: per-step sums would be partial
                row["link_trace_incomplete"] = True
                traced = ()
            for key in _COUNTERS + traced:
                if isinstance(stats1.get(key), (int, float)) and isinstance((stats0 or {}).get(key), (int, float)):
                    row[f"{key}_per_step"] = (stats1[key] - stats0[key]) / repeats
            if isinstance(stats1.get("pinned_capacity_bytes"), (int, float)):
                row["pinned_over_weight"] = stats1["pinned_capacity_bytes"] / weight_bytes
            row["predicted_step_ms"] = stats1.get("predicted_step_ms", row["stats"].get("plan_predicted_step_ms"))
            if isinstance(stats1.get("setup_seconds"), (int, float)):
                # the engine's own pack and pin, without optimizer offload's buffers or the optimizer
                row["pack_s"] = stats1["setup_seconds"]
                row["pack_s_per_gb"] = stats1["setup_seconds"] / (weight_bytes / 1e9)
            row["prefetch_misses_total"] = stats1.get("prefetch_misses")
        if row.get("h2d_bytes_per_step") is not None:
            row["h2d_source"] = "engine"

        if wl.train:
            result = torch.stack([r.float() for r in warm_results + results]).cpu()
        else:
            result = results[-1].float().cpu()
        del warm_results, results
        # every row offers its result as a reference (the caller keeps resident's and resident-compile's)
        ref_new = Reference()
        if wl.train:
            ref_new.trajectory = result
        else:
            ref_new.output = result
        row["_reference"] = ref_new
        if ref is not None:
            _compare(row, wl, result, ref, variant)

        if profile and device.type == "cuda":
            # One extra step under the profiler: the bytes the GPU really copied (after the timed
            # steps, so it costs them nothing), to check the engine's counters and to size peers.
            before = sess.stats() if sess.stats else None
            copies = profile_copies(step, device)
            after = sess.stats() if sess.stats else None
            if copies is not None:
                row["profiler"] = copies
                if before and after and isinstance(after.get("h2d_ms"), (int, float)):
                    # the engine's own counters over exactly the profiled step (its copy time only
                    # when the engine timed that step: a settled engine times one in timing_every)
                    timed = after.get("timed_steps", 1) != before.get("timed_steps", 0)
                    row["profiled_engine"] = {
                        "h2d_bytes": after["h2d_bytes"] - before["h2d_bytes"],
                        "h2d_ms": after.get("timed_h2d_ms", after["h2d_ms"]) - before.get("timed_h2d_ms", before["h2d_ms"])
                        if timed else None,
                    }
                if row.get("h2d_bytes_per_step") is None:
                    row["h2d_bytes_per_step"] = copies["h2d_bytes"]
                    row["d2h_bytes_per_step"] = copies["d2h_bytes"]
                    row["h2d_source"] = "profiler"
        if paired > 0 and variant.family == "ours" and capped:
            row["paired_skipped"] = "resident cannot run under this workload's VRAM cap next to ours"
        elif paired > 0 and variant.family == "ours":
            row["paired"] = _paired(wl, master, inputs, device, step, paired, stats=sess.stats)
        row["status"] = "ok"
    except NotApplicable as e:
        row.update(status="n/a", reason=str(e))
    except Exception as e:  # one broken variant must not stop the others
        row.update(status="error", reason=f"{type(e).__name__}: {e}".strip(), traceback=traceback.format_exc(limit=8))
    finally:
        if sess is not None:
            try:
                sess.teardown()
            except Exception as e:
                row.setdefault("teardown_error", f"{type(e).__name__}: {e}")
        sess = model = step = None  # the step closure holds the session, and so the model
        free_device(device)
        if capped:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        row["wall_s"] = time.perf_counter() - started
        if device.type == "cuda":
            row["vram_after_teardown_bytes"] = torch.cuda.memory_allocated(device)
    return row


def _cap(wl: Workload, variant: Variant, device: torch.device) -> bool:
    """Emulate the workload's smaller card for every variant but resident (which must fit the model)."""
    if not wl.vram_cap_bytes or device.type != "cuda" or variant.family == "resident":
        return False
    free_device(device)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, wl.vram_cap_bytes / total), device)
    return True


def _paired(wl: Workload, master: nn.Module, inputs: dict[str, torch.Tensor], device: torch.device,
            step: Any, rounds: int, stats: Any = None) -> dict[str, Any]:
    """Resident and this variant, one step each in turn: the same moment of the machine for both.

    Slow drifts (clocks, a busy host) move both sides alike, so the ratio of the two medians is
    steadier than a ratio of medians taken minutes apart. Each round also keeps, for ours, the
    host's time to enqueue the step and the engine's stall and H2D bytes over it, so a slow round
    says whether it waited on copies (stall), on the host (enqueue close to wall) or on neither.
    """
    sess = resident_variant().setup(copy.deepcopy(master), wl, device)
    per_round: list[dict[str, float]] = []
    try:
        res_step = _step_fn(wl, sess, inputs)
        res_step()  # the resident copy's own warm-up
        res_ms, ours_ms = [], []
        for _ in range(rounds):
            t, _ = time_steps(res_step, device, 1)
            res_ms.append(t.wall_ms[0])
            rnd = {"resident_ms": t.wall_ms[0], "resident_enqueue_ms": t.enqueue_ms[0]}
            s0 = stats() if stats else None
            t, _ = time_steps(step, device, 1)
            s1 = stats() if stats else None
            ours_ms.append(t.wall_ms[0])
            rnd.update(ours_ms=t.wall_ms[0], ours_enqueue_ms=t.enqueue_ms[0])
            for key in ("stall_ms", "h2d_bytes", "cache_misses"):
                if s0 and s1 and isinstance(s1.get(key), (int, float)) and isinstance(s0.get(key), (int, float)):
                    rnd[f"ours_{key}"] = s1[key] - s0[key]
            per_round.append(rnd)
    finally:
        sess.teardown()
        sess = None
    med_res, med_ours = statistics.median(res_ms), statistics.median(ours_ms)
    return {"rounds": rounds, "resident_ms": res_ms, "ours_ms": ours_ms, "resident_median_ms": med_res,
            "ours_median_ms": med_ours, "x_resident": med_ours / med_res,
            "x_resident_per_round_median": statistics.median(o / r for o, r in zip(ours_ms, res_ms)),
            "per_round": per_round}


def run_tuned(
    wl: Workload,
    master: nn.Module,
    inputs: dict[str, torch.Tensor],
    device: torch.device,
    *,
    warmup: int,
    repeats: int,
    ref: Reference | None,
    log: Any = print,
    paired: int = 0,
) -> dict[str, Any]:
    """Sweep prefetch x granularity quickly, then measure the best setting in full as 'ours-tuned'."""
    sweep = []
    quick = max(2, repeats // 2)
    for cfg in TUNE_GRID:
        label = f"pf{cfg['prefetch']}/{cfg['offload_granularity']}"
        r = run_variant(wl, master, inputs, ours_variant("ours-sweep", **cfg), device, warmup=warmup, repeats=quick, ref=ref, profile=False)
        sweep.append({"config": label, "status": r["status"], "time_ms": r.get("time_ms"), "reason": r.get("reason")})
        log(f"    sweep {label}: " + (f"{r['time_ms']:.2f} ms" if r["status"] == "ok" else r.get("reason", r["status"])))
    ok = [(s["time_ms"], cfg) for s, cfg in zip(sweep, TUNE_GRID) if s["status"] == "ok"]
    if not ok:
        return {"workload": wl.name, "variant": "ours-tuned", "family": "ours", "status": "error",
                "reason": "every sweep setting failed: " + (sweep[0].get("reason") or ""), "sweep": sweep, "config": {}}
    ranked = [cfg for _, cfg in sorted(ok, key=lambda t: t[0])]
    failed = []
    for cfg in ranked[:2]:  # a failure of the full run is reported, and the runner-up measured instead
        row = run_variant(wl, master, inputs, ours_variant("ours-tuned", **cfg), device, warmup=warmup, repeats=repeats,
                          ref=ref, paired=paired)
        if row["status"] == "ok":
            break
        failed.append({"config": cfg, "reason": row.get("reason")})
    row["sweep"] = sweep
    if failed:
        row["failed_full_runs"] = failed
    return row
