"""`vaeopt` command line. Each command is one thin function in its own module (info.py, decode.py, benchmark.py,
warmup.py, serve.py): it checks its arguments, calls vaeopt's API and prints. What they share: printing.py (the
consoles, -q/-v), exits.py (errors -> exit codes), paths.py (decode's input and -o checks), report.py (decode's
messages, progress bar).

A new command: a function decorated with @clean_errors in vaeopt/cli/<name>.py, added to COMMANDS below. Command
modules import torch only inside the command, after its arguments are checked: a typo is reported at once."""

import atexit
import os
import sys
import threading

import typer

from vaeopt import __version__
from vaeopt.cli import benchmark, decode, info, printing, serve, warmup

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never touch the network
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")  # its per-call dtype warnings are noise here


def _flags_show_no_type() -> None:
    """typer's rich help prints a flag's type like an option's value (`--overwrite <bool>`, `--help <bool>`), as if
    the flag took one; show nothing there, as plain click help does for flags."""
    import typer.core

    cls = getattr(typer.core, "TyperOption", None)
    orig = getattr(cls, "display_type_rich", None)
    if orig is None or getattr(orig, "_vaeopt_flag", False):
        return

    def display_type_rich(self, ctx):
        if getattr(self, "is_flag", False) and not getattr(self, "count", False):
            return None
        return orig(self, ctx)

    display_type_rich._vaeopt_flag = True
    cls.display_type_rich = display_type_rich


_flags_show_no_type()

app = typer.Typer(
    help="Fast, memory-aware, fidelity-checked VAE decoding for latent diffusion "
    "(SD 1.x/2.x, SDXL, SD3, FLUX.1/FLUX.2, Wan 2.1/2.2, Qwen-Image, HunyuanVideo 1/1.5, LTX-2, TAESD).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version_cb(value: bool):
    if value:
        printing.out_console.print(f"vaeopt {__version__}")
        raise typer.Exit()


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=_version_cb, is_eager=True,
                                      help="Show the version and exit.")):
    pass


# The commands, in the order `vaeopt --help` lists them.
COMMANDS = (info.info, decode.decode, benchmark.benchmark, warmup.warmup, serve.serve)
for command in COMMANDS:
    app.command()(command)


FAST_EXIT_ENV = "VAEOPT_FAST_EXIT"  # "off": leave through the interpreter's full teardown


def run() -> None:
    """`vaeopt` as a process (the console script, `python -m vaeopt`): the command, then an exit that skips the
    interpreter's teardown. With torch and diffusers loaded, that teardown frees every module and object one by one,
    and torch's CUDA state with them: a second or two after the output is on disk, for nothing the operating system
    would not do at once. What a process owes on its way out still happens: the atexit handlers run (logging,
    coverage, multiprocessing's children), stdout and stderr are flushed, and the exit status is the command's.
    The full teardown is kept where someone is watching it: a tracer or profiler (pdb, cProfile, coverage by
    tracing) writes its results after the command returns, a thread that is not a daemon is still working, or
    VAEOPT_FAST_EXIT=off."""
    try:
        app()  # click's standalone mode: it ends in SystemExit with the command's status
        code = 0
    except SystemExit as e:
        code = e.code
    if not _may_exit_fast():
        raise SystemExit(code)
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): printed, status 1, as Python itself does
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
    except (OSError, ValueError):  # a closed pipe: Python's own exit reports this as status 120
        code = code or 120
    try:
        sys.stderr.flush()
    except (OSError, ValueError):  # (2>/dev/full: the log was best effort; the outputs are written)
        pass
    os._exit(code)


def _may_exit_fast() -> bool:
    if os.environ.get(FAST_EXIT_ENV, "").strip().lower() in ("off", "0", "no", "false"):
        return False
    if sys.gettrace() is not None or sys.getprofile() is not None or not hasattr(atexit, "_run_exitfuncs"):
        return False
    return not any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread())
