"""Disk bytes of a LoRA step with gradient checkpointing (a forward, then the backward's recompute in
reverse) from shards through a cache under half the streamed bytes, against Belady's floor. CPU."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from offload_core.disk.format import load_index
from offload_core.shard import shard_checkpoint
from offload_core_disk_helpers import flux_inputs, offload_flux_lora, tiny_flux

# Flux-dev's shape, small: 19 double blocks and 38 single ones, 2.4x smaller each
FLUX_LIKE = dict(num_layers=19, num_single_layers=38, attention_head_dim=16, num_attention_heads=4)


def belady_floor(uses: list[int], size: dict[int, int], nbytes: dict[int, int], capacity: int) -> int:
    """Bytes a third repetition of ``uses`` reads under Belady with bypass, counting bytes, not runs: a
    missed unit is kept when dropping units used later than its next use makes room (``size``: as cached)."""
    seq = uses * 3
    nxt, last = [math.inf] * len(seq), {}
    for i in range(len(seq) - 1, -1, -1):
        nxt[i], last[seq[i]] = last.get(seq[i], math.inf), i
    cache: dict[int, float] = {}
    read = 0
    for i, uid in enumerate(seq):
        if uid in cache:
            cache[uid] = nxt[i]
            continue
        read += nbytes[uid] if i >= 2 * len(uses) else 0
        free = capacity - sum(size[v] for v in cache)
        victims = sorted((v for v in cache if cache[v] > nxt[i]), key=lambda v: -cache[v])
        if free + sum(size[v] for v in victims) < size[uid]:
            continue
        for v in victims:
            if free >= size[uid]:
                break
            free += size[v]
            del cache[v]
        cache[uid] = nxt[i]
    return read


@pytest.fixture(scope="module")
def flux_shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("fwdbwd")
    tiny_flux(**FLUX_LIKE).save_pretrained(root / "src")
    shard_checkpoint(root / "src", root / "shards", progress=False)
    return root / "src", root / "shards"


# timing-sensitive before the cache planned (admission decided at the read, on the disk workers' threads: a
# whole run settled at 1.086-1.096x under the parallel part's load, 1.04-1.06x alone); with the plan, 0.998x
# alone and 1.012x beside three busy loops on two cores. It stays in the serial part.
@pytest.mark.serial
def test_a_checkpointed_lora_step_reads_what_belady_must(flux_shards: tuple[Path, Path]) -> None:
    """With Belady on forward-then-reverse the cache serves its bytes in both passes. Read-ahead decided
    admission far ahead of the use (into staging slots, let go after it), first fit left runs too
    short for a double block, and the uses the engine serves itself at the turns kept room: it read 8-14%
    over that floor; then 1.04-1.10x, the reads made far ahead choosing among fewer idle units than a
    decision at the use does. The cache now follows a plan made by replaying the cycle: 1.00-1.01x."""
    src, dst = flux_shards
    model, handle = offload_flux_lora(src, dst)
    index = load_index(dst)
    blocks = [n for n in index.units if "blocks." in n]
    store = handle.engine.store
    uses: list[int] = []
    acquire = store.acquire

    def recorded(uid: int, *, block: bool = True) -> torch.Tensor | None:
        got = acquire(uid, block=block)
        if got is not None:
            uses.append(uid)
        return got

    store.acquire = recorded
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model.train()
    read = []
    for _ in range(10):  # the first step traces, the next ones settle
        uses.clear()
        before = handle.stats()["disk_bytes"]
        model(**flux_inputs(), return_dict=False)[0].pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        read.append(handle.stats()["disk_bytes"] - before)
    entries = {u: store._core.units[u].entry for u in set(uses)}
    capacity = handle.stats()["disk_cache_capacity_bytes"]
    floor = belady_floor(uses, {u: e.read_nbytes for u, e in entries.items()},
                         {u: e.nbytes for u, e in entries.items()}, capacity)
    streamed = sum(index.units[n].nbytes for n in blocks)
    assert 0.4 < capacity / streamed < 0.5 and floor < 2 * streamed - 2 * capacity  # the turns' own units
    # read-ahead runs on worker threads: steps differ by a unit or two, more on a loaded box (one mean of
    # the last four read 1.093x under CI's parallel tests); the median of the last five steps
    settled = sorted(read[-5:])[2]
    print(f"settled {settled / floor:.3f}x the floor")
    assert settled <= 1.03 * floor, (read, floor)  # 1.10x, then 1.04-1.10x before the plan; 0.998-1.012x with it
    assert handle.stats()["disk_cache_planned"] > 0
    handle.remove()
