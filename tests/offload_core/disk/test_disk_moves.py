"""A used unit's bytes copied from its staging slot into the RAM cache (a move) instead of read again:
a move whose copy fails costs a read from disk, never a dead worker or a hung acquire. CPU."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from offload_core.shard import shard_checkpoint
from offload_core_disk_helpers import flux_inputs, offload_flux_lora, tiny_flux


@pytest.fixture(scope="module")
def flux_shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("moves")
    tiny_flux(num_layers=4, num_single_layers=8, attention_head_dim=16, num_attention_heads=4).save_pretrained(root / "src")
    shard_checkpoint(root / "src", root / "shards", progress=False)
    return root / "src", root / "shards"


def _train(src: Path, shards: Path, break_moves: bool, steps: int = 5) -> tuple[list[float], dict[str, Any]]:
    """LoRA steps with checkpointing from shards through a cache under half the streamed bytes (the
    read-ahead makes moves here: 3 in 5 steps when this was written); in a thread, so a hang fails."""
    model, handle = offload_flux_lora(src, shards)
    core = handle.engine.store._core
    tried: list[int] = []
    if break_moves:
        def broken(dest: torch.Tensor, src_: torch.Tensor) -> None:
            tried.append(1)
            raise RuntimeError("injected: host copy failed")
        core._move_copy = broken
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses: list[float] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            for _ in range(steps):
                loss = model(**flux_inputs(), return_dict=False)[0].pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            failure.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "the training hung on a unit whose move failed"
    assert not failure, failure
    stats = dict(handle.stats(), move_errors=core.move_errors, tried=len(tried))
    handle.remove()
    return losses, stats


def test_a_failed_move_reads_the_unit_again_and_the_losses_do_not_change(
        flux_shards: tuple[Path, Path], caplog: pytest.LogCaptureFixture) -> None:
    src, shards = flux_shards
    good, ok = _train(src, shards, break_moves=False)
    assert ok["disk_cache_moves"] > 0 and ok["move_errors"] == 0  # the setup makes moves at all
    with caplog.at_level(logging.WARNING, logger="offload_core.disk.diskstore"):
        bad, failed = _train(src, shards, break_moves=True)
    assert failed["tried"] > 0 and failed["move_errors"] == failed["tried"]
    assert failed["disk_cache_moves"] == 0 and failed["disk_cache_moved_bytes"] == 0
    assert bad == good  # bitwise: the units whose moves failed came from disk again, unchanged
    assert failed["disk_bytes"] > ok["disk_bytes"]  # ... at the cost of their reads
    warned = [r.getMessage() for r in caplog.records if "into the RAM cache failed" in r.getMessage()]
    assert len(warned) == 1 and "injected: host copy failed" in warned[0]  # once, naming the unit and the cause
