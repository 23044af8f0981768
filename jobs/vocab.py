"""Moved to jobs.contract (kept for one commit while importers move)."""

from __future__ import annotations

from jobs.contract import (ACTIVE, EXECUTORS, KINDS, LIVE, REASONS, RETRYABLE_REASONS,  # noqa: F401
                           RUNNER_ENV_OPTIONS, STATES, TERMINAL)
