"""`python -m jobs ...` is `offload-jobs ...`."""

from __future__ import annotations

from jobs.cli import main

if __name__ == "__main__":
    main()
