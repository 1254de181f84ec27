"""What a signal leaves behind: the temporaries and folders vaeopt made, removed also when the process must end at once.

Python runs a signal handler only between bytecodes of the main thread, so a SIGTERM that arrives during one long
torch operation on the CPU (a conv over a large image can take most of a minute) waits for it to finish. The C-level
handler does note the signal at once, on the wakeup fd; a watchdog thread reads it there, gives the main thread a
short grace to unwind as usual (its handler raises, the temporaries are removed, exit 128 + signal), and where that
does not happen, removes the temporaries itself and ends the process with the same exit code. No torch import here:
the CLI installs it before anything heavy is loaded.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import threading
import time

_lock = threading.Lock()
_temps: set[str] = set()  # temporary files and folders not yet renamed into place
_folders: list[str] = []  # folders made for outputs, innermost first (removed when empty)
_installed = False
GRACE_S = 2.0  # how long the main thread gets to run its handler by itself
_received = 0  # signals the watchdog saw on the wakeup fd
_handled = 0  # signals the main thread's Python handler ran for (handled(): it is responsive, nothing to do)


def handled() -> None:
    """Called by the Python signal handler: the main thread got to it, so it unwinds by itself."""
    global _handled
    _handled += 1


def add_temp(path) -> None:
    with _lock:
        _temps.add(os.fspath(path))


def drop_temp(path) -> None:
    with _lock:
        _temps.discard(os.fspath(path))


def add_folders(folders) -> None:
    """Folders made for outputs (innermost first); removed by remove_all when they are still empty."""
    with _lock:
        _folders[:0] = [os.fspath(f) for f in folders]


def remove_all() -> None:
    """Remove every temporary this process still has, then the folders it made that are empty."""
    with _lock:
        temps, folders = list(_temps), list(_folders)
        _temps.clear()
    for t in temps:
        try:
            if os.path.isdir(t) and not os.path.islink(t):
                shutil.rmtree(t, ignore_errors=True)
            else:
                os.unlink(t)
        except OSError:
            pass
    for f in folders:
        try:
            os.rmdir(f)
        except OSError:
            pass


def exit_promptly_on_signals() -> bool:
    """Start the watchdog for SIGTERM and SIGHUP (once per process; from the main thread, after Python handlers that
    call handled() are installed for them). Returns whether it runs (not where the wakeup fd is taken, e.g. by an
    asyncio loop, or outside the main thread)."""
    global _installed
    if _installed:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        r, w = socket.socketpair()
        r.setblocking(True)
        w.setblocking(False)
        old = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
    except (ValueError, OSError, AttributeError):
        return False
    if old != -1:  # someone else's (an event loop): theirs stays
        signal.set_wakeup_fd(old)
        r.close()
        w.close()
        return False
    wanted = {int(signal.SIGTERM), int(signal.SIGHUP)}

    def watch():
        global _received
        while True:
            try:
                data = r.recv(64)
            except OSError:
                return
            if not data:
                return
            hits = [b for b in data if b in wanted]
            if not hits:
                continue
            _received += len(hits)
            time.sleep(GRACE_S)
            if _handled >= _received:  # the main thread ran its handler: it unwinds (or chose to go on) by itself
                continue
            # the main thread is inside one long operation and cannot run its handler: end here
            hit = hits[0]
            remove_all()
            with contextlib.suppress(OSError):
                os.write(2, (f"\n{signal.Signals(hit).name} during a long operation: stopped at once; temporary "
                             "outputs removed, nothing partial left behind\n").encode())
            os._exit(128 + hit)

    threading.Thread(target=watch, name="vaeopt-signal-watchdog", daemon=True).start()
    _installed = True
    _keep.extend([r, w])  # the sockets live as long as the process
    return True


_keep: list = []
