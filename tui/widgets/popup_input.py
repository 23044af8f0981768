"""`PopupInput`: an Input hidden until asked for (the jobs filter, the log search)."""

from __future__ import annotations

from textual.widgets import Input

__all__ = ["PopupInput"]


class PopupInput(Input):
    """Takes no room until `reveal()` shows and focuses it; `conceal()` hides it again (its value stays)."""

    DEFAULT_CSS = """
    PopupInput { display: none; height: 3; }
    PopupInput.-shown { display: block; }
    """

    @property
    def revealed(self) -> bool:
        return self.has_class("-shown")

    def reveal(self) -> None:
        self.add_class("-shown")
        self.focus()

    def conceal(self) -> None:
        self.remove_class("-shown")
