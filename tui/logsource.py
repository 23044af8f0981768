"""`LogSource`: a job's output.log seen through the offset-based logs API, without reading it whole.

The log is cut into blocks of about `BLOCK` bytes (the byte ranges the worker served). Only each
block's line count is kept; a block's lines are fetched again when shown, and the last few blocks
are cached. Opening reads the last block alone, so a 100 MB log opens at once at its end; the
blocks before it are counted backwards in the background (`scan_back`), and new output is
appended (`grow`). Block edges are moved to line starts where the text allows it, so a line is
never shown split.

All mutation happens on one thread (the UI's); the fetches can run anywhere.
"""

from __future__ import annotations

import bisect
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator

__all__ = ["LogSource", "Block", "Chunk"]

BLOCK = 256 * 1024
CACHE_BLOCKS = 16

Fetch = Callable[[int, int], dict[str, Any]]  # (offset, limit) -> the logs API's chunk


@dataclass
class Block:
    start: int
    end: int
    nlines: int


@dataclass
class Chunk:
    """Text read for a byte range, already cut at a line start."""

    start: int
    end: int
    text: str


def _nbytes(text: str) -> int | None:
    """Bytes `text` had on disk, when that is knowable (no replacement characters)."""
    return None if "\ufffd" in text else len(text.encode("utf-8"))


def _split(text: str) -> list[str]:
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [ln.rstrip("\r").rsplit("\r", 1)[-1] for ln in lines]  # progress bars: the last redraw


class LogSource:
    def __init__(self, fetch: Fetch, *, block: int = BLOCK, max_lines: int | None = None) -> None:
        self.fetch = fetch
        self.block = block
        self.max_lines = max_lines  # --tail: stop counting backwards after this many lines
        self.blocks: list[Block] = []
        self._first: list[int] = []  # the first line number of each block
        self._cache: OrderedDict[int, list[str]] = OrderedDict()
        self.size = 0
        self.eof = False
        self.status: str | None = None
        self._ended: dict[int, bool] = {}  # does a cached block end with a newline
        self.lock = threading.RLock()  # the UI thread draws while a search thread reads

    # ------------------------------------------------------------ reading
    def _read(self, offset: int, limit: int) -> tuple[int, str, int]:
        """(start, text, next offset) for [offset, offset + limit), across the worker's chunk limit."""
        chunk = self.fetch(offset, limit)
        start = nxt = int(chunk.get("offset", max(0, offset)))
        goal = start + limit
        parts: list[str] = []
        while True:
            self.size = max(self.size, int(chunk.get("size", 0)))
            self.status = chunk.get("status", self.status)
            self.eof = bool(chunk.get("eof"))
            data = chunk.get("data") or ""
            new = int(chunk.get("next_offset", nxt))
            if data:
                parts.append(data)
            if not data or new <= nxt or new >= goal:
                return start, "".join(parts), max(new, nxt)
            nxt = new
            chunk = self.fetch(nxt, goal - nxt)

    def fetch_tail(self) -> Chunk:
        """The last block, cut to start at a line (I/O only)."""
        start, text, end = self._read(-self.block, self.block)
        if start > 0:
            text, start = self._cut_head(text, start)
        return Chunk(start, end, text)

    def fetch_before(self, end: int) -> Chunk:
        """The block that ends where the first known block starts (I/O only)."""
        start = max(0, end - self.block)
        s, text, _ = self._read(start, end - start)
        if s > 0:
            text, s = self._cut_head(text, s)
        return Chunk(s, end, text)

    def fetch_after(self) -> Chunk:
        """Output written since the last known byte (I/O only)."""
        start = self.blocks[-1].end if self.blocks else 0
        s, text, e = self._read(start, self.block * 4)
        return Chunk(s, e, text)

    @staticmethod
    def _cut_head(text: str, start: int) -> tuple[str, int]:
        i = text.find("\n")
        if i < 0:
            return text, start
        n = _nbytes(text[: i + 1])
        if n is None:
            return text, start
        return text[i + 1:], start + n

    # ------------------------------------------------------------ applying (one thread)
    def _reindex(self) -> None:
        first, n = [], 0
        for b in self.blocks:
            first.append(n)
            n += b.nlines
        self._first = first

    @property
    def line_count(self) -> int:
        return (self._first[-1] + self.blocks[-1].nlines) if self.blocks else 0

    @property
    def fully_indexed(self) -> bool:
        if not self.blocks:
            return self.eof or self.size == 0
        if self.max_lines is not None and self.line_count >= self.max_lines:
            return True
        return self.blocks[0].start == 0

    def open(self) -> Chunk:
        """Read and apply the tail (what `open` costs: one request)."""
        chunk = self.fetch_tail()
        self.apply_append(chunk)
        if self.max_lines is not None and self.blocks and self.blocks[0].nlines > self.max_lines:
            b = self.blocks[0]
            b.nlines = max(0, self.max_lines)
            self._cache[b.start] = self._cache[b.start][len(self._cache[b.start]) - b.nlines:]
            self._reindex()
        return chunk

    def apply_append(self, chunk: Chunk) -> int:
        """New bytes at the end; returns how many lines were added."""
        with self.lock:
            return self._append(chunk)

    def _append(self, chunk: Chunk) -> int:
        if chunk.end <= (self.blocks[-1].end if self.blocks else 0) and self.blocks:
            return 0
        if not chunk.text and chunk.end == chunk.start:
            return 0
        before = self.line_count
        last = self.blocks[-1] if self.blocks else None
        if last is not None and last.start in self._cache and (last.end - last.start < self.block
                                                                 or not self._ends_line(last)):
            lines = self._cache[last.start]
            joined = "\n".join(lines) + ("\n" if self._ended[last.start] else "")
            text = joined + chunk.text
            new_lines = _split(text)
            self._cache[last.start] = new_lines
            self._ended[last.start] = text.endswith("\n")
            last.end, last.nlines = chunk.end, len(new_lines)
        else:
            lines = _split(chunk.text)
            self.blocks.append(Block(chunk.start, chunk.end, len(lines)))
            self._remember(chunk.start, lines, chunk.text.endswith("\n"))
        self._reindex()
        return self.line_count - before

    def apply_prepend(self, chunk: Chunk) -> int:
        """Bytes before the first known block; returns how many lines were added at the top."""
        with self.lock:
            return self._prepend(chunk)

    def _prepend(self, chunk: Chunk) -> int:
        if self.blocks and chunk.end != self.blocks[0].start:
            return 0
        lines = _split(chunk.text)
        if self.max_lines is not None:
            room = self.max_lines - self.line_count
            if room <= 0:
                return 0
            if len(lines) > room:  # keep only the newest `room` lines of this block
                lines = lines[-room:]
        self.blocks.insert(0, Block(chunk.start, chunk.end, len(lines)))
        self._remember(chunk.start, lines, chunk.text.endswith("\n"))
        self._reindex()
        return len(lines)

    def _ends_line(self, b: Block) -> bool:
        return self._ended.get(b.start, True)

    def _remember(self, start: int, lines: list[str], ended: bool) -> None:
        self._cache[start] = lines
        self._cache.move_to_end(start)
        self._ended[start] = ended
        keep = self.blocks[-1].start if self.blocks else None  # the growing block stays cached
        for old in list(self._cache):
            if len(self._cache) <= CACHE_BLOCKS:
                break
            if old != keep and old != start:
                del self._cache[old]

    # ------------------------------------------------------------ lines
    def _block_lines(self, i: int) -> list[str]:
        b = self.blocks[i]
        lines = self._cache.get(b.start)
        if lines is None:
            _, text, _ = self._read(b.start, b.end - b.start)
            lines = _split(text)
            if len(lines) > b.nlines:  # a --tail-trimmed first block
                lines = lines[-b.nlines:]
            self._remember(b.start, lines, text.endswith("\n"))
        else:
            self._cache.move_to_end(b.start)
        return lines

    def line(self, n: int) -> str:
        with self.lock:
            if n < 0 or n >= self.line_count:
                return ""
            i = bisect.bisect_right(self._first, n) - 1
            lines = self._block_lines(i)
            k = n - self._first[i]
            return lines[k] if k < len(lines) else ""

    def iter_lines(self, start: int, forward: bool = True) -> Iterator[tuple[int, str]]:
        n = start
        while 0 <= n < self.line_count:
            yield n, self.line(n)
            n += 1 if forward else -1

    def find(self, pattern: str, start: int, forward: bool = True, regex: bool = False) -> int | None:
        """The first line from `start` (exclusive) that matches; case-insensitive, plain text by default."""
        rx = re.compile(pattern if regex else re.escape(pattern), re.IGNORECASE)
        first = start + 1 if forward else start - 1
        for n, text in self.iter_lines(first, forward):
            if rx.search(text):
                return n
        return None
