"""TimingLog: pairs that share an event (a use's arrival ends one span and starts its stall) read
each event once recorded, and the pool hands an event out again only after every pair that reads
it has been resolved."""

from __future__ import annotations

from offload_core.stats import TimingLog


class FakeEvent:
    """A CUDA-event stand-in whose completion the test decides."""

    def __init__(self, t: float) -> None:
        self.t, self.done = t, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.done and end.done, "read before it happened"
        return end.t - self.t


def test_a_shared_event_is_pooled_once_after_both_pairs_resolve() -> None:
    log = TimingLog()
    a, b, c = FakeEvent(0.0), FakeEvent(2.0), FakeEvent(5.0)
    log.add("span", ("pos", 0), a, b, own_end=False)  # b ends this span ...
    log.add("stall", 1, b, c, own_end=False)  # ... and starts this stall; c starts the next span
    a.done = b.done = True
    log.resolve(block=False)  # the stall's end has not happened: it stays, b with it
    assert [p[0] for p in log.pending] == ["stall"] and log._free == [a]
    assert log.total_ms["span"] == 2.0
    c.done = True
    log.resolve(block=False)
    assert log.total_ms["stall"] == 3.0 and log._free == [a, b]  # c: still the next span's start
    assert not log.pending


def test_a_non_blocking_resolve_stops_at_the_first_pair_not_done() -> None:
    log = TimingLog()
    first, later = (FakeEvent(0.0), FakeEvent(1.0)), (FakeEvent(1.0), FakeEvent(4.0))
    log.add("h2d", 0, *first)
    log.add("stall", 1, *later)
    later[0].done = later[1].done = first[0].done = True  # the later pair finished first (another stream)
    log.resolve(block=False)
    assert len(log.pending) == 2 and not log._free  # in order: nothing pooled past the first pending pair
    log.resolve(block=True)
    assert log.total_ms == {"h2d": 1.0, "stall": 3.0} and not log.pending
    assert len(log._free) == 4


def test_a_weighted_pair_stands_for_the_untimed_steps_but_its_reading_is_kept_as_is() -> None:
    log = TimingLog()
    a, b, c, d = FakeEvent(0.0), FakeEvent(2.0), FakeEvent(10.0), FakeEvent(13.0)
    log.add("h2d", 0, a, b)  # a step timed while every step is (weight 1)
    log.weight = 4  # then one step in four: this reading stands for four steps
    log.add("h2d", 0, c, d)
    a.done = b.done = c.done = d.done = True
    log.resolve(block=False)
    assert log.timed_ms["h2d"] == 5.0  # what the events read: the copy rate's denominator
    assert log.total_ms["h2d"] == 2.0 + 4 * 3.0 and log.per_unit_ms[0]["h2d"] == 14.0  # estimates over 5 steps
    assert log.counts["h2d"] == 5 and log.last_ms[("h2d", 0)] == 3.0
