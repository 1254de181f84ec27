"""What the commands print: the log on stderr (a write error there never fails a command), stdout for --json
and tables, and how much is said (-q, default, -v)."""

from __future__ import annotations

import contextlib
import sys

from rich.console import Console

from vaeopt.errors import VaeoptError


class _Stderr:
    """sys.stderr (looked up at each write, as rich does, so that test runners' capture sees it) whose write errors
    are dropped: the log is commentary, and a full or closed stderr (`2>/dev/full`) must not fail a decode whose
    output can still be written."""

    @staticmethod
    def _target():
        f = sys.stderr  # during a progress bar, rich's proxy: write where it writes (no loop back into the bar)
        return getattr(f, "rich_proxied_file", None) or f

    def write(self, text: str) -> int:
        with contextlib.suppress(OSError, ValueError):  # ValueError: a closed file
            self._target().write(text)
        return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            self._target().flush()

    def __getattr__(self, name):  # isatty, fileno, encoding ... for rich's terminal detection
        if name == "rich_proxied_file":  # so that rich writes through this wrapper, not around it
            raise AttributeError(name)
        return getattr(self._target(), name)


# emoji=False: a user's text (paths, flags) is printed as typed; rich would turn 'a:x:b.pt' into 'a❌b.pt'
console = Console(file=_Stderr(), highlight=False, soft_wrap=True, emoji=False)  # long paths: let the terminal wrap
# piped or logged (not a terminal): rich would assume 80 columns and cut the benchmark table's cells to "11…"
out_console = Console(highlight=False, emoji=False,
                      width=None if sys.stdout is not None and sys.stdout.isatty() else 200)


# How much a command prints on stderr: 0 = errors only (-q), 1 = a short summary (default), 2 = every stage's line and
# note (-v). Set by each command from its flags; stdout (--json, the benchmark table) is not affected.
level = 1


def set_verbosity(verbose: bool, quiet: bool) -> None:
    global level
    if verbose and quiet:
        raise VaeoptError("-v/--verbose and -q/--quiet contradict each other: give one of them")
    level = 2 if verbose else 0 if quiet else 1


def say(text: str, **kw) -> None:
    """A summary line (rich markup): printed unless -q."""
    if level >= 1:
        console.print(text, **kw)


def log(msg: str) -> None:
    """A note the user should see (a flag ignored, a tensor skipped, a retry): printed unless -q."""
    if level >= 1:
        console.print(f"  {msg}", markup=False)


def detail(msg: str) -> None:
    """A stage line or loading note: printed with -v only."""
    if level >= 2:
        console.print(f"  {msg}", markup=False)


VERBOSE_HELP = "Print every stage's line and the loading notes."
QUIET_HELP = "Print nothing but errors (the exit code still tells success)."
