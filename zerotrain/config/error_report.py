"""How a job or the CLI shows a user's error: one message naming what, where and the fix.

A traceback buries that message, so it is shown only when asked for with
ZEROTRAIN_DEBUG=1 (for bug reports, or when the message is not enough).
"""

from __future__ import annotations

import os
import traceback

from rich.console import Console
from rich.markup import escape

from zerotrain.config.errors import UserInputError

DEBUG_ENV = "ZEROTRAIN_DEBUG"
# Exit status for a bad command line or an invalid config or input, as argparse uses.
USAGE_EXIT_CODE = 2
# Exit status for an error that is not the user's input (a bug, or the environment).
UNEXPECTED_EXIT_CODE = 1


def debug_enabled() -> bool:
    """True when ZEROTRAIN_DEBUG is set to anything but empty, 0, false or no."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def error_console() -> Console:
    # soft_wrap: messages keep their own line breaks instead of being folded at 80 columns.
    return Console(stderr=True, soft_wrap=True)


def print_user_error(
    prefix: str, error: BaseException | str, console: Console | None = None, *, message: str | None = None
) -> None:
    """Prints "PREFIX: message" in red on stderr; with ZEROTRAIN_DEBUG=1, the traceback first.

    `message` replaces str(error) (e.g. the same error with a fix that fits this command).
    An unexpected error (a bug, not the user's input) is named by its type, as a traceback would.
    """
    console = console or error_console()
    if debug_enabled() and isinstance(error, BaseException):
        console.print(escape("".join(traceback.format_exception(type(error), error, error.__traceback__))))
    text = str(error) if message is None else message
    if _is_unexpected(error):
        text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    console.print(f"[red]{escape(prefix)}: {escape(text)}[/]")
    if not debug_enabled() and _is_unexpected(error):
        console.print(f"[dim](set {DEBUG_ENV}=1 for the full traceback)[/]", highlight=False)


def _is_unexpected(error: BaseException | str) -> bool:
    """Errors that are not the user's input (a bug, or the environment): worth a traceback hint.

    The user's input is a config, a file or path, a command line, a checkpoint or a run folder:
    the error classes raised for those say what is wrong and how to fix it by themselves.
    """
    return isinstance(error, BaseException) and not isinstance(error, (UserInputError, ValueError, OSError))
