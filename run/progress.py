"""A progress bar on stderr while weights load and programs compile (rich).

Shown only when stderr is a terminal (and, in a multi-process job, only by process
0), so `--json` output and logs stay clean. It stops before the first streamed token:
a live bar and text streaming to the same terminal would overwrite each other.
"""

from __future__ import annotations

import contextlib
import sys
import time


class Progress:
    def __init__(self, enabled: bool):
        self.bar = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as Bar

            self.bar = Bar(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.fields[detail]}"),
                TimeElapsedColumn(),
                console=Console(file=sys.stderr),
                transient=True,
            )
            self.bar.start()

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def loading(self, source, total_bytes: int):
        """`source` with each read counted against `total_bytes` (this process's share)."""
        if self.bar is None or hasattr(source, "place"):  # a state placed already (bench)
            return source
        task = self.bar.add_task(
            "loading weights", total=total_bytes, detail=f"0/{total_bytes / 1e6:.1f} MB"
        )
        return _Counted(source, self, task)

    @contextlib.contextmanager
    def compiling(self, name: str):
        """Shows that program `name` compiles while the block runs (the engine's
        `on_compile`), and how long it took."""
        if self.bar is None:
            yield
            return
        task = self.bar.add_task(f"compiling {name}", total=None, detail="")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.bar is not None:
                if time.perf_counter() - t0 > 0.05:  # a real compile, not a cache hit
                    self.bar.console.print(f"compiled {name} in {time.perf_counter() - t0:.1f} s")
                self.bar.remove_task(task)

    def counter(self, description: str, total: int):
        """A task of `total` steps shown as "k of N"; returns the callable that counts one
        step (thread-safe: rich's bar takes its own lock)."""
        if self.bar is None:
            return lambda: None
        task = self.bar.add_task(description, total=total, detail=f"0 of {total}")

        def step() -> None:
            if self.bar is not None:
                self.bar.advance(task)
                done = int(self.bar._tasks[task].completed)
                self.bar.update(task, detail=f"{done} of {total}")

        return step

    def done_loading(self) -> None:
        if self.bar is not None:
            for task in list(self.bar.task_ids):
                self.bar.remove_task(task)


class _Counted:
    def __init__(self, source, progress: Progress, task):
        self.source, self.progress, self.task = source, progress, task

    def __getattr__(self, name):
        return getattr(self.source, name)

    def read(self, path, dtype, layers=None, part=None):
        x = self.source.read(path, dtype, layers, part)
        if self.progress.bar is not None:
            bar = self.progress.bar
            bar.advance(self.task, x.nbytes)
            task = bar._tasks[self.task]
            bar.update(self.task, detail=f"{task.completed / 1e6:.1f}/{task.total / 1e6:.1f} MB")
        return x
