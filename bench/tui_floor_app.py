"""The floor for bench/tui_cost.py: a bare Textual app with the same widgets and no data feed.

A Header, a 9-column DataTable of `--rows` static rows and a Footer, nothing else: its start-up
and key latency, measured in the same tmux and the same run, are what Textual itself costs here.

    python bench/tui_floor_app.py --rows 1000
"""

from __future__ import annotations

import argparse

from textual.app import App, ComposeResult
from textual.widgets import DataTable, Footer, Header

COLUMNS = ("ID", "NAME", "KIND", "STATUS", "ATT", "PROGRESS", "PEAK VRAM/BUDGET", "HIT", "AGE")


class FloorApp(App):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows = rows

    def compose(self) -> ComposeResult:
        yield Header()
        table: DataTable = DataTable(cursor_type="row", zebra_stripes=True)
        table.add_columns(*COLUMNS)
        for i in range(self.rows):
            table.add_row(f"{i:012x}", f"queued-{i}", "command", "PENDING", "0/1", "-", "-", "-", "5m", key=str(i))
        yield table
        yield Footer()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1000)
    FloorApp(ap.parse_args().rows).run()
