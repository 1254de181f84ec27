"""Output files: contents are right, writes are atomic, failures leave nothing behind."""

import contextlib
import errno
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vaeopt import outputs
from vaeopt.errors import OutputError


def _leftovers(d):
    return [p.name for p in d.iterdir() if ".partial" in p.name]


def test_png_pixels(tmp_path):
    x = torch.linspace(-1, 1, 3 * 16 * 24).view(1, 3, 16, 24)
    img = outputs.to_uint8_images(x)[0]
    outputs.write_png(tmp_path / "a.png", img)
    back = np.asarray(Image.open(tmp_path / "a.png"))
    assert back.shape == (16, 24, 3)
    assert np.array_equal(back, img.numpy())
    assert back.min() == 0 and back.max() == 255
    assert _leftovers(tmp_path) == []


def test_mp4_frames_and_size(tmp_path):
    import av

    t, h, w = 9, 32, 48
    frames = torch.zeros(t, h, w, 3, dtype=torch.uint8)
    for i in range(t):
        frames[i, :, : (i + 1) * 4] = 255  # a growing white bar: frames differ
    n = outputs.write_mp4(tmp_path / "v.mp4", [frames[:4], frames[4:]], fps=8)
    assert n == t
    with av.open(str(tmp_path / "v.mp4")) as c:
        s = c.streams.video[0]
        assert s.codec_context.name == "h264"
        decoded = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert len(decoded) == t and decoded[0].shape == (h, w, 3)
    # lossy codec, but the bar must be where we drew it
    assert decoded[5][:, :20].mean() > 200 and decoded[5][:, 30:].mean() < 50
    assert _leftovers(tmp_path) == []


def test_mp4_colour_is_bt709_and_says_so(tmp_path):
    """The frames are converted with the BT.709 matrix (TV range) and the stream is tagged so: a player reading the
    tags gets the colours back. Untagged BT.601 (PyAV's default) showed pure green as (0, 215, 0) in players that
    assume BT.709 for HD."""
    import av
    from av.video.reformatter import ColorRange, Colorspace

    colours = np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255], [255, 255, 0], [128, 128, 128], [30, 200, 120]],
                       np.uint8)
    frame = np.zeros((32, 16 * len(colours), 3), np.uint8)
    for i, c in enumerate(colours):
        frame[:, 16 * i: 16 * (i + 1)] = c
    outputs.write_mp4(tmp_path / "c.mp4", [torch.from_numpy(np.stack([frame] * 2))], fps=8)
    with av.open(str(tmp_path / "c.mp4")) as c:
        cc = c.streams.video[0].codec_context
        assert (cc.colorspace, cc.color_primaries, cc.color_trc, cc.color_range) == (1, 1, 1, 1)  # bt709 x3, tv
        yuv = next(c.decode(video=0))

    def centres(rgb):
        return np.array([rgb[16, 16 * i + 8] for i in range(len(colours))], dtype=int)

    as_tagged = centres(yuv.to_ndarray(format="rgb24"))
    as_709 = centres(yuv.reformat(format="rgb24", src_colorspace=Colorspace.ITU709,
                                  src_color_range=ColorRange.MPEG).to_ndarray())
    as_601 = centres(yuv.reformat(format="rgb24", src_colorspace=Colorspace.ITU601,
                                  src_color_range=ColorRange.MPEG).to_ndarray())
    assert np.abs(as_tagged - colours).max() <= 3
    assert np.abs(as_709 - colours).max() <= 3
    assert np.abs(as_601 - colours).max() > 15  # the matrix really is 709's, not 601's


def test_mp4_encoder_threading(tmp_path, monkeypatch):
    """libx264 runs with frame threads (E34: twice the slice threads' rate on 16 cores), and the frames come out
    right."""
    import av

    made = []
    real_open = av.open

    class Spy:  # the container, with the stream it makes recorded (PyAV's objects take no new attributes)
        def __init__(self, c):
            self.c = c

        def __enter__(self):
            self.c.__enter__()
            return self

        def __exit__(self, *exc):
            return self.c.__exit__(*exc)

        def add_stream(self, *a, **k):
            made.append(self.c.add_stream(*a, **k))
            return made[-1]

        def __getattr__(self, name):
            return getattr(self.c, name)

    def spy_open(*a, **k):
        return Spy(real_open(*a, **k))

    monkeypatch.setattr(av, "open", spy_open)
    frames = torch.zeros(6, 32, 48, 3, dtype=torch.uint8)
    for i in range(6):
        frames[i, :, : (i + 1) * 8] = 255
    assert outputs.write_mp4(tmp_path / "v.mp4", [frames], fps=8) == 6
    (s,) = made
    assert s.codec_context.thread_type.name == "FRAME"
    monkeypatch.setattr(av, "open", real_open)
    with av.open(str(tmp_path / "v.mp4")) as c:
        decoded = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert len(decoded) == 6 and decoded[3][:, :28].mean() > 200 and decoded[3][:, 36:].mean() < 50


def test_frames_dir_atomic(tmp_path):
    frames = torch.randint(0, 255, (3, 8, 8, 3), dtype=torch.uint8)
    outputs.write_frames_dir(tmp_path / "frames", [frames])
    names = sorted(os.listdir(tmp_path / "frames"))
    assert names == ["frame_00000.png", "frame_00001.png", "frame_00002.png"]
    assert np.array_equal(np.asarray(Image.open(tmp_path / "frames" / names[1])), frames[1].numpy())


def test_interrupt_leaves_no_partial_file(tmp_path):
    def chunks():
        yield torch.zeros(2, 16, 16, 3, dtype=torch.uint8)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        outputs.write_mp4(tmp_path / "v.mp4", chunks())
    assert list(tmp_path.iterdir()) == []


def test_disk_full_is_clean(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Image.Image, "save", boom)
    with pytest.raises(OutputError, match="disk full"):
        outputs.write_png(tmp_path / "a.png", torch.zeros(8, 8, 3, dtype=torch.uint8))
    assert list(tmp_path.iterdir()) == []


def test_existing_and_unwritable(tmp_path):
    (tmp_path / "a.png").write_bytes(b"keep me")
    with pytest.raises(OutputError, match="already exists"):
        outputs.check_writable([tmp_path / "a.png"], overwrite=False)
    outputs.check_writable([tmp_path / "a.png"], overwrite=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="is a file, not a folder"):
        outputs.check_writable([tmp_path / "file" / "sub" / "x.png"], overwrite=False)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):  # running as root: permissions are not enforced
            pytest.skip("root ignores directory permissions")
        with pytest.raises(OutputError, match="not writable"):
            outputs.check_writable([ro / "x.png"], overwrite=False)
    finally:
        ro.chmod(0o700)


def test_frames_folder_checks(tmp_path):
    """An empty folder takes frames without --overwrite; --overwrite replaces only a folder of frames."""
    d = tmp_path / "clip"
    d.mkdir()
    outputs.check_writable([d], overwrite=False, folders={d})
    outputs.write_frames_dir(d, [torch.zeros(2, 4, 4, 3, dtype=torch.uint8)])
    with pytest.raises(OutputError, match="already exists"):
        outputs.check_writable([d], overwrite=False, folders={d})
    outputs.check_writable([d], overwrite=True, folders={d})
    (d / ".DS_Store").write_bytes(b"\0")  # a file browser's, from looking at the frames: still replaceable
    outputs.check_writable([d], overwrite=True, folders={d})
    (d / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match=r"holds files other than PNG frames \(e.g. notes.txt\)"):
        outputs.check_writable([d], overwrite=True, folders={d})


def _frames(n, v=0):
    return torch.full((n, 4, 4, 3), v, dtype=torch.uint8)


def test_writes_never_follow_a_link(tmp_path):
    """An output's own name is never followed. Without --overwrite a symbolic link there, dangling or not, is an
    existing name and refused (a dangling `out.png` -> elsewhere in a shared folder would otherwise redirect the write
    onto any file the user can write); with --overwrite the link itself is replaced by the output and what it points
    to is left alone. Folders above the output are followed as usual (`-o renders/x.png`, renders a link)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    dangling = tmp_path / "dangling.png"
    dangling.symlink_to(tmp_path / "elsewhere" / "made.png")
    to_file = tmp_path / "latest.png"
    to_file.symlink_to(victim)
    img = torch.full((4, 4, 3), 7, dtype=torch.uint8)
    for link in (dangling, to_file):
        with pytest.raises(OutputError, match="already exists, as a symbolic link") as e:
            outputs.check_writable([link], overwrite=False)
        assert str(e.value).startswith(str(link))  # named as typed
        with pytest.raises(OutputError, match="appeared while"):  # appeared after the check: kept, not written through
            outputs.write_png(link, img, overwrite=False)
        assert link.is_symlink()
    assert victim.read_text() == "keep me" and not (tmp_path / "elsewhere").exists()
    # --overwrite: the link is replaced by the file; its target is untouched
    for link in (dangling, to_file):
        outputs.check_writable([link], overwrite=True)
        outputs.write_png(link, img, overwrite=True)
        assert not link.is_symlink() and np.asarray(Image.open(link)).max() == 7
    assert victim.read_text() == "keep me" and not (tmp_path / "elsewhere").exists()
    # a frames folder named by a link to a folder: the same rule (the folder it points to is left alone)
    real = tmp_path / "real"
    real.mkdir()
    (real / "frame_00000.png").write_bytes(b"old")
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(OutputError, match="symbolic link"):
        outputs.check_writable([link], overwrite=False, folders={link})
    outputs.check_writable([link], overwrite=True, folders={link})
    assert outputs.write_frames_dir(link, [_frames(2)], overwrite=True) == 2
    assert not link.is_symlink() and sorted(os.listdir(link)) == ["frame_00000.png", "frame_00001.png"]
    assert os.listdir(real) == ["frame_00000.png"] and (real / "frame_00000.png").read_bytes() == b"old"
    # a folder above the output may be a link: written inside it
    (tmp_path / "renders").symlink_to(real)
    outputs.check_writable([tmp_path / "renders" / "x.png"], overwrite=False)
    outputs.write_png(tmp_path / "renders" / "x.png", img, overwrite=False)
    assert (real / "x.png").is_file()
    # nothing else was left: no temporaries
    assert sorted(os.listdir(tmp_path)) == ["dangling.png", "latest.png", "link", "real", "renders", "victim.txt"]


def test_fifo_or_device_as_output_is_refused_before_anything(tmp_path):
    """-o /dev/null or a FIFO: refused by the early check (before the model loads), also with --overwrite, which
    would otherwise replace the device node."""
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    for p in (fifo, Path("/dev/null")):
        with pytest.raises(OutputError, match="a device, pipe or socket, not a folder or a .png"):
            outputs.check_output_folder(p, False, f"-o {p}")
        for ow in (False, True):
            with pytest.raises(OutputError, match=r"never replaces (a FIFO \(named pipe\)|a device), even with"):
                outputs.check_writable([p], overwrite=ow)


def test_temporaries_are_private_names_made_exclusively(tmp_path, monkeypatch):
    """A temporary is created with O_EXCL under an unpredictable name, with an ordinary file's permissions."""
    seen = []
    real_save = outputs._save_png
    monkeypatch.setattr(outputs, "_save_png", lambda t, im: (seen.append((t, os.stat(t).st_mode & 0o777)),
                                                            real_save(t, im)))
    outputs.write_png(tmp_path / "a.png", torch.zeros(4, 4, 3, dtype=torch.uint8))
    outputs.write_png(tmp_path / "b.png", torch.zeros(4, 4, 3, dtype=torch.uint8))
    (t1, mode), (t2, _) = seen
    assert t1.name.startswith(".a.png.") and t1.name.endswith(".partial.png") and t1.parent == tmp_path
    assert len({t1.name[7:], t2.name[7:]}) == 2  # random parts differ
    assert mode == 0o666 & ~outputs._UMASK
    assert (tmp_path / "a.png").stat().st_mode & 0o777 == 0o666 & ~outputs._UMASK
    assert sorted(os.listdir(tmp_path)) == ["a.png", "b.png"]


def test_a_batch_lands_whole_or_not_at_all(tmp_path, monkeypatch):
    """A full disk at the 2nd image of a batch of 3: no image of the batch is left (the 1st waited under a temporary
    name), no temporary either, and the message says exactly that."""
    from vaeopt import api

    calls = []
    real_save = outputs._save_png

    def full_on_second(t, im):
        calls.append(t)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(t, im)

    monkeypatch.setattr(outputs, "_save_png", full_on_second)
    paths = [tmp_path / f"out_{i:03d}.png" for i in range(3)]
    job = api.DecodeJob(tmp_path / "l.pt", "", torch.zeros(3, 4, 1, 1), paths, "png", overwrite=False)
    with pytest.raises(OutputError) as e:
        api.write_job(job, torch.zeros(3, 3, 8, 8))
    msg = str(e.value)
    assert "disk full" in msg and "none of the batch's 3 outputs was written" in msg, msg
    assert "out_001.png" in msg and "\n" not in msg
    assert os.listdir(tmp_path) == []
    # and when it fits, all three land
    monkeypatch.setattr(outputs, "_save_png", real_save)
    assert api.write_job(job, torch.zeros(3, 3, 8, 8)) == paths
    assert sorted(os.listdir(tmp_path)) == [p.name for p in paths]


def test_a_batch_whose_commit_meets_an_output_that_appeared_leaves_none(tmp_path, monkeypatch):
    """Without --overwrite, a file that appeared at the 3rd name while the batch was written: the two already
    renamed into place are removed again, the other's file is kept."""
    paths = [tmp_path / f"o_{i}.png" for i in range(3)]
    real_save = outputs._save_png

    def appear(t, im):
        real_save(t, im)
        if t.name.startswith(".o_2.png"):
            paths[2].write_bytes(b"someone else's")

    monkeypatch.setattr(outputs, "_save_png", appear)
    with pytest.raises(outputs.AppearedError, match="none of the batch's 3 outputs was written"):
        with outputs.land_together(paths, overwrite=False):
            for p in paths:
                outputs.write_png(p, torch.zeros(4, 4, 3, dtype=torch.uint8), overwrite=False)
    assert os.listdir(tmp_path) == ["o_2.png"] and paths[2].read_bytes() == b"someone else's"


def test_an_empty_folder_is_filled_in_place(tmp_path, monkeypatch):
    """An empty folder (a Docker volume's mount point cannot be renamed; its parent may be read-only) gets the frames
    one atomic file at a time, and is emptied again if the decode fails; a mount point that already holds frames is
    refused before decoding, since --overwrite would have to rename it."""
    d, e, plain = tmp_path / "vol", tmp_path / "vol2", tmp_path / "plain"
    for f in (d, e, plain):
        f.mkdir()
    monkeypatch.setattr(outputs.os.path, "ismount", lambda q: Path(q) in (d, e))
    renamed = []
    real_replace = os.replace
    monkeypatch.setattr(outputs.os, "replace", lambda a, b: renamed.append(Path(b)) or real_replace(a, b))
    assert outputs.write_frames_dir(d, [_frames(2), _frames(1)]) == 3
    assert d not in renamed and sorted(os.listdir(d)) == [f"frame_0000{i}.png" for i in range(3)]
    assert outputs.write_frames_dir(plain, [_frames(2)]) == 2  # an ordinary empty folder: temp folder + rename, so
    assert plain in renamed and len(os.listdir(plain)) == 2  # a killed process leaves no frames that look finished

    def failing():
        yield _frames(2)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        outputs.write_frames_dir(e, failing())
    assert os.listdir(e) == []  # as it was

    with pytest.raises(OutputError, match="mount point holding frames"):
        outputs.check_writable([d], overwrite=True, folders={d})
    outputs.check_writable([e], overwrite=False, folders={e})  # empty: filled in place, no rename


def test_tensor_output(tmp_path):
    from safetensors.torch import load_file

    x = torch.randn(1, 3, 8, 8)
    outputs.write_tensor(tmp_path / "x.safetensors", x)
    assert torch.equal(load_file(str(tmp_path / "x.safetensors"))["sample"], x)


def test_safetensors_output_is_clamped_like_the_others(tmp_path):
    """Image decodes went to .safetensors unclamped (PNG and video are clamped) under metadata saying [-1,1]."""
    from pathlib import Path

    from safetensors import safe_open

    from vaeopt import api

    job = api.DecodeJob(Path("l.pt"), "", torch.zeros(1, 4, 2, 2), [tmp_path / "o.safetensors"], "safetensors")
    api.write_job(job, torch.tensor([-3.0, -1.0, 0.5, 1.0, 1.03]).view(1, 1, 1, 5))
    with safe_open(str(tmp_path / "o.safetensors"), framework="pt") as f:
        assert f.get_tensor("sample").flatten().tolist() == [-1.0, -1.0, 0.5, 1.0, 1.0]
        assert f.metadata()["range"] == "[-1,1]"


def test_names():
    from pathlib import Path

    assert outputs.default_output(Path("/a/lat.pt"), False) == Path("/a/lat.png")
    assert outputs.default_output(Path("/a/lat.pt"), True, "bikes") == Path("/a/lat_bikes.mp4")
    assert outputs.numbered(Path("/a/o.png"), 2, 4) == Path("/a/o_002.png")
    assert outputs.numbered(Path("/a/o.png"), 0, 1) == Path("/a/o.png")


# regression tests: hostile inputs

def test_tensor_output_disk_full_and_file_mode(tmp_path, monkeypatch):
    import safetensors
    import safetensors.torch as st

    from vaeopt import outputs
    from vaeopt.errors import OutputError

    old = os.umask(0o022)
    try:
        outputs.write_tensor(tmp_path / "a.safetensors", torch.zeros(2))
        assert (tmp_path / "a.safetensors").stat().st_mode & 0o777 == 0o644  # safetensors itself makes 0600
    finally:
        os.umask(old)

    def full(*a, **k):
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(st, "save_file", full)
    with pytest.raises(OutputError, match="disk full"):
        outputs.write_tensor(tmp_path / "b.safetensors", torch.zeros(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors"]


def test_long_output_name_keeps_its_temp_name_short(tmp_path):
    from vaeopt import outputs

    name = "x" * 245 + ".png"  # valid (<= 255 bytes); '.<name>.<pid>.partial.png' would not be
    outputs.write_png(tmp_path / name, torch.zeros(8, 8, 3, dtype=torch.uint8))
    assert [p.name for p in tmp_path.iterdir()] == [name]


def test_mp4_abort_removes_the_file_when_a_second_signal_lands(tmp_path, monkeypatch):
    pytest.importorskip("av")
    from vaeopt import outputs

    w = outputs.Mp4Writer(tmp_path / "v.mp4")
    w.put(torch.zeros(2, 16, 16, 3, dtype=torch.uint8))

    def interrupted(*a, **k):  # the second Ctrl-C, while abort() waits for the encoder thread
        raise KeyboardInterrupt

    monkeypatch.setattr(w._thread, "join", interrupted)
    with pytest.raises(KeyboardInterrupt):
        w.abort()
    monkeypatch.undo()
    w._thread.join(10)
    assert list(tmp_path.iterdir()) == []


def test_an_output_that_appears_during_the_decode_is_kept(tmp_path, monkeypatch):
    """Two runs with the same -o: both find it free before decoding; the one that finishes second must not replace
    the first's file (no --overwrite) or folder, and must leave nothing of its own."""
    img = torch.full((8, 8, 3), 7, dtype=torch.uint8)
    frames = torch.full((2, 8, 8, 3), 9, dtype=torch.uint8)

    def other_run_writes(path, data):
        def chunks():
            yield frames
            path.write_bytes(data) if data is not None else (path.mkdir(), (path / "frame_00000.png").write_bytes(b"x"))
        return chunks()

    targets = {"png": tmp_path / "a.png", "mp4": tmp_path / "v.mp4"}
    with pytest.raises(outputs.AppearedError, match="pass --overwrite"):
        with outputs.atomic_path(targets["png"], overwrite=False) as tmp:
            outputs.write_png(tmp, img)
            targets["png"].write_bytes(b"first")
    assert targets["png"].read_bytes() == b"first"
    with pytest.raises(outputs.AppearedError, match="appeared while.*kept"):
        outputs.write_mp4(targets["mp4"], other_run_writes(targets["mp4"], b"first"), overwrite=False)
    with pytest.raises(outputs.AppearedError):
        outputs.write_frames_dir(tmp_path / "fr", other_run_writes(tmp_path / "fr", None), overwrite=False)
    assert (tmp_path / "fr" / "frame_00000.png").read_bytes() == b"x"  # the other run's frames folder is intact
    assert targets["mp4"].read_bytes() == b"first"
    (tmp_path / "empty").mkdir()  # what `-o empty/` makes before decoding: ours to fill
    assert outputs.write_frames_dir(tmp_path / "empty", [frames], overwrite=False) == 2
    assert sorted(os.listdir(tmp_path)) == ["a.png", "empty", "fr", "v.mp4"]  # nothing partial left


def test_no_clobber_without_hard_links(tmp_path, monkeypatch):
    def no_links(*a, **k):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    outputs.write_png(tmp_path / "a.png", torch.zeros(4, 4, 3, dtype=torch.uint8), overwrite=False)
    assert np.asarray(Image.open(tmp_path / "a.png")).shape == (4, 4, 3)
    with pytest.raises(outputs.AppearedError):
        outputs.write_png(tmp_path / "a.png", torch.ones(4, 4, 3, dtype=torch.uint8), overwrite=False)
    assert sorted(os.listdir(tmp_path)) == ["a.png"]


def test_frames_filled_in_place_keep_a_frame_another_run_wrote(tmp_path, monkeypatch):
    """A folder filled frame by frame (a mount point): when another run's frame is already there, it is kept, and only
    this run's own frames are removed (the first version removed the other run's frame too, then said it was kept)."""
    folder = tmp_path / "mnt"
    folder.mkdir()
    monkeypatch.setattr(outputs, "_filled_in_place", lambda p: True)
    frames = torch.full((2, 8, 8, 3), 5, dtype=torch.uint8)

    def chunks():
        yield frames[:1]  # frame_00000: ours
        (folder / "frame_00001.png").write_bytes(b"theirs")
        yield frames[1:]

    with pytest.raises(outputs.AppearedError):
        outputs.write_frames_dir(folder, chunks(), overwrite=False)
    assert os.listdir(folder) == ["frame_00001.png"] and (folder / "frame_00001.png").read_bytes() == b"theirs"


def test_mp4_frame_rate_fractions():
    """NTSC rates typed as decimals become the broadcast fractions (a player shows 23.976, not 2997/125); other
    rates their nearest fraction."""
    from fractions import Fraction

    from vaeopt.outputs import frame_rate

    assert frame_rate(23.976) == Fraction(24000, 1001) and frame_rate(29.97) == Fraction(30000, 1001)
    assert frame_rate(59.94) == Fraction(60000, 1001) and frame_rate(24000 / 1001) == Fraction(24000, 1001)
    assert frame_rate(16) == 16 and frame_rate(24) == 24 and frame_rate(12.5) == Fraction(25, 2)
    assert frame_rate(23.9) == Fraction(239, 10)


def test_sigterm_inside_one_long_operation_takes_effect_promptly(tmp_path):
    """SIGTERM while the main thread is inside one long C call (as in one torch op of a large CPU decode, where
    Python cannot run its handler): the watchdog ends the process within its grace, exit 143, with the temporary
    outputs removed; a signal the main thread handles itself is left to it (exit 143 from the handler)."""
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "long.py"
    script.write_text(
        "import ctypes, sys\n"
        "from pathlib import Path\n"
        "import typer\n"
        "from vaeopt import outputs\n"
        "from vaeopt.cli.exits import clean_errors\n"
        "@clean_errors\n"
        "def work():\n"
        "    outputs._new_temp(Path(sys.argv[1]) / 'out.png')\n"
        "    ctypes.CDLL(None).system(b'echo ready; sleep 30')  # 'ready' once inside the C call\n"
        "try:\n"
        "    work()\n"
        "except typer.Exit as e:\n"
        "    sys.exit(e.exit_code)\n")
    out = tmp_path / "out"
    out.mkdir()
    root = str(Path(outputs.__file__).parent.parent)
    p = subprocess.Popen([sys.executable, str(script), str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         cwd=root, env={**os.environ, "PYTHONPATH": root}, start_new_session=True)
    try:
        assert p.stdout.readline().strip() == b"ready"
        assert len(os.listdir(out)) == 1  # the temporary
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=20)
        took = time.monotonic() - t0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # the `sleep 30` child
    assert rc == 143 and took < 10, (rc, took)
    assert os.listdir(out) == []
    assert b"SIGTERM during a long operation" in p.stderr.read()
