"""Progress of tokenizing a corpus, shown on rank 0 while the token cache is built.

On a terminal: a rich progress bar (over input bytes, or documents for generated
data), for inputs big enough to wait for. Elsewhere (a log file, a pipe, a test
capturing output) nothing is redrawn: a few plain lines instead, one when
tokenizing starts, one at each quarter of a run that takes a while, one at the end:

    tokenizing train.jsonl (48.0 MB)
    tokenizing train.jsonl: 25% (12.0/48.0 MB, 50,000 documents)
    tokenized train.jsonl: 200,000 documents, 41,263,104 tokens in 38.2 s
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console

# Inputs smaller than this tokenize in about a second: no bar on a terminal.
BAR_MIN_BYTES = 8 << 20
BAR_MIN_DOCUMENTS = 50_000
# Quarter lines only once a run has lasted this long: a quick one gets its start and end lines only.
QUARTER_LINES_AFTER_S = 2.0


class TokenizeProgress:
    """Counts bytes read and documents tokenized and reports them (a context manager).

    `total_bytes` (0 if unknown) or `total_documents` (None if unknown) sets the scale;
    `enabled=False` (ranks other than 0) reports nothing.
    """

    def __init__(self, label: str, *, total_bytes: int = 0, total_documents: int | None = None,
                 enabled: bool = True, console: Console | None = None) -> None:
        self.label = label
        self.total_bytes = total_bytes
        self.total_documents = total_documents
        self.enabled = enabled
        # soft_wrap: a long file name stays on its line instead of folding at 80 columns in a log.
        self.console = console or Console(stderr=True, soft_wrap=True)
        self.bytes = 0
        self.documents = 0
        self._started = time.perf_counter()
        self._next_quarter = 1
        self._bar: Any = None
        self._task: Any = None

    # --- what the readers and the tokenizer call ----------------------------------------------

    def advance_bytes(self, n: int) -> None:
        """The readers' callback: `n` more bytes of input consumed."""
        self.bytes += n
        if self._bar is not None and self.total_bytes:
            self._bar.update(self._task, completed=self.bytes)
        self._maybe_quarter()

    def count_document(self) -> None:
        """One more document handed to the tokenizer."""
        self.documents += 1
        if self._bar is not None and not self.total_bytes:
            self._bar.update(self._task, completed=self.documents)
        if not self.total_bytes:
            self._maybe_quarter()

    def finish(self, num_documents: int, num_tokens: int) -> None:
        """The closing line: what was tokenized and how long it took."""
        if self.enabled:
            seconds = time.perf_counter() - self._started
            self._print(f"tokenized {self.label}: {num_documents:,} documents, {num_tokens:,} tokens "
                        f"in {seconds:.1f} s")

    # --- display ---------------------------------------------------------------------------------

    def __enter__(self) -> "TokenizeProgress":
        if not self.enabled:
            return self
        self._started = time.perf_counter()
        if self.console.is_terminal and self._worth_a_bar():
            from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn
            from rich.progress import TimeRemainingColumn

            count = DownloadColumn() if self.total_bytes else MofNCompleteColumn()
            self._bar = Progress(TextColumn(f"tokenizing {self.label}"), BarColumn(), count, TimeRemainingColumn(),
                                 console=self.console, transient=True)
            self._bar.__enter__()
            self._task = self._bar.add_task("tokenize", total=self.total_bytes or self.total_documents)
        else:
            self._print(f"tokenizing {self.label}" + (f" ({_mb(self.total_bytes)})" if self.total_bytes else ""))
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
            self._bar = None

    def _worth_a_bar(self) -> bool:
        return self.total_bytes >= BAR_MIN_BYTES or (self.total_documents or 0) >= BAR_MIN_DOCUMENTS

    def _fraction(self) -> float | None:
        if self.total_bytes:
            return self.bytes / self.total_bytes
        if self.total_documents:
            return self.documents / self.total_documents
        return None

    def _maybe_quarter(self) -> None:
        """A plain line at each quarter (25, 50, 75%) reached, once the run has lasted a while."""
        if not self.enabled or self._bar is not None or self._next_quarter > 3:
            return
        fraction = self._fraction()
        if fraction is None or fraction < self._next_quarter / 4:
            return
        while self._next_quarter <= 3 and fraction >= self._next_quarter / 4:
            self._next_quarter += 1
        if time.perf_counter() - self._started < QUARTER_LINES_AFTER_S:
            return
        done = (f"{_mb(self.bytes, unit=False)}/{_mb(self.total_bytes)}, {self.documents:,} documents"
                if self.total_bytes else f"{self.documents:,}/{self.total_documents:,} documents")
        self._print(f"tokenizing {self.label}: {fraction:.0%} ({done})")

    def _print(self, line: str) -> None:
        self.console.print(line, markup=False, highlight=False)


def _mb(n: int, unit: bool = True) -> str:
    return f"{n / 1e6:.1f}" + (" MB" if unit else "")
