"""Progress bars that suit where they are shown: a line on stderr in a terminal, a widget in a
notebook with ipywidgets, and one updating line of output in a notebook without it.

tqdm.auto falls back, in a notebook without ipywidgets, to its terminal bar on stderr after a
warning: every refresh is then a new block of output, 70 and more lines an epoch in the saved
notebook and its HTML export. Here that case gets a bar drawn into one display output that
each refresh replaces (IPython's display handles), which a saved notebook keeps as one line.
"""

from __future__ import annotations

import io
import sys

from tqdm import std


def tqdm(*args, **kwargs):
    """A tqdm bar for here (see the module's docstring); the arguments are tqdm's."""
    where = _notebook()
    if where == "widgets":
        from tqdm.notebook import tqdm as widget_bar
        return widget_bar(*args, **kwargs)
    if where == "text":
        return LineBar(*args, **kwargs)
    return std.tqdm(*args, **kwargs)


def _notebook() -> str:
    """'widgets' in a Jupyter kernel with ipywidgets, 'text' in one without, '' elsewhere."""
    ipython = sys.modules.get("IPython")  # a kernel has imported it; elsewhere no import (0.12 s here)
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None or not hasattr(shell, "kernel"):  # a terminal IPython draws tqdm's own bar well
        return ""
    try:
        import ipywidgets  # noqa: F401 - its presence is the question
    except ImportError:
        return "text"
    return "widgets"


class LineBar(std.tqdm):
    """tqdm's text bar drawn into one notebook output that each refresh replaces."""

    def __init__(self, *args, **kwargs):
        kwargs["file"] = io.StringIO()  # tqdm writes nowhere; display() below shows the bar
        kwargs.setdefault("mininterval", 0.5)
        self._handle = None
        super().__init__(*args, **kwargs)
        if not self.disable:
            from IPython.display import Pretty, display
            self._handle = display(Pretty(str(self)), display_id=True)

    def display(self, msg=None, pos=None):
        if self._handle is not None:
            from IPython.display import Pretty
            self._handle.update(Pretty(msg if msg is not None else str(self)))
        return True

    def close(self):
        if self.disable:
            return
        leave = self.leave
        super().close()  # its last display() shows the final state
        if not leave and self._handle is not None:
            from IPython.display import Pretty
            self._handle.update(Pretty(""))  # a bar that should vanish when done leaves no line
