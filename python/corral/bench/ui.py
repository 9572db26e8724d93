"""Progress bars and notes on stderr (stdout stays clean for ``--json``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)


class UI:
    def __init__(self, enabled: bool = True) -> None:
        self.console = Console(stderr=True, quiet=not enabled)
        self.progress = Progress(
            SpinnerColumn(), TextColumn("{task.description:<34}"), BarColumn(),
            MofNCompleteColumn(), TimeElapsedColumn(), console=self.console, transient=False,
            disable=not enabled)

    def __enter__(self) -> UI:
        self.progress.start()
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.progress.stop()

    def note(self, msg: str) -> None:
        self.progress.console.print(f"[dim]{msg}[/dim]")

    @contextmanager
    def task(self, desc: str, total: int | None) -> Iterator[Callable[[int], None]]:
        """A bar for ``total`` steps; yields ``advance(k=1)`` (thread-safe). ``total=None``
        shows a spinner for work that reports no steps (a subprocess)."""
        tid = self.progress.add_task(desc, total=total)

        def advance(k: int = 1) -> None:
            self.progress.advance(tid, k)

        try:
            yield advance
        finally:
            t = self.progress.tasks[tid]
            done = t.total if t.total is not None else 1
            self.progress.update(tid, total=done, completed=done)
