"""No job state, reason or metric name is spelled as a string literal outside jobs/contract.py.

Every Python string constant (so not comments, nor an f-string's text or a docstring that merely
mentions a name; a constant inside an f-string's braces does count) in jobs/, tui/ and bench/tui_job.py whose whole value is a state
("FAILED"), a reason ("worker_lost") or a metric field ("eta_seconds") fails the test: write
`JobState.FAILED`, `Reason.WORKER_LOST`, `Metric.eta_seconds` (or build the row with
`StepMetrics(...)` keywords). A few literals that share a spelling but are not the contract's
name are listed in ALLOWED, each with why.
"""

from __future__ import annotations

import ast
from pathlib import Path

from jobs.contract import METRIC_NAMES, REASONS, STATES

REPO = Path(__file__).resolve().parents[2]
CONTRACT = REPO / "jobs" / "contract.py"
NAMES = frozenset(STATES) | frozenset(REASONS) | frozenset(METRIC_NAMES)

# (file, literal): not the contract's name, only the same word.
ALLOWED = {
    ("jobs/store_base.py", "timeout"): "sqlite3.connect's timeout argument",
    ("jobs/runners/checkpoint.py", "step"): "checkpoint.json's field, not a metrics row",
    ("jobs/_cli/outputs.py", "step"): "a checkpoint listing's field (run_state), not a metrics row",
    ("jobs/_cli/show.py", "step"): "run_state's samples field",
    ("jobs/runners/train.py", "step"): "the training state saved in state.pt (resume), not a metrics row",
    ("jobs/runners/train.py", "epoch"): "the training state saved in state.pt (resume), not a metrics row",
    ("jobs/runners/infer.py", "seconds"): "params.json's per-image record, not a metrics row",
    ("jobs/_cli/shard.py", "seconds"): "the shard result's field",
    ("tui/screens/jobs.py", "progress"): "the jobs table's column key",
    ("jobs/_cli/output.py", "progress"): "a row label of `offload-jobs show`",
    ("jobs/store_base.py", "epoch"): "SQL's extract(epoch from ...)",
    ("jobs/_cli/workers.py", "RUNNING"): "a column header of `offload-jobs workers`",
    ("jobs/executors/slurm.py", "PENDING"): "Slurm's own job state (squeue/sacct), not ours",
    ("jobs/executors/slurm.py", "RUNNING"): "Slurm's own job state (squeue/sacct), not ours",
    ("jobs/executors/slurm.py", "CANCELLED"): "Slurm's own job state (squeue/sacct), not ours",
    ("jobs/executors/slurm.py", "FAILED"): "Slurm's own job state (squeue/sacct), not ours",
}


def files() -> list[Path]:
    out = sorted((REPO / "jobs").rglob("*.py")) + sorted((REPO / "tui").rglob("*.py"))
    out.append(REPO / "bench" / "tui_job.py")
    return [p for p in out if p != CONTRACT]


def literals(path: Path) -> list[tuple[int, str]]:
    """(line, value) of every string constant in `path`, those inside f-string expressions too
    (`f"{m.get('eta_s')}"`), but not an f-string's own text (`f"FAILED {x}"` is prose)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    prose = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose]


def strays() -> list[str]:
    bad = []
    for path in files():
        rel = path.relative_to(REPO).as_posix()
        for line, value in literals(path):
            if value in NAMES and (rel, value) not in ALLOWED:
                bad.append(f"{rel}:{line}: {value!r}")
    return bad


def test_no_state_reason_or_metric_literal_outside_the_contract() -> None:
    bad = strays()
    assert not bad, "spelled outside jobs/contract.py (use JobState/Reason/Metric):\n" + "\n".join(bad)


def test_the_grep_sees_a_literal(tmp_path: Path) -> None:
    # The scan itself: a stray literal is found, an f-string or a comment mentioning one is not.
    p = tmp_path / "m.py"
    p.write_text('x = {"eta_seconds": 1}  # "FAILED"\ny = f"FAILED {x}"\nz = "FAILED"\nw = f"{x.get(\'loss\')}"\n')
    got = sorted((line, v) for line, v in literals(p) if v in NAMES)
    assert got == [(1, "eta_seconds"), (3, "FAILED"), (4, "loss")]


def test_every_allowance_is_still_needed() -> None:
    # An allowance whose literal is gone would hide a new stray of the same spelling: drop it.
    used = set()
    for path in files():
        rel = path.relative_to(REPO).as_posix()
        used |= {(rel, v) for _, v in literals(path) if (rel, v) in ALLOWED}
    assert set(ALLOWED) - used == set()


def test_the_contract_speaks_plain_strings() -> None:
    # Rows come back from SQLite/Postgres and JSON as plain str: members must equal, hash and encode as them.
    import json

    import pytest

    from jobs.contract import ENGINE_STATS, RETRYABLE, TERMINAL, JobState, Metric, Reason, StepMetrics

    assert "FAILED" in TERMINAL and JobState.FAILED == "FAILED" and f"{Reason.WORKER_LOST}" == "worker_lost"
    assert json.dumps({"s": JobState.RUNNING, "r": [Reason.TIMEOUT]}) == '{"s": "RUNNING", "r": ["timeout"]}'
    assert "cancelled" not in RETRYABLE and "worker_lost" in RETRYABLE
    assert Metric.eta_seconds == "eta_seconds" and "eta_seconds" in Metric
    with pytest.raises(AttributeError, match="eta_s"):
        Metric.eta_s  # noqa: B018 - the name the dashboard once read: a typo is an error, not a blank ETA
    assert set(Metric) == set(StepMetrics.__annotations__) | set(ENGINE_STATS)
