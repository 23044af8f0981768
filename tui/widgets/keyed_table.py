"""`KeyedTable`: a DataTable of `Text` rows by key, where changing a cell repaints only its row.

DataTable repaints every visible row after any `update_cell` (and re-renders each cell through
Rich: about 1.5 ms a row here), and with `update_width=True` it re-measures the whole column
each time a cell gets narrower, which is quadratic when many cells change. Here:

- `put(key, cells)` adds a row, or updates the cells that differ and repaints that row alone
  (nothing at all when the row is scrolled out of view);
- column widths are kept from the cells' own lengths: a cell wider than its column widens it
  (the whole table is then repainted, as the columns move), and when the widest cell shrinks
  the column is measured once;
- with a `priority`, only the columns that fit the table's width are shown, the most wanted
  first (`fit`, on resize and when a column widens); rows keep every cell, so a column that
  comes back shows its current value.
"""

from __future__ import annotations

from typing import Any, Iterable

from rich.text import Text
from textual.widgets import DataTable

__all__ = ["KeyedTable"]


class KeyedTable(DataTable):
    _row_only = False  # inside `put`: DataTable's whole-table repaints are narrowed to the row

    def __init__(self, columns: tuple[tuple[str, str], ...], *, priority: tuple[str, ...] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._columns = columns
        self._titles = [label for _, label in columns]  # as shown (a sort mark may be added)
        self._labels = [Text(label).cell_len for _, label in columns]
        self._widths = list(self._labels)  # the widest cell (or the label) of each column
        keys = [key for key, _ in columns]
        self._priority = [keys.index(k) for k in priority] if priority else None
        self.shown_columns = list(range(len(columns)))  # indices of the columns on the table
        self.shown: dict[str, tuple[Text, ...]] = {}  # the cells of each row (every column), as drawn
        for key, label in columns:
            self.add_column(label, key=key)

    def refresh(self, *regions: Any, **kwargs: Any) -> Any:
        if self._row_only and not regions and not kwargs.get("layout") and not kwargs.get("recompose"):
            return self  # `put` repaints the one row it changed
        return super().refresh(*regions, **kwargs)

    def clear(self, columns: bool = False) -> Any:
        self.shown.clear()
        self._widths = list(self._labels)
        return super().clear(columns)

    def on_resize(self) -> None:
        self.fit()

    def fit(self) -> bool:
        """Show the columns that fit the width, most wanted first; returns whether they changed."""
        if self._priority is None or self.size.width <= 0:
            return False
        room = self.size.width - self.styles.scrollbar_size_vertical  # as if the rows overflow
        chosen: list[int] = []
        used = 0
        for i in self._priority:
            need = self._widths[i] + 2 * self.cell_padding
            if not chosen or used + need <= room:  # a column too wide is skipped, narrower ones still fit
                chosen.append(i)
                used += need
        return self._rebuild(sorted(chosen))

    def set_title(self, key: str, title: str) -> None:
        """Relabel one column (a sort mark); the label's width counts toward the column's."""
        i = next(n for n, (k, _) in enumerate(self._columns) if k == key)
        if self._titles[i] == title:
            return
        self._titles[i] = title
        self._labels[i] = Text(title).cell_len
        self._widths[i] = max(self._widths[i], self._labels[i])
        if not self.fit():
            self._rebuild(self.shown_columns, force=True)

    def _rebuild(self, visible: list[int], force: bool = False) -> bool:
        """Recreate the columns (`visible`, with their titles) and the rows in their order."""
        if visible == self.shown_columns and not force:
            return False
        order = [str(row.key.value) for row in self.ordered_rows]
        cursor = order[self.cursor_row] if 0 <= self.cursor_row < len(order) else None
        scroll = self.scroll_y
        super().clear(columns=True)
        self.shown_columns = visible
        for i in visible:
            self.add_column(self._titles[i], key=self._columns[i][0])
        for key in order:
            cells = self.shown[key]
            self.add_row(*(cells[i] for i in visible), key=key)
        if cursor is not None:
            self.move_cursor(row=order.index(cursor), scroll=False)
        self.scroll_to(y=scroll, animate=False)
        self.refresh()
        return True

    def put(self, key: str, cells: tuple[Text, ...]) -> bool:
        """Show `cells` as row `key`; returns whether anything changed."""
        return self.put_many([(key, cells)])

    def put_many(self, rows: Iterable[tuple[str, tuple[Text, ...]]]) -> bool:
        """`put` for many rows, repainted together once all are updated."""
        changed: list[str] = []
        moved = False
        shrunk: set[int] = set()
        self._row_only = True
        try:
            for key, cells in rows:
                old = self.shown.get(key)
                if old is None:
                    self.add_row(*(cells[i] for i in self.shown_columns), key=key)  # DataTable measures new rows itself
                    self.shown[key] = cells
                    for i, cell in enumerate(cells):
                        self._widths[i] = max(self._widths[i], cell.cell_len)
                    moved = True
                    continue
                if old == cells:
                    continue
                self.shown[key] = cells
                changed.append(key)
                for i, (new, was) in enumerate(zip(cells, old)):
                    if new == was:
                        continue
                    grow = new.cell_len > self._widths[i]
                    if grow:
                        self._widths[i] = new.cell_len
                        moved = True
                    elif was.cell_len == self._widths[i] and new.cell_len < was.cell_len:
                        shrunk.add(i)  # it may have been the widest
                    if i not in self.shown_columns:
                        continue
                    # Wider than the column: DataTable widens it from this cell alone (no column scan).
                    self.update_cell(key, self._columns[i][0], new, update_width=grow)
        finally:
            self._row_only = False
        for i in shrunk:
            moved = self._shrink(i) or moved
        if moved and self.fit():
            return True
        if moved:
            self.refresh()  # rows or columns moved: all of it
        else:
            for key in changed:
                self.refresh_row(self.get_row_index(key))
        return moved or bool(changed)

    def drop(self, key: str) -> None:
        if self.shown.pop(key, None) is not None:
            self.remove_row(key)

    def _shrink(self, i: int) -> bool:
        widest = max((row[i].cell_len for row in self.shown.values()), default=0)
        width = max(widest, self._labels[i])
        if width >= self._widths[i]:
            return False
        self._widths[i] = width
        if self.shown and i in self.shown_columns:
            key = next(k for k, row in self.shown.items() if row[i].cell_len == widest)
            # Narrower than the column: DataTable measures the column once, on idle.
            self.update_cell(key, self._columns[i][0], self.shown[key][i], update_width=True)
        return True
