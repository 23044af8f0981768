"""`python -m jobs.runners.train_main RUN_DIR`: placeholder until the train runner lands."""

from __future__ import annotations

from jobs.runners._entry import fail, load_job


def main() -> None:
    load_job()  # still validates the spec the worker wrote
    fail("setup_failed", "the train runner lands in the next jobs issue; this build cannot run train jobs yet")


if __name__ == "__main__":
    main()
