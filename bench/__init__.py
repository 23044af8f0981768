"""The offload benchmark: ours against resident and the best existing tools, in one process.

Run `python -m bench --help`. Performance lives here, never in timed tests.
"""

from __future__ import annotations

__all__: list[str] = []
