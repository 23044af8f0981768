"""RunDir: the run-dir layout, log chunks, partial metrics lines, UTF-8 safe chunk ends."""

from __future__ import annotations

from pathlib import Path

import yaml

from jobs.rundir import RunDir, utf8_safe_end


def test_layout_and_spec(tmp_path: Path) -> None:
    rd = RunDir.for_job(tmp_path, "abc").create({"kind": "command", "command": "true"})
    assert rd.path == tmp_path / "runs" / "abc"
    for f in ("spec.yaml", "output.log", "metrics.jsonl", "events.jsonl"):
        assert (rd.path / f).is_file()
    assert rd.outputs_dir.is_dir()
    assert yaml.safe_load(rd.spec_file.read_text()) == {"kind": "command", "command": "true"}


def test_read_log_chunks_and_tail(tmp_path: Path) -> None:
    rd = RunDir(tmp_path / "r").create({})
    rd.log_file.write_bytes(b"0123456789")
    assert rd.read_log(0) == (0, b"0123456789", 10)
    assert rd.read_log(4, 3) == (4, b"456", 10)
    assert rd.read_log(-3) == (7, b"789", 10)
    assert rd.read_log(-100) == (0, b"0123456789", 10)
    assert rd.read_log(50) == (10, b"", 10)


def test_worker_lines_never_glue_to_a_cut_line(tmp_path: Path) -> None:
    rd = RunDir(tmp_path / "r").create({})
    rd.log_file.write_bytes(b"child was killed mid-li")
    rd.append_log("[offload-jobs] lost\n")
    rd.append_log("[offload-jobs] again\n")
    assert rd.log_file.read_text().splitlines() == ["child was killed mid-li", "[offload-jobs] lost", "[offload-jobs] again"]


def test_metrics_skip_partial_and_bad_lines(tmp_path: Path) -> None:
    rd = RunDir(tmp_path / "r").create({})
    rd.metrics_file.write_bytes(b'{"step": 1}\nnot json\n[1]\n{"step": 2}\n{"step": 3, "lo')
    recs, nxt = rd.read_metrics(0)
    assert recs == [{"step": 1}, {"step": 2}] and nxt == len(b'{"step": 1}\nnot json\n[1]\n{"step": 2}\n')
    with open(rd.metrics_file, "ab") as f:
        f.write(b'ss": 0.1}\n')
    assert rd.read_metrics(nxt) == ([{"step": 3, "loss": 0.1}], rd.metrics_file.stat().st_size)
    assert rd.last_metrics() == {"step": 3, "loss": 0.1}


def test_utf8_safe_end() -> None:
    data = "aé€😀".encode()
    assert utf8_safe_end(data) == len(data)
    for cut in range(len(data) + 1):
        end = utf8_safe_end(data[:cut])
        data[:end].decode("utf-8")  # never raises
        assert cut - end < 4


def test_planted_links_fifos_and_hard_links_are_refused(tmp_path: Path) -> None:
    import os

    import pytest

    from jobs.errors import RunDirError

    rd = RunDir(tmp_path / "r").create({})
    secret = tmp_path / "secret"
    secret.write_text("host file\n")
    rd.log_file.unlink()
    rd.log_file.symlink_to(secret)
    with pytest.raises(RunDirError, match="symbolic link"):
        rd.read_log()
    assert rd.append_log("[offload-jobs] note\n") is False and secret.read_text() == "host file\n"
    rd.metrics_file.unlink()
    os.mkfifo(rd.metrics_file)  # a reader that blocks forever on a FIFO would hang the worker
    assert rd.read_metrics() == ([], 0) and rd.last_metrics() is None
    rd.events_file.unlink()
    os.link(secret, rd.events_file)  # a hard link to a file outside: never written
    assert rd.append_event({"status": "RUNNING"}) is False and secret.read_text() == "host file\n"
    (rd.path / "exit.json").symlink_to(secret)
    assert rd.read_exit() is None
    moved = RunDir(tmp_path / "link-to-dir")
    moved.path.symlink_to(tmp_path)
    with pytest.raises(RunDirError, match="not a plain directory"):
        moved.read_log()
