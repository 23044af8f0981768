"""Each unit is checked once per process by default (xxh3 from the index, on its first read);
disk_verify keeps the sha256 on every read; a same-size change to a shard is a named ShardError."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from offload_core import enable_offload
from offload_core.disk import checksum
from offload_core.disk.errors import ShardChecksumError
from offload_core.disk.format import INDEX_NAME, load_index
from offload_core_disk_helpers import block_units, one_pass, open_store, sharded_stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Any]:
    return sharded_stack(tmp_path_factory.mktemp("stack"), n=8)


@pytest.fixture(autouse=True)
def fresh_process_state() -> None:
    checksum.forget_all()  # each test reads as a new process would


def _copy(tmp_path: Path, stack: tuple) -> tuple[Any, list, Any]:
    model, plan, index = stack
    shutil.copytree(index.root, tmp_path / "shards")
    return model, block_units(plan), load_index(tmp_path / "shards")


def _scale_one_tensor(index: Any, unit: str, factor: float = 100.0) -> Path:
    """One tensor of a unit multiplied in place: the file keeps its size (what the probe did)."""
    entry = index.units[unit]
    t = entry.tensors[0]
    path = index.root / entry.file
    raw = bytearray(path.read_bytes())
    start = entry.offset + t.offset
    x = torch.frombuffer(bytearray(raw[start:start + t.nbytes]), dtype=t.dtype) * factor
    raw[start:start + t.nbytes] = x.view(torch.uint8).numpy().tobytes()
    size = path.stat().st_size
    path.write_bytes(bytes(raw))
    assert path.stat().st_size == size
    return path


def test_the_index_carries_a_fast_checksum_per_unit(stack: tuple) -> None:
    _, _, index = stack
    assert index.slabs() and all(len(e.xxh3) == 16 for e in index.slabs())


def test_each_unit_is_checked_on_its_first_read_only(stack: tuple) -> None:
    model, plan, index = stack
    units = block_units(plan)
    store = open_store(model, units, index, 0.0, num_disk_workers=1)  # no cache: every use is a read
    try:
        store.follow_trace([u.uid for u in units])
        for _ in range(3):
            one_pass(store, units)
        s = store.stats()
        assert s["disk_reads"] >= 3 * len(units)
        assert s["disk_first_read_checks"] == len(units)
        assert s["disk_sha256_checks"] == 0
    finally:
        store.close()


def test_disk_verify_checks_the_sha256_on_every_read(stack: tuple) -> None:
    model, plan, index = stack
    units = block_units(plan)
    store = open_store(model, units, index, 0.0, num_disk_workers=1, verify=True)
    try:
        store.follow_trace([u.uid for u in units])
        for _ in range(3):
            one_pass(store, units)
        s = store.stats()
        assert s["disk_sha256_checks"] == s["disk_reads"] >= 3 * len(units)
    finally:
        store.close()


def test_a_same_size_change_is_a_named_error_by_default(tmp_path: Path, stack: tuple) -> None:
    model, units, index = _copy(tmp_path, stack)
    bad = _scale_one_tensor(index, units[3].name)
    store = open_store(model, units, index, 0.0)
    try:
        store.follow_trace([u.uid for u in units])
        with pytest.raises(ShardChecksumError) as info:
            one_pass(store, units)
        assert str(info.value).startswith(f"{bad}: unit {units[3].name} does not match its xxh3_64")
    finally:
        store.close()


def test_a_change_after_the_first_check_is_caught_on_the_next_read(tmp_path: Path, stack: tuple) -> None:
    """Checked once per process, but per version of the file: a write in between changes its ctime."""
    model, units, index = _copy(tmp_path, stack)
    store = open_store(model, units, index, 0.0, num_disk_workers=1)
    try:
        store.follow_trace([u.uid for u in units])
        one_pass(store, units)
        bad = _scale_one_tensor(index, units[5].name)
        with pytest.raises(ShardChecksumError, match=f"^{bad}: unit {units[5].name}"):
            one_pass(store, units)
            one_pass(store, units)
    finally:
        store.close()


def test_an_index_without_the_fast_checksum_falls_back_to_the_sha256_once(tmp_path: Path, stack: tuple) -> None:
    """An index written before xxh3 still loads; its units are checked by their sha256, once."""
    model, units, index = _copy(tmp_path, stack)
    data = json.loads((index.root / INDEX_NAME).read_text())
    for u in data["units"].values():
        u.pop("xxh3")
    if data.get("resident"):
        data["resident"].pop("xxh3", None)
    (index.root / INDEX_NAME).write_text(json.dumps(data))
    old = load_index(index.root)
    assert not any(e.xxh3 for e in old.slabs())
    store = open_store(model, units, old, 0.0, num_disk_workers=1)
    try:
        store.follow_trace([u.uid for u in units])
        one_pass(store, units)
        one_pass(store, units)
        assert store.stats()["disk_first_read_checks"] == len(units)
    finally:
        store.close()
    checksum.forget_all()
    bad = _scale_one_tensor(old, units[1].name)
    store = open_store(model, units, old, 0.0)
    try:
        store.follow_trace([u.uid for u in units])
        with pytest.raises(ShardChecksumError, match=f"^{bad}: unit {units[1].name} does not match its sha256"):
            one_pass(store, units)
    finally:
        store.close()


def test_the_engine_refuses_a_changed_shard_by_default(tmp_path: Path) -> None:
    """enable_offload(lazy_load=True) with the default disk_verify: the forward fails naming the file
    (before: it ran on the x100 weights and returned different numbers)."""
    from offload_core_disk_helpers import Stack

    torch.manual_seed(0)
    ref = Stack(8, 32).requires_grad_(False)
    from offload_core.units import discover_units
    from offload_core.disk.write import shard_model

    plan = discover_units(ref, "block")
    shard_model(ref, plan.units, tmp_path / "shards", plan.block_lists)
    index = load_index(tmp_path / "shards")
    bad = _scale_one_tensor(index, "blocks.4")
    torch.manual_seed(0)
    model = Stack(8, 32).requires_grad_(False)
    enable_offload(model, target_device="cpu", lazy_load=True, shard_dir=str(tmp_path / "shards"), max_memory=0,
                   offload_granularity="block")
    with pytest.raises(ShardChecksumError, match=f"^{bad}: unit blocks.4"):
        with torch.no_grad():
            model(torch.randn(2, 32))


def test_a_single_tensor_read_checks_its_whole_slab_first(tmp_path: Path, stack: tuple) -> None:
    """materialize() and view() read one tensor at a time: the slab it lies in is checked first (once)."""
    from offload_core.disk.read import UnitReader

    _, units, index = _copy(tmp_path, stack)
    entry = index.units[units[2].name]
    good = UnitReader(index)
    assert good.read_tensor(entry, entry.tensors[-1]).numel() > 0 and good.first_checks == 1
    good.read_tensor(entry, entry.tensors[0])
    assert good.first_checks == 1  # once per slab
    checksum.forget_all()
    bad = _scale_one_tensor(index, units[2].name)  # tensors[0]; the read below asks for another one
    with pytest.raises(ShardChecksumError, match=f"^{bad}: unit {units[2].name}"):
        UnitReader(index).read_tensor(entry, entry.tensors[-1])
