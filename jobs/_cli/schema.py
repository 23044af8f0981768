"""`offload-jobs schema`: the JSON Schema of a job spec (for editors and CI checks)."""

from __future__ import annotations

from jobs._cli.output import print_json


def schema() -> None:
    """Print the JSON Schema of a job spec."""
    from jobs.spec import json_schema

    print_json(json_schema())
