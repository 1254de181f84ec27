"""How a command ends: a user error is one red line and exit 2 (its own code for some), Ctrl-C 130, SIGTERM/SIGHUP
128 + the signal after the same cleanup; a bug is one line, its traceback only with VAEOPT_DEBUG=1."""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import signal
import sys

import typer
from rich.markup import escape

from vaeopt import cleanup
from vaeopt.cli import printing
from vaeopt.errors import VaeoptError


class _Terminated(KeyboardInterrupt):
    """SIGTERM / SIGHUP, unwound like Ctrl-C (temporary outputs removed) but exiting 128 + the signal number."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_interrupt(signum, frame):
    cleanup.handled()  # the main thread got here: its watchdog stands down
    raise _Terminated(signum)


def _host_oom(e: BaseException) -> bool:
    """torch on the CPU reports a failed allocation as RuntimeError ("DefaultCPUAllocator: can't allocate memory"),
    not MemoryError."""
    return isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


def clean_errors(fn):
    """User errors -> one red line and exit code 2; Ctrl-C -> exit 130; no tracebacks for either."""

    def fail(kw, msg: str, code: int):
        """The error line on stderr; with --json also a JSON document on stdout, so a script reading stdout gets
        one either way."""
        printing.console.print(f"[bold red]error:[/] {escape(msg)}")
        if kw.get("as_json"):
            with contextlib.suppress(OSError, ValueError):
                printing.out_console.print_json(json.dumps({"error": msg, "exit_code": code}))
        raise typer.Exit(code)

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        # kill / docker stop / a closed terminal: unwind like Ctrl-C, so that the temporary outputs are removed
        # (Python's default SIGTERM/SIGHUP handling exits without running any cleanup)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            with contextlib.suppress(ValueError, OSError, AttributeError):  # not the main thread / no SIGHUP
                if signal.getsignal(sig) is not signal.SIG_IGN:  # `nohup` / a supervisor ignoring it: keep that
                    signal.signal(sig, _raise_interrupt)
        cleanup.exit_promptly_on_signals()  # also inside one long torch op (cleanup's docstring says how)
        try:
            return fn(*a, **kw)
        except VaeoptError as e:
            fail(kw, str(e), e.exit_code)  # (escaped: paths/keys like `[x]` are not markup)
        except KeyboardInterrupt as e:
            printing.console.print("[yellow]interrupted — no partial output was left behind[/]")
            raise typer.Exit(128 + e.signum if isinstance(e, _Terminated) else 130)
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except Exception as e:  # a bug, not bad input: one line, the traceback only on request
            if _host_oom(e):
                fail(kw, "out of host memory (smaller inputs; a decode also takes --tile / --chunk / --vram-budget)", 3)
            if isinstance(e, OSError) and getattr(e, "filename", None) is None and e.errno == errno.EPIPE:
                # `vaeopt ... | head -1`: the reader has gone; quietly, with rich's exit code for the same case (1)
                with contextlib.suppress(OSError, ValueError):
                    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
                raise typer.Exit(1)
            if isinstance(e, OSError) and getattr(e, "filename", None) is None and e.errno in (
                    errno.ENOSPC, errno.EBADF):  # printing to a full /dev/full, a closed stdout
                with contextlib.suppress(Exception):
                    printing.console.print("[bold red]error:[/] cannot write the output to stdout "
                                           f"({escape(e.strerror or '')})")
                raise typer.Exit(1)
            if os.environ.get("VAEOPT_DEBUG"):
                raise
            first = str(e).splitlines()[0][:300] if str(e) else ""
            fail(kw, f"unexpected {type(e).__name__}: {first} — this is a vaeopt bug; rerun with VAEOPT_DEBUG=1 for "
                     "the traceback and report it", 1)

    return wrapper
