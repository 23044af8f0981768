"""The bounce ring's streaming-store fill (streamcopy.py, native/stream_copy.c): built with the host's C
compiler, exact at every alignment and length, and libc's memmove, with the reason said, wherever it
cannot be built or is switched off. The ring's bitwise tests (test_bounce.py) run through it too."""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import offload_core.bounce as bounce
from offload_core import OffloadConfigError, enable_offload, streamcopy

HAS_CC = platform.machine().lower() in {"x86_64", "amd64"} and any(shutil.which(c) for c in ("cc", "gcc", "clang"))
needs_cc = pytest.mark.skipif(not HAS_CC, reason="needs an x86-64 CPU and a C compiler (cc, gcc or clang)")


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No helper loaded in this process yet, and an empty cache to build it in."""
    monkeypatch.setattr(streamcopy, "_loaded", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(streamcopy.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv(bounce.BOUNCE_FILL_ENV, raising=False)
    return tmp_path


@needs_cc
def test_the_helper_is_built_once_into_the_cache_and_reused(fresh: Path) -> None:
    fn, kind = streamcopy.load()
    assert fn is not None and kind == "stream"
    built = list((fresh / "cache" / "offload-jobs" / "native").glob("stream_copy-*.so"))
    assert len(built) == 1
    assert streamcopy.load()[0] is fn, "one build per process"
    stamp = built[0].stat().st_mtime_ns
    streamcopy._loaded = None
    assert streamcopy.load()[1] == "stream" and built[0].stat().st_mtime_ns == stamp, "the cached build is reused"
    assert not list(built[0].parent.glob(".*")), "no temporary file left behind"


@needs_cc
@pytest.mark.parametrize("dst_off", [0, 1, 8, 63])
@pytest.mark.parametrize("src_off", [0, 3, 64])
@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 4097, 4096 + 63, 65_536 + 17, 1 << 20])
def test_the_streaming_copy_is_exact(fresh: Path, dst_off: int, src_off: int, n: int) -> None:
    fn, _ = streamcopy.load()
    g = torch.Generator().manual_seed(n + dst_off)
    src = torch.randint(0, 256, (n + 128,), dtype=torch.uint8, generator=g)
    dst = torch.full((n + 256,), 0xA5, dtype=torch.uint8)
    fn(dst.data_ptr() + dst_off, src.data_ptr() + src_off, n)
    assert torch.equal(dst[dst_off: dst_off + n], src[src_off: src_off + n])
    assert bool((dst[:dst_off] == 0xA5).all()) and bool((dst[dst_off + n:] == 0xA5).all()), "wrote outside its range"


def test_no_compiler_means_libc_with_the_reason(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streamcopy.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(streamcopy.shutil, "which", lambda name: None)
    assert streamcopy.load() == (None, "no C compiler (CC, cc, gcc or clang) on PATH")
    monkeypatch.setattr(streamcopy, "_loaded", None)
    monkeypatch.setenv("CC", "/nowhere/cc -O3")
    assert streamcopy.load() == (None, "CC='/nowhere/cc -O3' is not on PATH")


def test_a_cpu_without_streaming_stores_means_libc(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streamcopy.platform, "machine", lambda: "aarch64")
    fn, why = streamcopy.load()
    assert fn is None and why == "streaming stores are x86-64's; this CPU is aarch64"


@needs_cc
def test_a_build_that_fails_is_named_and_leaves_nothing(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cc = next(shutil.which(c) for c in ("cc", "gcc", "clang") if shutil.which(c))
    monkeypatch.setenv("CC", f"{cc} -include no_such_header_oj.h")
    fn, why = streamcopy.load()
    assert fn is None and why.startswith(f"{Path(cc).name} failed on stream_copy.c:") and "no_such_header_oj.h" in why
    assert not [p for p in (fresh / "cache").rglob("*") if p.is_file()], "no half-built helper kept"


@needs_cc
def test_a_helper_that_copies_wrong_is_refused(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def wrong(dst: int, src: int, n: int) -> None:
        ctypes.memmove(dst, src, max(n - 1, 0))  # drops the last byte

    with pytest.raises(streamcopy._Unavailable, match="copied 65536 bytes wrong"):
        streamcopy._check(wrong)


def _ring_stats() -> dict:
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    x = torch.randn(2, 64)
    want = m(x)
    h = enable_offload(m, target_device="cpu", offload_granularity="block", pinned_limit="16KiB")
    try:
        for _ in range(2):
            assert torch.equal(m(x), want)  # bitwise through the ring with either copy
        return h.stats()
    finally:
        h.remove()


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bounce, "DEFAULT_CHUNK", 4096)  # 4 buffers: every unit is several chunks
    monkeypatch.delenv(bounce.PINNED_LIMIT_ENV, raising=False)


@needs_cc
def test_the_ring_fills_with_streaming_stores(fresh: Path, small_chunks: None) -> None:
    st = _ring_stats()
    assert st["host_store"] == "bounce" and st["bounce_fill_copy"] == "stream"
    assert st["bounce_fill_bytes"] > 4 * st["bounce_ring_bytes"]


def test_the_switch_turns_them_off_and_a_misspelt_one_is_named(fresh: Path, small_chunks: None,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(bounce.BOUNCE_FILL_ENV, "libc")
    assert _ring_stats()["bounce_fill_copy"] == "libc (OFFLOAD_BOUNCE_FILL=libc)"
    assert streamcopy._loaded is None, "switched off: nothing built"
    monkeypatch.setenv(bounce.BOUNCE_FILL_ENV, "streaming")
    with pytest.raises(OffloadConfigError, match="OFFLOAD_BOUNCE_FILL='streaming': expected stream or libc"):
        enable_offload(nn.Linear(4, 4), target_device="cpu", pinned_limit="16KiB")


def test_without_a_compiler_the_ring_says_why(fresh: Path, small_chunks: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streamcopy.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(streamcopy.shutil, "which", lambda name: None)
    assert _ring_stats()["bounce_fill_copy"] == "libc (no C compiler (CC, cc, gcc or clang) on PATH)"


def test_the_source_ships_with_the_package() -> None:
    assert streamcopy.SOURCE.is_file() and "oj_stream_copy" in streamcopy.SOURCE.read_text()
    text = (Path(streamcopy.__file__).parents[1] / "pyproject.toml").read_text()
    assert '"native/*.c"' in text, "pyproject's package-data must carry the helper's source"
    assert os.path.basename(streamcopy.SOURCE.parent) == "native"


@needs_cc
def test_a_helper_in_a_folder_others_can_write_is_never_loaded(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The temp dir's fallback folder is shared ground: a file planted there by another user, or in a
    folder others may write, is not loaded; the helper is built in a folder of this user's own instead."""
    streamcopy.load()
    good = next((fresh / "cache" / "offload-jobs" / "native").glob("stream_copy-*.so"))
    planted = fresh / "tmp" / f"offload-jobs-native-{os.getuid()}"
    planted.mkdir(parents=True)
    (planted / good.name).write_bytes(b"not a library")
    planted.chmod(0o777)
    monkeypatch.setattr(streamcopy, "_loaded", None)
    monkeypatch.setattr(streamcopy, "cache_dirs", lambda: [planted])
    fn, why = streamcopy.load()
    assert fn is None and why == f"{planted} is not this user's alone"
    planted.chmod(0o700)
    (planted / good.name).chmod(0o666)
    monkeypatch.setattr(streamcopy, "_loaded", None)
    fn, why = streamcopy.load()
    assert why == "stream", "a file others could write is rebuilt, not loaded"
    assert (planted / good.name).read_bytes() != b"not a library"
