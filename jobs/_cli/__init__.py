"""The `offload-jobs` verbs, one small module each; `jobs.cli` assembles them into the typer app.

Every module here imports only typer at module level, so `offload-jobs --help` and `ps` stay fast:
the client (httpx), the spec (pydantic) and anything heavier load inside the verb that needs them.
"""
