"""Writing decoded images and videos: PNG, MP4 (H.264 via PyAV), PNG frame folders, raw .safetensors.

Every file is written to a temporary name in the same directory and renamed into place only when complete, so an
error, a full disk or Ctrl-C never leaves a half-written output.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import hashlib
import itertools
import os
import queue
import re
import shutil
import stat
import tempfile
import threading
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

from vaeopt import cleanup
from vaeopt.errors import OutputError

if TYPE_CHECKING:  # annotations only: the CLI checks -o with this module before torch loads
    import torch

IMAGE_SUFFIXES = (".png",)
VIDEO_SUFFIXES = (".mp4",)
TENSOR_SUFFIXES = (".safetensors",)
OUTPUT_SUFFIXES = IMAGE_SUFFIXES + VIDEO_SUFFIXES + TENSOR_SUFFIXES


def unknown_type(where: str, suffix: str) -> str:
    """The message for an -o whose suffix names no output vaeopt writes (the CLI checks before the load, plan_jobs
    again for every output)."""
    return f"{where}: unknown output type '{suffix}' (use .png, .mp4, .safetensors, or a folder for frames)"


# The MP4's colour: BT.709 in limited (TV) range, and the stream tagged so, which is what players assume for HD video
# (PyAV's default BT.601, untagged, showed pure green as (0, 215, 0); experiments.md E36). sRGB's primaries are 709's.
_BT709 = 1  # the value of AVCOL_SPC_BT709, AVCOL_PRI_BT709 and AVCOL_TRC_BT709 alike
_TV_RANGE = 1  # AVCOL_RANGE_MPEG


def frame_rate(fps: float) -> Fraction:
    """The MP4's frame rate as a fraction: the NTSC rates written as rounded decimals (23.976, 29.97, 59.94) are
    the broadcast 24000/1001, 30000/1001, 60000/1001; any other rate, its nearest fraction with a denominator of at
    most 1001."""
    for n in (24000, 30000, 48000, 60000, 120000):
        if abs(fps - n / 1001) < 5e-4 * n / 1001:
            return Fraction(n, 1001)
    return Fraction(fps).limit_denominator(1001)


def _os_error(path: Path, e: OSError, left: str = "nothing of it was left behind") -> OutputError:
    if e.errno == errno.ENOSPC:
        return OutputError(f"{path}: disk full while writing ({left})")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return OutputError(f"{path}: not writable ({e.strerror})")
    return OutputError(f"{path}: cannot write ({e.strerror or e})")


class AppearedError(OutputError):
    """The output did not exist when it was checked, but something else put it there while this one was made."""


def _appeared(path: Path) -> AppearedError:
    return AppearedError(f"{path}: appeared while this output was being made (another decode writing the same path?); "
                         "it was kept and this output was not written (pass --overwrite to replace it)")


def _empty_real_dir(p: Path) -> bool:
    return p.is_dir() and not p.is_symlink() and not any(p.iterdir())


def _commit_no_clobber(tmp: Path, path: Path) -> None:
    """Move the finished temp file or folder to `path` unless something is there by now (a symlink included, dangling
    or not): an output checked free before a minutes-long decode can have been written meanwhile (two runs with the
    same -o). A file is hard-linked into place (atomic, fails if the name exists, never follows a link there), then
    its temp name removed; where the file system has no hard links, the name is checked just before the rename. A
    folder is renamed: rename(2) replaces only an empty folder (the one `-o clip/` makes before decoding) and fails
    on one that holds files, on a file and on a link."""
    if tmp.is_dir():
        if os.path.lexists(path) and not _empty_real_dir(path):
            raise _appeared(path)
        try:
            os.rename(tmp, path)
        except OSError as e:
            if _empty_real_dir(path):  # Windows: rename never replaces a folder, even empty
                try:
                    path.rmdir()
                    os.rename(tmp, path)
                    return
                except OSError:
                    pass
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR) or os.path.lexists(path):
                raise _appeared(path) from None
            raise
        return
    try:
        os.link(tmp, path, follow_symlinks=False)
    except FileExistsError:
        raise _appeared(path) from None
    except (OSError, NotImplementedError) as e:
        if isinstance(e, OSError) and e.errno not in (
                errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK, errno.ENOSYS,
                errno.EINVAL):  # (EINVAL: FAT / exFAT on Windows)
            raise
        if os.path.lexists(path):  # no hard links here (FAT, some FUSE mounts): the check is as late as it can be
            raise _appeared(path) from None
        os.replace(tmp, path)
        return
    _remove(tmp)


def _commit_replacing(tmp: Path, path: Path) -> None:
    """--overwrite: put the finished temp file or folder at `path`, replacing what is there. A symbolic link there is
    replaced by the output (the link itself, never the file it points to); a frames folder is swapped for the new
    one (moved aside, the new one renamed in, the old one removed; put back if the rename fails)."""
    if tmp.is_dir() and path.is_dir() and not path.is_symlink():  # os.replace cannot replace a non-empty folder
        old = Path(tempfile.mkdtemp(prefix=f".{path.name[:180]}.", suffix=".old", dir=path.parent))
        os.replace(path, old)  # (onto the empty folder just made)
        try:
            os.replace(tmp, path)
        except BaseException:
            os.replace(old, path)  # put the previous output back
            raise
        _remove(old)
    elif tmp.is_dir() and os.path.lexists(path) and (path.is_symlink() or not path.is_dir()):
        os.unlink(path)  # a link (or file) where a folder goes: rename(2) puts a folder only on a folder or nothing
        os.rename(tmp, path)
    else:
        with contextlib.suppress(OSError):  # the replaced file's permissions stay (a private 0600 render stays
            st = os.lstat(path)             # private), as an editor's save keeps them; a new name gets the umask's
            if stat.S_ISREG(st.st_mode) and not tmp.is_dir():
                os.chmod(tmp, stat.S_IMODE(st.st_mode))
        os.replace(tmp, path)  # rename(2): replaces a link itself, never writes through it


def _commit(tmp: Path, path: Path, overwrite: bool) -> None:
    (_commit_replacing if overwrite else _commit_no_clobber)(tmp, path)
    cleanup.drop_temp(tmp)


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _read_umask()  # once, at import: setting it briefly races with other threads creating files


def _new_temp(path: Path, folder: bool = False) -> Path:
    """A fresh temporary file (or folder) beside `path`, created exclusively under an unpredictable name: O_EXCL
    refuses any name that exists, a symbolic link included, so no one can point the write elsewhere by placing a link
    where vaeopt will write. Permissions as an ordinary new file's (umask applied), not mkstemp's 0600."""
    parent = path.parent
    prefix = f".{path.name}."
    if len(os.fsencode(prefix)) > 200:  # a long but valid name: keep the temp name within the file system's limit
        prefix = f".vaeopt.{hashlib.sha1(os.fsencode(path.name)).hexdigest()[:16]}."
    # the suffix kept (writers that pick a format by it still can), unless a folder's name has a long dotted part
    suffix = ".partial" + (path.suffix if len(path.suffix) <= 16 else "")
    if folder:
        tmp = Path(tempfile.mkdtemp(prefix=prefix, suffix=suffix, dir=parent))
        mode = 0o777
    else:
        fd, name = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=parent)
        os.close(fd)
        tmp, mode = Path(name), 0o666
    cleanup.add_temp(tmp)  # (removed by its signal watchdog if the process must end inside a long operation)
    with contextlib.suppress(OSError):
        os.chmod(tmp, mode & ~_UMASK)
    return tmp


class _Landing:
    """Outputs that land together (the images of one batch): each finished one waits under its temporary name, and
    all are renamed into place at the end; on any failure every temporary and every output this batch already put
    in place are removed again."""

    def __init__(self, paths: list[Path], overwrite: bool):
        self.paths = list(paths)
        self.overwrite = overwrite
        self.ready: list[tuple[Path, Path]] = []  # (temporary, output), in order
        self.made: list[Path] = []  # folders made for the batch's outputs (removed with it, when empty)

    def names(self) -> str:
        ps = self.paths
        return ", ".join(map(str, ps)) if len(ps) <= 3 else f"{ps[0]} .. {ps[-1].name}"

    def discard(self) -> None:
        for tmp, _ in self.ready:
            _remove(tmp)
        self.ready.clear()
        remove_empty(self.made)

    def commit(self) -> None:
        placed: list[Path] = []
        try:
            for tmp, path in self.ready:
                _commit(tmp, path, self.overwrite)
                placed.append(path)
        except BaseException as e:
            left = [tmp for tmp, path in self.ready if path not in placed]
            for tmp in left:
                _remove(tmp)
            if not self.overwrite:  # the ones placed are new files of this run: removed, so none of the batch stays
                for p in placed:
                    _remove(p)
                remove_empty(self.made)
                what = f"none of the batch's {len(self.paths)} outputs was written"
            else:
                shown = ", ".join(map(str, placed[:3])) + (", ..." if len(placed) > 3 else "")
                what = (f"{len(placed)} of the batch's {len(self.paths)} outputs were replaced"
                        + (f" ({shown})" if placed else "") + ", the others keep what was there")
            if isinstance(e, AppearedError):
                raise AppearedError(f"{e}; {what}") from None
            if isinstance(e, OSError):
                raise _os_error(self.ready[len(placed)][1], e, what) from None
            raise
        finally:
            self.ready.clear()


_landing: contextvars.ContextVar[_Landing | None] = contextvars.ContextVar("vaeopt_landing", default=None)


@contextlib.contextmanager
def land_together(paths: list[Path], overwrite: bool) -> Iterator[None]:
    """The outputs written inside this block (by write_png, write_mp4, write_frames_dir, write_tensor) are renamed
    into place together when it ends, or none of them is: a full disk at the 2nd of 4 images leaves no 1st image
    behind, and the error says so."""
    if len(paths) < 2:
        yield
        return
    land = _Landing(paths, overwrite)
    token = _landing.set(land)
    try:
        yield
    except OutputError as e:
        land.discard()
        msg = str(e)
        if msg.endswith("(nothing of it was left behind)"):
            msg = msg[: -len("(nothing of it was left behind)")] + f"(none of the batch's {len(paths)} outputs " \
                                                                   f"was written: {land.names()})"
        else:
            msg += f"; none of the batch's {len(paths)} outputs was written"
        raise type(e)(msg) from None
    except BaseException:
        land.discard()
        raise
    finally:
        _landing.reset(token)
    land.commit()


@contextlib.contextmanager
def atomic_path(path: Path, overwrite: bool = True, folder: bool = False) -> Iterator[Path]:
    """Yield a temporary file (folder=True: folder) made beside `path`; rename it to `path` on success, delete it on any
    failure. The name `path` is never followed: a symbolic link there is refused (overwrite=False) or replaced by the
    output itself (overwrite=True), never written through. overwrite=False: an output that appeared at `path` while
    this one was made is kept, and AppearedError raised (nothing of ours left). Inside land_together the rename waits
    for the end of the batch."""
    path = Path(path)
    land = _landing.get()
    made = _make_parents(path.parent)  # removed again (if still empty) when this output, or its batch, fails
    if land is not None:
        land.made += made
    try:
        try:
            tmp = _new_temp(path, folder)
        except OSError as e:
            raise _os_error(path, e) from e
        try:
            yield tmp
            if land is not None and path in land.paths:
                land.ready.append((tmp, path))
            else:
                _commit(tmp, path, overwrite)
        except OSError as e:
            _remove(tmp)
            raise _os_error(path, e) from e
        except BaseException:
            _remove(tmp)
            raise
    except BaseException:
        remove_empty(made)
        raise


def _make_parents(folder: Path) -> list[Path]:
    """Make `folder` and the folders above it that are missing; return those made, innermost first."""
    made = list(itertools.takewhile(lambda p: not os.path.lexists(p), [folder, *folder.parents]))
    if made:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            remove_empty(made)
            raise _os_error(folder, e) from e
        cleanup.add_folders(made)
    return made


def remove_empty(folders: list[Path]) -> None:
    """Remove the folders this process made, innermost first, as far as they are empty."""
    for p in folders:
        try:
            p.rmdir()
        except OSError:
            break


def _filled_in_place(folder: Path) -> bool:
    """An existing empty frames folder that no rename can replace (a mount point, or its parent not writable):
    write_frames_dir fills it file by file instead, and check_writable checks the folder itself."""
    return (folder.is_dir() and not folder.is_symlink() and not any(folder.iterdir())
            and (os.path.ismount(folder) or not os.access(folder.parent, os.W_OK)))


def _remove(p: Path) -> None:
    cleanup.drop_temp(p)
    try:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    except OSError:  # gone already, or never made (e.g. a name the file system refused)
        pass


NAME_MAX = 255  # bytes in one file name (ext4, XFS, btrfs, APFS, NTFS in UTF-16 units)


def check_name_length(p: Path) -> None:
    """Output names made from a long input name, a dict key or a batch number can pass the file system's limit:
    caught before decoding (the OS would refuse the file after the whole decode)."""
    n = len(os.fsencode(p.name))
    if n > NAME_MAX:
        raise OutputError(f"{p.name[:40]}...: this output's file name is {n} bytes, more than the {NAME_MAX} a file "
                          "system takes; give a shorter -o (or rename the input)")


def _kind_of(p: Path) -> str | None:
    """What a name that exists but is neither a file, a folder nor a link is ("a FIFO"...), else None."""
    import stat

    try:
        m = os.lstat(p).st_mode
    except OSError:
        return None
    if stat.S_ISREG(m) or stat.S_ISDIR(m) or stat.S_ISLNK(m):
        return None
    return ("a FIFO (named pipe)" if stat.S_ISFIFO(m) else "a socket" if stat.S_ISSOCK(m)
            else "a device" if stat.S_ISCHR(m) or stat.S_ISBLK(m) else "not a regular file")


def _not_a_file(shown, kind: str) -> OutputError:
    return OutputError(f"{shown}: a device, pipe or socket, not a folder or a .png/.mp4/.safetensors file, which is "
                       f"what -o takes; vaeopt never replaces {kind}, even with --overwrite (to decode without "
                       "writing, time it with vaeopt benchmark)")


def check_writable(paths: list[Path], overwrite: bool, folders: set[Path] | frozenset = frozenset()) -> None:
    """Fail before decoding (not after minutes of work) if an output exists or its folder can't be written.
    folders: the outputs that are folders (PNG frames); --overwrite replaces a file with a file, a folder with a
    folder, and only a folder of frames (an existing folder is a folder output whatever its name, so `-o renders`
    may name one that holds other files). An empty folder where a frames folder goes is used as it is (nothing in it
    to lose: e.g. `-o clip/`, which the CLI makes before planning). The output's own name is never followed: a
    symbolic link there, dangling or not, is an existing name (refused without --overwrite; with it, the link itself
    is replaced by the output, and what it points to is left alone). A FIFO, socket or device is never replaced."""
    probed: set[Path] = set()
    for p in paths:
        folder = p in folders
        check_name_length(p)
        if (kind := _kind_of(p)) is not None:
            raise _not_a_file(p, kind)
        if p.is_symlink():
            if not overwrite:
                raise OutputError(f"{p}: already exists, as a symbolic link (to {os.readlink(p)}); vaeopt never writes "
                                  "through a link: pass --overwrite to replace the link itself with the output (what "
                                  "it points to is left alone), or choose another -o")
            check_folder(p.parent, str(p), probed)
            continue
        empty_folder = folder and _empty_real_dir(p)
        if p.exists() and not overwrite and not empty_folder:
            raise OutputError(f"{p}: already exists (pass --overwrite to replace it)")
        if p.exists() and p.is_dir() != folder:
            what, want = ("a folder", "a file") if p.is_dir() else ("a file", "a folder of frames")
            raise OutputError(f"{p}: is {what}; this output is {want}, so --overwrite cannot replace it")
        other = next((q.name for q in p.iterdir() if not _FRAME_NAME.fullmatch(q.name) and q.name not in _OS_FILES),
                     None) if p.is_dir() else None
        if other is not None:
            raise OutputError(f"{p}: holds files other than PNG frames (e.g. {other}); --overwrite replaces only a "
                              "folder of frames: choose another -o")
        if folder and _filled_in_place(p):
            if not os.access(p, os.W_OK):
                raise OutputError(f"{p}: folder is not writable")
            continue
        if folder and p.is_dir() and os.path.ismount(p):
            raise OutputError(f"{p}: is a mount point holding frames; --overwrite replaces a frames folder as a whole "
                              "(a rename), which a mount point does not allow: empty it, or choose a folder inside it")
        check_folder(p.parent, str(p), probed)


def check_output_folder(output: Path, is_folder: bool, shown: str) -> None:
    """-o checked before anything is loaded: not a FIFO, socket or device (`-o /dev/null`), and the folder its files
    go to (it, when it is a folder; else the one it is in) can be written (check_folder)."""
    if (kind := _kind_of(output)) is not None:
        raise _not_a_file(shown, kind)
    check_folder(output if is_folder or output.is_dir() else output.parent, shown)


def check_folder(folder: Path, shown: str, probed: set | None = None) -> None:
    """Fail unless outputs can be made in `folder` (or, where it does not exist yet, in the nearest folder above it,
    where it will be made): a folder, writable by os.access, and a file can really be created there (root passes
    os.access anywhere, also in /proc or on a read-only mount). probed: folders already tried, not tried again."""
    probe = folder
    while not probe.exists():
        if probe.is_symlink():  # mkdir would fail on it after the whole decode ("File exists")
            try:
                os.stat(probe)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise OutputError(f"{shown}: not a usable output path ({probe} is a symlink loop)") from None
            raise OutputError(f"{shown}: {probe} is a broken symlink, not a folder")
        probe = probe.parent
    if not probe.is_dir():
        raise OutputError(f"{shown}: {probe} is a file, not a folder")
    if not os.access(probe, os.W_OK):
        raise OutputError(f"{shown}: folder {probe} is not writable")
    if probed is not None and probe in probed:
        return
    try:  # a file made and removed at once: what os.access cannot tell (a pseudo file system, a read-only mount)
        fd, tmp = tempfile.mkstemp(prefix=".vaeopt-probe.", dir=probe)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise OutputError(f"{shown}: cannot write files in {probe} ({e.strerror or e})") from None
    if probed is not None:
        probed.add(probe)


_FRAME_NAME = re.compile(r"frame_\d+\.png")  # what write_frames_dir writes
_OS_FILES = frozenset({".DS_Store", "Thumbs.db", "desktop.ini"})  # a file browser's, in a folder it has shown


def to_uint8_images(x: torch.Tensor, on_device: bool = False) -> torch.Tensor:
    """Decoder output in [-1, 1], (N,3,H,W) or (N,3,T,H,W) -> uint8 channels-last (N,H,W,3) / (N,T,H,W,3) on CPU
    (on_device=True: where x is, so that a GPU's output crosses to the host as a quarter of the bytes).
    For x in [-1, 1] the bytes equal diffusers' VaeImageProcessor.postprocess(x, "pil"), round((x/2 + 0.5) * 255):
    halving and adding 0.5 is (x + 1) / 2 with the same float32 rounding, and the product is the same real number."""
    x = x.detach()
    import torch  # here, not at the top: the CLI checks -o with this module before torch loads

    y = ((x.float() + 1.0) * 127.5).round_().clamp_(0, 255).to(torch.uint8)
    y = y.movedim(1, -1)
    return y.contiguous() if on_device else y.cpu().contiguous()


def _save_png(target: Path, image_hwc: torch.Tensor) -> None:
    """One uint8 (H,W,3) image as a PNG file at `target` (a temporary that atomic_path made)."""
    from PIL import Image

    Image.fromarray(image_hwc.numpy()).save(target, format="PNG")


def write_png(path: Path, image_hwc: torch.Tensor, overwrite: bool = True) -> None:
    with atomic_path(path, overwrite) as tmp:
        _save_png(tmp, image_hwc)


def write_frames_dir(path: Path, frames_thwc: Iterable[torch.Tensor], overwrite: bool = True) -> int:
    """PNG frames frame_00000.png... into a folder, made atomically (temp folder + rename). Where no rename can put
    the folder in place, an existing empty one is filled in place instead, one atomic file at a time, and emptied
    again on failure: a mount point (a Docker volume), or a folder whose parent is not writable. (A killed process
    can leave some frames there, which a rename would not.)"""
    path = Path(path)
    n = 0
    if _filled_in_place(path):
        written = []
        try:
            for chunk in frames_thwc:
                for frame in chunk:
                    f = path / f"frame_{n:05d}.png"
                    with atomic_path(f, overwrite) as tmp:
                        _save_png(tmp, frame)
                    written.append(f)  # (after the commit: a frame another run put there is not ours to remove)
                    n += 1
        except BaseException:
            for f in written:
                _remove(f)
            raise
        return n
    with atomic_path(path, overwrite, folder=True) as tmp:
        for chunk in frames_thwc:
            for frame in chunk:
                _save_png(tmp / f"frame_{n:05d}.png", frame)
                n += 1
    return n


def write_tensor(path: Path, x: torch.Tensor, metadata: dict | None = None, overwrite: bool = True) -> None:
    from safetensors.torch import save_file

    with atomic_path(path, overwrite) as tmp:
        try:
            save_file({"sample": x.detach().float().cpu().contiguous()}, str(tmp), metadata=metadata or {})
        except OSError:
            raise
        except Exception as e:  # noqa: BLE001  safetensors reports I/O errors as SafetensorError
            if "No space left" in str(e):
                raise OSError(errno.ENOSPC, "No space left on device") from None
            raise OutputError(f"{path}: cannot write ({str(e).splitlines()[0][:160]})") from None
        os.chmod(tmp, 0o666 & ~_UMASK)  # safetensors creates 0600; as PNG/MP4 files are created


class Mp4Writer:
    """H.264 MP4 writer fed from a bounded queue by the decode loop and encoded on a background thread, so that
    decoding, device-to-host copies and encoding overlap. Frames: uint8 (T,H,W,3) CPU tensors."""

    def __init__(self, path: Path, fps: float = 16.0, crf: int = 18, max_queue: int = 4, overwrite: bool = True):
        self.path = Path(path)
        self.fps = fps
        self.crf = crf
        self._q: queue.Queue = queue.Queue(maxsize=max_queue)
        self._error: BaseException | None = None
        self._aborted = False
        self._ctx = atomic_path(self.path, overwrite)
        self._tmp = self._ctx.__enter__()
        self.frames = 0
        self._thread = threading.Thread(target=self._run, name="vaeopt-mp4", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            import av
            from av.video.reformatter import ColorRange, Colorspace, VideoReformatter

            to_yuv = VideoReformatter()  # one scaler context for the whole clip, as the encoder keeps its own
            with av.open(str(self._tmp), mode="w", format="mp4") as container:
                stream = None
                while True:
                    item = self._q.get()
                    if item is None:
                        break
                    for frame in item:
                        if stream is None:
                            h, w = frame.shape[:2]
                            stream = container.add_stream("libx264", rate=frame_rate(self.fps))
                            # yuv420p needs even sizes; pad by edge replication if odd (rare: VAE outputs are x8).
                            stream.width, stream.height = w + (w % 2), h + (h % 2)
                            stream.pix_fmt = "yuv420p"
                            stream.options = {"crf": str(self.crf)}
                            # frame threads (libx264's count): twice as fast as PyAV's default slice threads, so
                            # a Wan decode does not wait for the encoder (experiments.md E34)
                            stream.codec_context.thread_type = "FRAME"
                            cc = stream.codec_context  # (written into the H.264 VUI, where players read it)
                            cc.colorspace = cc.color_primaries = cc.color_trc = _BT709
                            cc.color_range = _TV_RANGE
                        arr = frame.numpy()
                        if arr.shape[0] % 2 or arr.shape[1] % 2:
                            import numpy as np

                            arr = np.pad(arr, ((0, arr.shape[0] % 2), (0, arr.shape[1] % 2), (0, 0)), mode="edge")
                        yuv = to_yuv.reformat(av.VideoFrame.from_ndarray(arr, format="rgb24"), format="yuv420p",
                                              dst_colorspace=Colorspace.ITU709, dst_color_range=ColorRange.MPEG)
                        for packet in stream.encode(yuv):
                            container.mux(packet)
                        self.frames += 1
                if stream is not None:
                    for packet in stream.encode():
                        container.mux(packet)
        except BaseException as e:  # surfaced to the caller in put()/close()
            self._error = e
            # drain so a producer blocked on put() wakes up
            with contextlib.suppress(queue.Empty):
                while True:
                    self._q.get_nowait()
        finally:
            if self._aborted:  # abort() gave up waiting (a second Ctrl-C): the file this thread made goes too
                _remove(self._tmp)

    def put(self, frames_thwc: torch.Tensor) -> None:
        if self._error is not None:
            self.abort()
            raise self._wrap(self._error)
        while True:
            try:
                self._q.put(frames_thwc, timeout=0.5)
                return
            except queue.Full:
                if self._error is not None or not self._thread.is_alive():
                    self.abort()
                    raise self._wrap(self._error or RuntimeError("encoder thread died"))

    def _wrap(self, e: BaseException) -> BaseException:
        if isinstance(e, OSError):
            return _os_error(self.path, e)
        if isinstance(e, OutputError):
            return e
        return OutputError(f"{self.path}: video encoding failed ({e})")

    def close(self) -> int:
        self._q.put(None)
        self._thread.join()
        if self._error is not None:
            self.abort()
            raise self._wrap(self._error)
        if self.frames == 0:
            self.abort()
            raise OutputError(f"{self.path}: no frames to write")
        self._ctx.__exit__(None, None, None)
        return self.frames

    def abort(self) -> None:
        """Drop the partial file (Ctrl-C, errors), also if a second Ctrl-C / SIGTERM lands while the encoder thread
        is being stopped (unlinked, the file's last writes go nowhere)."""
        self._aborted = True
        try:
            if self._thread.is_alive():
                with contextlib.suppress(queue.Full):
                    self._q.put_nowait(None)
                self._thread.join(timeout=10)
        finally:
            _remove(self._tmp)


def write_mp4(path: Path, chunks: Iterable[torch.Tensor], fps: float = 16.0, overwrite: bool = True) -> int:
    writer = Mp4Writer(path, fps=fps, overwrite=overwrite)
    try:
        for chunk in chunks:
            writer.put(chunk)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def safe_name(name: str) -> str:
    """A latent dict key as part of a file name: letters, digits, '-' and '_' kept, the rest '_' (a key such as
    'x/../../y' must not reach outside the output folder)."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


def distinct_stems(inputs: list[Path], one_folder: bool) -> dict[Path, str]:
    """The stem each input's outputs are named after: its own, unless another input has the same one. Outputs that go
    to one folder (one_folder: -o a folder, or a file name that several inputs extend) tell such inputs apart by the
    names of their folders, going up as far as needed (a/lat.pt, b/lat.pt -> a_lat, b_lat; x/a/lat.pt, y/a/lat.pt ->
    x_a_lat, y_a_lat); inputs in one folder (or outputs beside their inputs) by their suffix (lat.pt, lat.npy ->
    lat_pt, lat_npy)."""
    groups: dict[tuple, list[Path]] = {}
    for p in inputs:
        where = () if one_folder else (os.path.abspath(p.parent),)
        groups.setdefault((*where, p.stem), []).append(p)
    stems = {p: p.stem for p in inputs}
    for same in groups.values():
        if len(same) < 2:
            continue
        folders = [[safe_name(x) for x in Path(os.path.abspath(p.parent)).parts[1:]] for p in same]
        depth = max(map(len, folders)) if one_folder else 0
        for suffixed in (False, True):  # folders first; the suffix where folders alone do not tell them apart
            for k in range(1 if one_folder and not suffixed else 0, depth + 1):
                names = ["_".join(f[max(0, len(f) - k):] + [p.stem + (f"_{safe_name(p.suffix[1:])}" if suffixed
                                                                      else "")]) for f, p in zip(folders, same)]
                if len(set(names)) == len(names):
                    stems.update(zip(same, names))
                    break
            else:
                continue
            break
    return stems


def default_output(latent_path: Path, is_video: bool, entry_name: str = "", index: int | None = None,
                   stem: str | None = None) -> Path:
    """Beside the input, named after it (or after `stem`: distinct_stems)."""
    stem = stem or latent_path.stem
    if entry_name:
        stem += "_" + safe_name(entry_name)
    if index is not None:
        stem += f"_{index:03d}"
    return latent_path.with_name(stem + (".mp4" if is_video else ".png"))


def numbered(path: Path, index: int, count: int) -> Path:
    """out.png -> out_000.png for batches (a folder output stays a folder per item)."""
    if count == 1:
        return path
    width = max(3, len(str(count - 1)))  # _0000.._1000 for 1001 items, so that names sort in batch order
    if path.suffix:
        return path.with_name(f"{path.stem}_{index:0{width}d}{path.suffix}")
    return path.with_name(f"{path.name}_{index:0{width}d}")
