"""Schedule: learn the order in which units are used, and say which ones to fetch next.

A cycle runs from one forward of the root module to the next, so it covers the forward pass,
checkpoint recomputes and the backward pass of a training step. The first cycle records the order;
later cycles follow it and prefetch ``depth`` units ahead. A unit that arrives out of order is a
prefetch miss; the cycle in which that happens is recorded and replaces the trace.
"""

from __future__ import annotations

__all__ = ["Schedule"]


class Schedule:
    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.trace: list[int] = []
        self._current: list[int] = []
        self._pos = 0
        self._diverged = False
        self.cycles = 0
        self.relearned = 0

    @property
    def learned(self) -> bool:
        return bool(self.trace)

    @property
    def position(self) -> int:
        """Index of the latest use in the current cycle (-1 before the first)."""
        return len(self._current) - 1

    def start_cycle(self) -> None:
        if self._current:
            if not self.trace or self._diverged or len(self._current) != len(self.trace):
                if self.trace:
                    self.relearned += 1
                self.trace = self._current
        self._current = []
        self._pos = 0
        self._diverged = False
        self.cycles += 1

    def observe_new(self, uid: int) -> bool:
        """Record a use of uid. Consecutive uses of one unit count once; returns whether this one counted."""
        if self._current and self._current[-1] == uid:
            return False
        self._current.append(uid)
        if not self.trace:
            return True
        if self._pos < len(self.trace) and self.trace[self._pos] == uid:
            self._pos += 1
            return True
        # Out of order: resynchronise on the next occurrence, if any.
        try:
            self._pos = self.trace.index(uid, self._pos) + 1
        except ValueError:
            pass
        self._diverged = True
        return True

    def upcoming(self, n: int | None = None) -> list[int]:
        """The next n units the trace expects after the current position."""
        if not self.trace:
            return []
        n = self.depth if n is None else n
        ahead = self.trace[self._pos: self._pos + n]
        if len(ahead) < n:
            # Wrap into the next cycle: the next forward starts where this one did.
            ahead += [u for u in self.trace[: n - len(ahead)] if u not in ahead]
        return ahead
