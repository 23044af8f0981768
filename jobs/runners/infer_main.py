"""`python -m jobs.runners.infer_main RUN_DIR`: placeholder until the infer runner lands."""

from __future__ import annotations

from jobs.runners._entry import fail, load_job


def main() -> None:
    load_job()  # still validates the spec the worker wrote
    fail("setup_failed", "the infer runner lands in the next jobs issue; this build cannot run infer jobs yet")


if __name__ == "__main__":
    main()
