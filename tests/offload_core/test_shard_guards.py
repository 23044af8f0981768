"""`offload-jobs shard SRC DIR` on someone else's folder and on hostile safetensors headers.

The destination: a non-empty folder it did not write is refused (unless overwrite), and the
user's own `*.tmp` files are never deleted. Headers: negative, reversed, overlapping or
out-of-file `data_offsets` are a named error naming the file and the tensor, in every place the
project parses a safetensors header itself (the shard source reader and the LoRA header reader).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from offload_core.disk.errors import ShardWriteError
from offload_core.errors import ShardError
from offload_core.shard import shard_checkpoint, verify_shards

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small single-file checkpoint: two blocks of two Linears (grouped by names)."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    tensors = {f"blocks.{i}.{j}.weight": torch.randn(8, 8) for i in range(2) for j in range(2)}
    tensors["head.weight"] = torch.randn(4, 8)
    path = tmp_path_factory.mktemp("src") / "model.safetensors"
    save_file(tensors, str(path))
    return path


def _raw_safetensors(path: Path, entries: dict[str, Any], data: bytes) -> Path:
    """A file with exactly this header (no library normalises it)."""
    head = json.dumps(entries).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)
    return path


# ------------------------------------------------------------------ the destination


def test_a_non_empty_folder_it_did_not_write_is_refused(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "mine"
    dst.mkdir()
    (dst / "index.json").write_text('{"my": "own index"}')
    (dst / "notes.txt").write_text("keep me")
    with pytest.raises(ShardWriteError) as info:
        shard_checkpoint(src, dst, progress=False)
    msg = str(info.value)
    assert msg.startswith(f"{dst}: not empty") and "--overwrite" in msg and "\n" not in msg
    assert (dst / "index.json").read_text() == '{"my": "own index"}'  # not deleted, not overwritten
    assert sorted(p.name for p in dst.iterdir()) == ["index.json", "notes.txt"]


def test_overwrite_writes_into_it_and_leaves_the_users_other_files(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "mine"
    dst.mkdir()
    (dst / "notes.txt").write_text("keep me")
    (dst / "draft.tmp").write_text("my draft")
    shard_checkpoint(src, dst, progress=False, overwrite=True)
    verify_shards(dst)
    assert (dst / "notes.txt").read_text() == "keep me" and (dst / "draft.tmp").read_text() == "my draft"


def test_a_rerun_into_its_own_folder_resumes_and_keeps_the_users_tmp_files(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    shard_checkpoint(src, dst, progress=False)
    (dst / "draft.tmp").write_text("my draft")  # the user's, beside our files
    (dst / "index.json.tmp").write_text("partial")  # ours: a killed run's partial index
    summary = shard_checkpoint(src, dst, progress=False)
    assert summary["resumed"] == summary["units"] > 0
    assert (dst / "draft.tmp").read_text() == "my draft"
    assert not (dst / "index.json.tmp").exists()
    verify_shards(dst)


def test_a_killed_runs_folder_is_still_its_own(src: Path, tmp_path: Path) -> None:
    """Only .progress.json and some files, no index.json yet: a rerun resumes, it is not refused."""
    dst = tmp_path / "out"
    shard_checkpoint(src, dst, progress=False)
    (dst / "index.json").unlink()
    summary = shard_checkpoint(src, dst, progress=False)
    assert summary["resumed"] == summary["units"]


def test_the_cli_refuses_with_one_line_and_exit_2(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "photos"
    dst.mkdir()
    (dst / "holiday.tmp").write_text("not yours")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-c", "from jobs.cli import main; main()", "shard", str(src), str(dst)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and f"{dst}: not empty" in done.stderr
    assert (dst / "holiday.tmp").read_text() == "not yours"
    done = subprocess.run([*cmd, "--overwrite"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (dst / "holiday.tmp").read_text() == "not yours" and (dst / "index.json").is_file()


# ------------------------------------------------------------------ hostile headers


def _entry(a: int, b: int, shape: list[int]) -> dict[str, Any]:
    return {"dtype": "F32", "shape": shape, "data_offsets": [a, b]}


@pytest.mark.parametrize("case,entries,data,words", [
    ("negative", {"blocks.0.weight": _entry(-64, 0, [4, 4])}, bytes(64), "data_offsets [-64, 0] are negative"),
    ("reversed", {"blocks.0.weight": _entry(64, 0, [4, 4])}, bytes(64), "are negative or reversed"),
    ("overlapping", {"blocks.0.weight": _entry(0, 64, [4, 4]), "blocks.1.weight": _entry(32, 96, [4, 4])},
     bytes(96), "overlap tensor blocks.0.weight"),
    ("out of file", {"blocks.0.weight": _entry(0, 64, [4, 4])}, bytes(16), "ends at byte"),
    ("not integers", {"blocks.0.weight": _entry(0, 64, [4, 4]) | {"data_offsets": [0.0, 64.0]}}, bytes(64),
     "are not two integers"),
])
def test_bad_data_offsets_are_named(tmp_path: Path, case: str, entries: dict, data: bytes, words: str) -> None:
    path = _raw_safetensors(tmp_path / "bad.safetensors", entries, data)
    with pytest.raises(ShardError) as info:
        shard_checkpoint(path, tmp_path / "out", progress=False)
    msg = str(info.value)
    assert msg.startswith(f"{path}: ") and words in msg and "\n" not in msg, msg
    bad = "blocks.1.weight" if case == "overlapping" else "blocks.0.weight"
    assert f"tensor {bad}" in msg
    assert not (tmp_path / "out" / "index.json").exists()


def test_a_negative_offset_never_reads_the_header_as_weights(tmp_path: Path) -> None:
    """Before: [-N, 0] of a 0-byte tensor... with a shape to match, bytes of the JSON header became a weight."""
    entries = {"w": _entry(0, 16, [2, 2])}
    head_len = len(json.dumps(entries).encode())
    entries = {"w": _entry(-16, 0, [2, 2])}
    path = _raw_safetensors(tmp_path / "sneaky.safetensors", entries, b"")
    assert head_len > 16
    from offload_core.disk.source import SafetensorsSource

    with pytest.raises(ShardError, match=r"tensor w: data_offsets \[-16, 0\]"):
        SafetensorsSource([path])


@pytest.mark.parametrize("offsets,words", [([-8, 8], "not two integers 0 <= start <= end"),
                                           ([0, 1 << 20], "ends at byte"),
                                           (None, "overlap tensor a")])
def test_the_lora_header_reader_checks_the_same(tmp_path: Path, offsets: list[int] | None, words: str) -> None:
    from jobs.runners.folders import LoraError, read_lora_header

    if offsets is None:
        entries = {"a": _entry(0, 16, [2, 2]), "b": _entry(8, 24, [2, 2])}
    else:
        entries = {"a": _entry(offsets[0], offsets[1], [2, 2])}
    path = _raw_safetensors(tmp_path / "lora.safetensors", entries, bytes(24))
    with pytest.raises(LoraError) as info:
        read_lora_header(path)
    assert str(path) in str(info.value) and words in str(info.value)
