"""The log's host-RAM line after loading: figures for a tiny model, a ratio only where it means something.

A tiny job's weights are kilobytes against the process's hundreds of megabytes, and "833.74x the
weight bytes" read as an alarm; now it reads "peaked at 612.3 MB for 14.1 KB of weights".
"""

from __future__ import annotations

import re

from jobs.runners.load import host_ram_on_load


def test_tiny_weights_get_figures_and_big_ones_a_ratio() -> None:
    tiny = host_ram_on_load(612_300_000, 600_000_000, 14_100)
    assert tiny.startswith("host RAM while loading peaked at 612.3 MB for 14.1 KB of weights")
    assert "fixed overhead dominates" in tiny and "added 12.3 MB" in tiny and not re.search(r"\d\.\d+x", tiny)
    big = host_ram_on_load(31_200_000_000, 7_200_000_000, 24_000_000_000)
    assert big == "host RAM while loading peaked at 31.2 GB, 1.30x the 24.0 GB of weights (loading added 1.00x)"


# A real tiny train job's log line is checked on test_train_jobs.py's Flux job (one job fewer).
