"""The CLI as a user runs it: real files in, real files out, clear one-line errors, no tracebacks."""

import errno
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from vaeopt.cli import app
from vaeopt.errors import LatentError, OutputError, VaeoptError

runner = CliRunner()


def run(*args, env=None):
    r = runner.invoke(app, [str(a) for a in args], env=env, catch_exceptions=False)
    return r


def test_version_and_help():
    r = run("--version")
    assert r.exit_code == 0 and "vaeopt 0.1.0" in r.output
    for cmd in ("decode", "info", "benchmark"):
        r = run(cmd, "--help")
        assert r.exit_code == 0 and "Usage" in r.output
        # flags take no value: no "<bool>" after them (typer's rich help printed one; vaeopt.cli._flags_show_no_type)
        assert "<bool>" not in r.output and "--overwrite" in run("decode", "--help").output
    r = run("decode", "--help")
    assert "<path>" in r.output and "<float>" in r.output  # options with a value still show its type


def test_info_json_without_gpu():
    r = run("info", "--json")
    assert r.exit_code == 0
    data = json.loads(r.stdout)
    assert data["torch"].startswith("2.") and isinstance(data["gpus"], list)
    stages = {s["stage"]: s for s in data["stages"]}
    if not torch.cuda.is_available():
        assert stages["fp8"]["runs"] is False and "no CUDA GPU" in stages["fp8"]["why"]
        assert stages["graphs"]["runs"] is False
        # as `decode` decides on the CPU (the tests run with TRITON_INTERPRET=1, where the kernels could run)
        assert stages["fused_norms"]["runs"] is False and "interpreter" in stages["fused_norms"]["why"]
        assert stages["channels_last"]["runs"] is True
        # the table tries it everywhere; the stage itself switches only eager processors (decode's line then says
        # "skipped — nothing to change" where they are SDPA already)
        assert stages["attention"]["runs"] is True and "nothing to change where" in stages["attention"]["why"]


def test_decode_bundled_sample_short_form(tmp_path, samples_dir):
    # `vaeopt decode latents.pt`: the model comes from samples/vaeopt.json
    lat = tmp_path / "tiny_kl_image_latents.pt"
    lat.write_bytes((samples_dir / "tiny_kl_image_latents.pt").read_bytes())
    (tmp_path / "vaeopt.json").write_text(json.dumps(
        {"files": {lat.name: {"model": str(samples_dir / "tiny_kl_image.safetensors")}}}))
    r = run("decode", lat, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    written = [p for o in out["outputs"] for p in o["written"]]
    assert sorted(os.path.basename(p) for p in written) == ["tiny_kl_image_latents_astronaut.png",
                                                            "tiny_kl_image_latents_coffee.png"]
    img = np.asarray(Image.open(tmp_path / "tiny_kl_image_latents_astronaut.png"))
    assert img.shape == (512, 512, 3)
    ref = np.asarray(Image.open(samples_dir / "astronaut.png").convert("RGB").resize((512, 512)))
    mse = ((img.astype(float) - ref.astype(float)) ** 2).mean()
    psnr = 10 * np.log10(255**2 / mse)
    assert psnr >= 22, psnr  # a small trained model: 23.6 dB against the photo it never saw
    # second run refuses to overwrite, and leaves the file alone
    before = (tmp_path / "tiny_kl_image_latents_astronaut.png").stat().st_mtime_ns
    r = run("decode", lat)
    assert r.exit_code == 2 and "already exists" in r.output and "Traceback" not in r.output
    assert (tmp_path / "tiny_kl_image_latents_astronaut.png").stat().st_mtime_ns == before


def test_decode_video_to_mp4(tmp_path, samples_dir):
    import av

    z = torch.load(samples_dir / "tiny_wan_video_latents.pt", weights_only=True)["astronaut_pan"][:, :, :2]
    torch.save(z, tmp_path / "clip.pt")
    r = run("decode", tmp_path / "clip.pt", "--model", samples_dir / "tiny_wan_video.safetensors",
            "--latent-space", "raw", "-o", tmp_path / "clip.mp4")
    assert r.exit_code == 0, r.output
    with av.open(str(tmp_path / "clip.mp4")) as c:
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert len(frames) == 5 and frames[0].shape == (256, 384, 3)
    assert 20 < frames[2].mean() < 235  # real content, not a blank frame


def test_decode_batch_numbered_and_safetensors(tmp_path, samples_dir):
    from safetensors.torch import load_file

    z = torch.load(samples_dir / "tiny_kl_image_latents.pt", weights_only=True)["coffee"]
    torch.save(torch.cat([z, z]), tmp_path / "b.pt")
    model = samples_dir / "tiny_kl_image.safetensors"
    r = run("decode", tmp_path / "b.pt", "-m", model, "-o", tmp_path / "o.png")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "o_000.png").exists() and (tmp_path / "o_001.png").exists()
    assert r.output.count("for the batch of 2)") == 2  # one decode made both files: its time, said so
    assert "--fps" not in r.output
    r = run("decode", tmp_path / "b.pt", "-m", model, "-o", tmp_path / "p.png", "--fps", "24")
    assert r.exit_code == 0 and "--fps 24 ignored: it sets the frame rate of MP4 output" in r.output, r.output
    r = run("decode", tmp_path / "b.pt", "-m", model, "-o", tmp_path / "o.safetensors")
    assert r.exit_code == 0, r.output
    x = load_file(str(tmp_path / "o.safetensors"))["sample"]
    assert x.shape == (2, 3, 400, 600)


@pytest.mark.parametrize("make,expect", [
    (lambda d: torch.save(torch.randn(1, 16, 8, 8), d / "l.pt"), "16 latent channels"),
    (lambda d: torch.save(torch.full((1, 4, 8, 8), float("nan")), d / "l.pt"), "non-finite"),
    (lambda d: (d / "l.pt").write_bytes(b"garbage"), "not a readable torch file"),
])
def test_bad_latents_clear_error(tmp_path, samples_dir, make, expect):
    make(tmp_path)
    r = run("decode", tmp_path / "l.pt", "-m", samples_dir / "tiny_kl_image.safetensors")
    assert r.exit_code == 2
    assert expect in r.output and "Traceback" not in r.output
    assert not list(tmp_path.glob("*.png"))


def test_bad_model_and_missing_model(tmp_path, samples_dir):
    torch.save(torch.randn(1, 4, 8, 8), tmp_path / "l.pt")
    (tmp_path / "vae.safetensors").write_bytes(b"\x00" * 100)
    r = run("decode", tmp_path / "l.pt", "-m", tmp_path / "vae.safetensors")
    assert r.exit_code == 2 and "error:" in r.output and "Traceback" not in r.output
    env = {k: v for k, v in os.environ.items() if k != "VAEOPT_MODEL"}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "cfg")
    r = run("decode", tmp_path / "l.pt", env=env)
    assert r.exit_code == 2 and "--model" in r.output and "VAEOPT_MODEL" in r.output


def test_unwritable_output_leaves_nothing(tmp_path, samples_dir):
    torch.save(torch.randn(1, 4, 8, 8), tmp_path / "l.pt")
    (tmp_path / "afile").write_text("x")
    r = run("decode", tmp_path / "l.pt", "-m", samples_dir / "tiny_kl_image.safetensors",
            "-o", tmp_path / "afile" / "out.png")
    assert r.exit_code == 2 and "not a folder" in r.output


def test_cli_subprocess_no_traceback(tmp_path):
    # the installed entry point, as a user runs it
    torch.save(torch.randn(1, 4, 8, 8), tmp_path / "l.pt")
    p = subprocess.run([sys.executable, "-m", "vaeopt", "decode", str(tmp_path / "l.pt"), "-m",
                        str(tmp_path / "nope.safetensors")], capture_output=True, text=True)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr and "error:" in p.stderr


def test_unexpected_error_is_one_line(tmp_path, samples_dir, monkeypatch):
    from vaeopt import api

    def boom(*a, **k):
        raise KeyError("internal")

    monkeypatch.setattr(api, "run_jobs", boom)
    torch.save(torch.randn(1, 4, 8, 8), tmp_path / "l.pt")
    r = run("decode", tmp_path / "l.pt", "-m", samples_dir / "tiny_kl_image.safetensors")
    assert r.exit_code == 1 and "unexpected KeyError" in r.output and "VAEOPT_DEBUG" in r.output
    assert "Traceback" not in r.output


# --- hostile inputs (real files, not ours) ---------------------------------------------------------------------


def test_nonfinite_decode_is_refused_and_nothing_written(tmp_path, samples_dir):
    """Finite latents that overflow in the decoder (the fp16-SDXL case): the NaN output would become a black PNG
    or black MP4 frames reported as written. Refused, for images and the streaming MP4 path, and no file left."""
    torch.save(torch.full((1, 4, 8, 8), 3e38), tmp_path / "img.pt")
    r = run("decode", tmp_path / "img.pt", "-m", samples_dir / "tiny_kl_image.safetensors", "-o", tmp_path / "i.png")
    assert r.exit_code == 2 and "non-finite" in r.output and "nothing was written" in r.output, r.output
    torch.save(torch.full((1, 16, 2, 8, 8), 3e38), tmp_path / "vid.pt")
    r = run("decode", tmp_path / "vid.pt", "-m", samples_dir / "tiny_wan_video.safetensors", "-o", tmp_path / "v.mp4")
    assert r.exit_code == 2 and "non-finite" in r.output and "nothing was written" in r.output, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["img.pt", "vid.pt"]  # no output, no hidden temp file


def test_brackets_in_names_are_not_markup(tmp_path, samples_dir):
    """rich markup: '[noise_mask]' in a message vanished and a path reading 'a[/]b' crashed the error printer."""
    (tmp_path / "a[").mkdir()
    p = tmp_path / "a[" / "]b[x].pt"  # the path's text contains "[/]", rich's closing tag
    torch.save(torch.randn(1, 16, 8, 8), p)
    r = run("decode", p, "-m", samples_dir / "tiny_kl_image.safetensors")
    assert r.exit_code == 2 and "a[/]b[x].pt" in r.output and "16 latent channels" in r.output, r.output


def test_overwrite_never_replaces_inputs_or_the_model(tmp_path, samples_dir):
    from safetensors.torch import save_file

    model = tmp_path / "vae.safetensors"
    model.write_bytes((samples_dir / "tiny_kl_image.safetensors").read_bytes())
    save_file({"z": torch.randn(1, 4, 8, 8)}, str(tmp_path / "lat.safetensors"))
    before = {p: p.read_bytes() for p in (model, tmp_path / "lat.safetensors")}
    r = run("decode", tmp_path / "lat.safetensors", "-m", model, "-o", model, "--overwrite")
    assert r.exit_code == 2 and "would overwrite the model" in r.output, r.output
    r = run("decode", tmp_path / "lat.safetensors", "-m", model, "-o", tmp_path / "lat.safetensors", "--overwrite")
    assert r.exit_code == 2 and "an input latent file" in r.output, r.output
    assert all(p.read_bytes() == b for p, b in before.items())
    r = run("decode", tmp_path / "lat.safetensors", "-m", model, "-o", tmp_path / "out.safetensors")
    assert r.exit_code == 0, r.output  # any other output is fine


def test_a_clip_line_says_its_frames_size_and_rate(tmp_path, samples_dir):
    """A video output's line says what the clip holds (frames, size, and for an MP4 its frame rate), which its name
    does not: 2 latent frames of the Wan sample decode to 1 + 4 frames of 8x the latent's size."""
    torch.save(torch.randn(1, 16, 2, 4, 6), tmp_path / "v.pt")
    model = samples_dir / "tiny_wan_video.safetensors"
    r = run("decode", tmp_path / "v.pt", "-m", model, "-o", tmp_path / "v.mp4", "--fps", "12")
    assert r.exit_code == 0 and f"wrote {tmp_path / 'v.mp4'}  (5 frames of 48x32 at 12 fps; " in r.output, r.output
    r = run("decode", tmp_path / "v.pt", "-m", model, "-o", f"{tmp_path / 'frames'}/")
    assert r.exit_code == 0 and "(5 frames of 48x32; " in r.output, r.output
    assert len(list((tmp_path / "frames").glob("*.png"))) == 5


def test_overwrite_keeps_the_replaced_files_permissions(tmp_path, samples_dir):
    """--overwrite lands the new file by rename, and the file it replaces keeps its permissions (a private 0600 render
    stays private; a 0444 one stays read-only); a new name gets the umask's."""
    import stat

    torch.save(torch.randn(1, 4, 8, 8), tmp_path / "l.pt")
    for name, mode in (("private.png", 0o600), ("frozen.png", 0o444), ("clip.safetensors", 0o640)):
        out = tmp_path / name
        out.write_bytes(b"old")
        out.chmod(mode)
        r = run("decode", tmp_path / "l.pt", "-m", samples_dir / "tiny_kl_image.safetensors", "-o", out, "--overwrite")
        assert r.exit_code == 0 and out.read_bytes() != b"old", r.output
        assert stat.S_IMODE(out.stat().st_mode) == mode, (name, oct(out.stat().st_mode))
    out = tmp_path / "new.png"
    r = run("decode", tmp_path / "l.pt", "-m", samples_dir / "tiny_kl_image.safetensors", "-o", out)
    mask = os.umask(0)
    os.umask(mask)
    assert r.exit_code == 0 and stat.S_IMODE(out.stat().st_mode) == 0o666 & ~mask


def test_overwrite_frames_folder_and_kind_mismatch(tmp_path, samples_dir):
    """--overwrite of a PNG-frames folder replaced it (it failed after the decode: a non-empty folder cannot be
    renamed over); a file where a folder goes, or a folder holding other files, is refused before decoding; a video
    to '.png' says what to use instead of silently making a folder named 'clip.png'."""
    z = torch.load(samples_dir / "tiny_wan_video_latents.pt", weights_only=True)["astronaut_pan"][:, :, :2, :8, :8]
    torch.save(z, tmp_path / "clip.pt")
    model = samples_dir / "tiny_wan_video.safetensors"
    for _ in range(2):
        r = run("decode", tmp_path / "clip.pt", "-m", model, "--latent-space", "raw", "-o", tmp_path / "frames",
                "--overwrite")
        assert r.exit_code == 0, r.output
        assert len(list((tmp_path / "frames").glob("*.png"))) == 5
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no leftover old/partial folders
    r = run("decode", tmp_path / "clip.pt", "-m", model, "-o", tmp_path / "clip.png")
    assert r.exit_code == 2 and ".mp4" in r.output and not (tmp_path / "clip.png").exists(), r.output
    # an existing folder is a folder output whatever its name; --overwrite replaces only a folder of frames
    (tmp_path / "v.mp4").mkdir()
    (tmp_path / "v.mp4" / "keep.txt").write_text("mine")
    r = run("decode", tmp_path / "clip.pt", "-m", model, "-o", tmp_path / "v.mp4", "--overwrite")
    assert r.exit_code == 2 and "holds files other than PNG frames (e.g. keep.txt)" in r.output, r.output
    assert [p.name for p in (tmp_path / "v.mp4").iterdir()] == ["keep.txt"]
    (tmp_path / "f").write_text("a file")
    r = run("decode", tmp_path / "clip.pt", "-m", model, "-o", tmp_path / "f", "--overwrite")
    assert r.exit_code == 2 and "is a file, which --overwrite does not replace with a folder" in r.output, r.output


def test_gpus_path_notes_an_unused_fps_too(tmp_path, samples_dir, monkeypatch):
    """--gpus takes the distributed path (here one rank joining a torchrun-style job on gloo): it says --fps went
    unused as the one-process path does, and not when an MP4 is written."""
    from vaeopt import distributed as D

    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(D._free_port())}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("_VAEOPT_SPAWNED", raising=False)
    z = torch.load(samples_dir / "tiny_kl_image_latents.pt", weights_only=True)["coffee"]
    torch.save(z, tmp_path / "a.pt")
    r = run("decode", tmp_path / "a.pt", "-m", samples_dir / "tiny_kl_image.safetensors", "-o", tmp_path / "a.png",
            "--gpus", "1", "--fps", "24", "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "a.png").exists()
    assert "--fps 24 ignored: it sets the frame rate of MP4 output" in r.output, r.output


def test_gpus_path_failure_leaves_no_folder_and_no_class_names(tmp_path, samples_dir, monkeypatch):
    """Regression: a failed --gpus decode left the -o folder it made (the one-process path removes it),
    and its message carried our class names ('ranks 0, 1: NotALatent: ...')."""
    from vaeopt import distributed as D

    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(D._free_port())}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("_VAEOPT_SPAWNED", raising=False)
    torch.save(torch.randn(1, 4, 8, 8), tmp_path / "a.pt")  # image latents for a video VAE
    r = run("decode", tmp_path / "a.pt", "-m", samples_dir / "tiny_wan_video.safetensors", "-o",
            str(tmp_path / "new") + "/", "--gpus", "1", "--device", "cpu")
    assert r.exit_code == 2 and "latent channels" in r.output, r.output
    assert "NotALatent" not in r.output and "LatentError" not in r.output
    assert not (tmp_path / "new").exists()


def test_bad_manifest_device_and_fps_are_user_errors(tmp_path, samples_dir):
    torch.save(torch.randn(1, 4, 8, 8), tmp_path / "l.pt")
    model = samples_dir / "tiny_kl_image.safetensors"
    for bad in ([1, 2], {"files": ["l.pt"]}, {"files": {"l.pt": "vae.safetensors"}}):
        (tmp_path / "vaeopt.json").write_text(json.dumps(bad))
        r = run("decode", tmp_path / "l.pt", "-m", model)
        assert r.exit_code == 2 and "manifest must look like" in r.output and "bug" not in r.output, r.output
    (tmp_path / "vaeopt.json").unlink()
    r = run("decode", tmp_path / "l.pt", "-m", model, "--device", "tpu")
    assert r.exit_code == 2 and "expected cpu, cuda or cuda:N" in r.output, r.output
    r = run("decode", tmp_path / "l.pt", "-m", model, "--fps", "0")
    assert r.exit_code == 2 and "--fps must be between 0.01 and 1000" in r.output, r.output


def test_files_naming_different_models_are_refused(tmp_path, samples_dir):
    """Without --model, the model came from the first file's manifest only: a second file meant for another VAE was
    decoded with the wrong one (or failed with a shape error that did not say why)."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        torch.save(torch.randn(1, 4, 8, 8), tmp_path / name / "l.pt")
        (tmp_path / name / "vaeopt.json").write_text(json.dumps({"files": {"l.pt": {"model": f"{name}.safetensors"}}}))
    r = run("decode", tmp_path / "a" / "l.pt", tmp_path / "b" / "l.pt", "-o", tmp_path / "out")
    assert r.exit_code == 2 and "different models" in r.output, r.output


def test_sigterm_unwinds_like_ctrl_c(tmp_path, samples_dir):
    """kill / docker stop: Python's default SIGTERM exit skips every cleanup, leaving hidden .partial outputs."""
    import signal

    from vaeopt import api

    def killed(*a, **k):
        tmp = tmp_path / ".o.png.1.partial.png"
        with __import__("vaeopt.outputs", fromlist=["atomic_path"]).atomic_path(tmp_path / "o.png") as t:
            t.write_bytes(b"half")
            os.kill(os.getpid(), signal.SIGTERM)
        return tmp

    torch.save(torch.randn(1, 4, 8, 8), tmp_path / "l.pt")
    old = signal.getsignal(signal.SIGTERM)
    try:
        api_run = api.run_jobs
        api.run_jobs = killed
        r = run("decode", tmp_path / "l.pt", "-m", samples_dir / "tiny_kl_image.safetensors", "-o", tmp_path / "o.png")
    finally:
        api.run_jobs = api_run
        signal.signal(signal.SIGTERM, old)
    assert r.exit_code == 143 and "interrupted" in r.output, r.output  # 128 + SIGTERM, as shells report a kill
    assert sorted(p.name for p in tmp_path.iterdir()) == ["l.pt"]


def test_nohup_is_respected(tmp_path, samples_dir):
    """Regression: the SIGHUP handler replaced the SIG_IGN that `nohup` sets, so closing the terminal
    killed a `nohup vaeopt decode ...` (exit 129). An ignored SIGHUP / SIGTERM stays ignored."""
    import signal

    torch.save(torch.randn(1, 4, 8, 8), tmp_path / "l.pt")
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        r = run("decode", tmp_path / "l.pt", "-m", samples_dir / "tiny_kl_image.safetensors", "-o", tmp_path / "o.png",
                "--device", "cpu")
        assert r.exit_code == 0, r.output
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, old)


def test_config_with_unusable_scaling_factor_is_refused(tmp_path, samples_dir):
    """scaling_factor 0 was logged as used while unscale() divided by 1.0; a string reached float() as a 'bug'."""
    torch.save(torch.randn(1, 4, 8, 8), tmp_path / "l.pt")
    for v in ("0", '"abc"', "-0.5", "NaN"):
        (tmp_path / "c.json").write_text('{"scaling_factor": %s}' % v)
        r = run("decode", tmp_path / "l.pt", "-m", samples_dir / "tiny_kl_image.safetensors", "--config",
                tmp_path / "c.json", "-o", tmp_path / "o.png")
        assert r.exit_code == 2 and "is not a positive finite number" in r.output, (v, r.output)
    assert not (tmp_path / "o.png").exists()


def test_trailing_slash_output_is_a_folder(tmp_path, samples_dir):
    """`-o renders/2024.06.01/` was refused (unknown output type '.01') and `-o renders/run.safetensors/` wrote a
    file: typer's Path dropped the '/'. A trailing '/' means a folder whatever the name looks like, and is made if
    missing; a file in its place is refused and left alone."""
    torch.save(torch.randn(1, 4, 8, 8), tmp_path / "l.pt")
    model = samples_dir / "tiny_kl_image.safetensors"
    for name in ("2024.06.01", "run.safetensors"):
        r = run("decode", tmp_path / "l.pt", "-m", model, "-o", f"{tmp_path / 'renders' / name}/")
        assert r.exit_code == 0, r.output
        assert [p.name for p in (tmp_path / "renders" / name).iterdir()] == ["l.png"]
    (tmp_path / "afile").write_text("x")
    r = run("decode", tmp_path / "l.pt", "-m", model, "-o", f"{tmp_path / 'afile'}/")
    assert r.exit_code == 2 and "asks for a folder" in r.output and "is a file" in r.output, r.output
    assert (tmp_path / "afile").read_text() == "x"
    torch.save(torch.randn(1, 16, 8, 8), tmp_path / "bad.pt")  # refused at planning: no empty folder left behind
    r = run("decode", tmp_path / "bad.pt", "-m", model, "-o", f"{tmp_path / 'never' / 'v2.0'}/")
    assert r.exit_code == 2 and "latent channels" in r.output and not (tmp_path / "never").exists(), r.output
    # video: the folder is the PNG-frames folder (made empty by the CLI, so not "already exists")
    z = torch.load(samples_dir / "tiny_wan_video_latents.pt", weights_only=True)["astronaut_pan"][:, :, :2, :8, :8]
    torch.save(z, tmp_path / "clip.pt")
    r = run("decode", tmp_path / "clip.pt", "-m", samples_dir / "tiny_wan_video.safetensors", "--latent-space", "raw",
            "-o", f"{tmp_path / 'clips' / 'v1.0'}/")
    assert r.exit_code == 0, r.output
    assert len(list((tmp_path / "clips" / "v1.0").glob("frame_*.png"))) == 5


def test_output_kind_existing_folder_wins_over_suffix(tmp_path):
    from vaeopt import api

    (tmp_path / "x.png").mkdir()
    (tmp_path / "v1.5").mkdir()
    assert api.output_kind(tmp_path / "x.png", is_video=False) == "png-dir"
    assert api.output_kind(tmp_path / "x.png", is_video=True) == "frames"
    assert api.output_kind(tmp_path / "v1.5", is_video=False) == "png-dir"
    assert api.output_kind(tmp_path / "y.png", is_video=False) == "png"
    with pytest.raises(Exception, match="unknown output type '.5'"):
        api.output_kind(tmp_path / "w1.5", is_video=False)
    # a new name without a suffix is a folder, as docs/user-guide.md's outputs table says
    assert api.output_kind(tmp_path / "renders", is_video=False) == "png-dir"


def test_triton_cache_count(tmp_path, monkeypatch):
    """What the decode command compares to say that a first run's time includes compiling the Triton kernels: the
    compiled kernels (folders) in Triton's cache, 0 before the folder exists."""
    pytest.importorskip("triton")
    from vaeopt.kernels import triton_cache_entries

    cache = tmp_path / "tc"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    d, n = triton_cache_entries()
    assert d == str(cache) and n == 0
    for name in ("a1", "b2"):
        (cache / name).mkdir(parents=True)
    (cache / "stray.lock").write_text("")
    assert triton_cache_entries() == (str(cache), 2)


# regression tests: unusual inputs and output names

def test_dict_keys_cannot_leave_the_output_folder(tmp_path, samples_dir):
    z = torch.load(samples_dir / "tiny_kl_image_latents.pt", weights_only=True)["coffee"][..., :16, :16]
    sub = tmp_path / "a" / "b"
    sub.mkdir(parents=True)
    torch.save({"x/../../../escaped": z, "sub/dir": z}, sub / "trav.pt")
    model = samples_dir / "tiny_kl_image.safetensors"
    r = run("decode", sub / "trav.pt", "-m", model, "-o", str(sub / "out") + "/")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (sub / "out").iterdir()) == ["trav_sub_dir.png", "trav_x__________escaped.png"]
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.png")) == [
        "a/b/out/trav_sub_dir.png", "a/b/out/trav_x__________escaped.png"]
    r = run("decode", sub / "trav.pt", "-m", model, "-o", sub / "one.png")  # a file name: one per key beside it
    assert r.exit_code == 0, r.output
    assert {p.name for p in sub.glob("one_*.png")} == {"one_sub_dir.png", "one_x__________escaped.png"}


def test_video_batch_into_a_folder_goes_inside_it(tmp_path, samples_dir):
    import av

    z = torch.load(samples_dir / "tiny_wan_video_latents.pt", weights_only=True)["astronaut_pan"][:, :, :2, :8, :8]
    torch.save(torch.cat([z, z]), tmp_path / "clip.pt")
    r = run("decode", tmp_path / "clip.pt", "--model", samples_dir / "tiny_wan_video.safetensors",
            "--latent-space", "raw", "-o", str(tmp_path / "v") + "/")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (tmp_path / "v").iterdir()) == ["clip_000.mp4", "clip_001.mp4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.pt", "v"]  # no v_000/ beside it
    with av.open(str(tmp_path / "v" / "clip_001.mp4")) as c:
        assert len([f for f in c.decode(video=0)]) == 5


def test_dict_with_other_tensors_decodes_its_latents(tmp_path, samples_dir):
    z = torch.load(samples_dir / "tiny_kl_image_latents.pt", weights_only=True)["coffee"][..., :16, :16]
    torch.save({"latents": z, "prompt_embeds": torch.randn(1, 77, 768)}, tmp_path / "gen.pt")
    model = samples_dir / "tiny_kl_image.safetensors"
    r = run("decode", tmp_path / "gen.pt", "-m", model, "-o", tmp_path / "gen.png", "-v")
    assert r.exit_code == 0, r.output
    assert "skipped 1 tensor(s) that are not" in r.output and "prompt_embeds (1, 77, 768)" in r.output
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["gen.png"]  # one latent: no entry suffix
    assert "prompt_embeds (1, 77, 768) (3 dims, not a 4-channel (C,H,W) latent)" in r.output  # (was "1 channel")
    # the listing, before the VAE is known, does not call the embeddings latents
    assert "gen.pt: 2 tensors (pt, scaled latents where they fit the VAE)" in r.output
    assert "[prompt_embeds]: (1, 77, 768) float32" in r.output and "768) float32 (pt" not in r.output
    torch.save({"a": z, "b": z.permute(0, 2, 3, 1).contiguous()}, tmp_path / "cl.pt")  # a latent saved channels-last
    r = run("decode", tmp_path / "cl.pt", "-m", model, "-o", tmp_path / "cl.png")  # is an error with its hint, not
    assert r.exit_code == 2 and "channels look last" in r.output, r.output  # skipped
    torch.save({"a": torch.randn(1, 16, 8, 8), "b": torch.randn(1, 77, 768)}, tmp_path / "none.pt")
    r = run("decode", tmp_path / "none.pt", "-m", model, "-o", tmp_path / "none.png")
    assert r.exit_code == 2 and "none of its 2 tensors fits this VAE (--key NAME picks one: a, b)" in r.output


def test_plain_pickle_latents_get_the_right_advice(tmp_path, samples_dir):
    import pickle

    with open(tmp_path / "p.pt", "wb") as fh:
        pickle.dump({"x": torch.randn(1, 4, 8, 8)}, fh)
    r = run("decode", tmp_path / "p.pt", "-m", samples_dir / "tiny_kl_image.safetensors")
    assert r.exit_code == 2 and "a plain pickle stream (pickle.dump)" in r.output and "Traceback" not in r.output


# regression tests: hostile inputs

def test_folder_made_for_a_failed_decode_is_removed(tmp_path, samples_dir):
    torch.save(torch.full((1, 4, 8, 8), 3e38), tmp_path / "img.pt")  # overflows in the decoder: refused after decode
    r = run("decode", tmp_path / "img.pt", "-m", samples_dir / "tiny_kl_image.safetensors", "-o", str(tmp_path / "o") + "/")
    assert r.exit_code == 2 and "non-finite" in r.output, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["img.pt"]  # no empty o/ left
    (tmp_path / "keep").mkdir()  # a folder that was there before stays
    r = run("decode", tmp_path / "img.pt", "-m", samples_dir / "tiny_kl_image.safetensors", "-o", str(tmp_path / "keep") + "/")
    assert r.exit_code == 2 and (tmp_path / "keep").is_dir()


def test_host_oom_and_option_ranges_are_user_errors(tmp_path, samples_dir, monkeypatch):
    from vaeopt import api

    torch.save(torch.randn(1, 4, 8, 8), tmp_path / "l.pt")
    model = samples_dir / "tiny_kl_image.safetensors"

    def oom(*a, **k):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] . DefaultCPUAllocator: can't allocate memory: you "
                           "tried to allocate 20800000000 bytes")

    monkeypatch.setattr(api, "run_jobs", oom)
    r = run("decode", tmp_path / "l.pt", "-m", model, "-o", tmp_path / "o.png")
    assert r.exit_code == 3 and "out of host memory" in r.output and "vaeopt bug" not in r.output, r.output
    for args, expect in ((["--fps", "inf"], "--fps must be between"), (["--fps", "1e-9"], "--fps must be between"),
                         (["--fp8-gate", "nan"], "--fp8-gate must be"), (["--fp8-gate", "-1"], "--fp8-gate must be"),
                         (["-o", ""], "-o is empty")):
        r = run("decode", tmp_path / "l.pt", "-m", model, *args)
        assert r.exit_code == 2 and expect in r.output, (args, r.output)
    r = run("benchmark", model, "--json", tmp_path / "l.pt")  # would have replaced the latents with JSON
    assert r.exit_code == 2 and "give a .json file name" in r.output
    assert torch.load(tmp_path / "l.pt", weights_only=True).shape == (1, 4, 8, 8)


def test_tilde_in_output_is_expanded(tmp_path, samples_dir, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    torch.save(torch.randn(1, 4, 8, 8), tmp_path / "l.pt")
    monkeypatch.chdir(tmp_path)
    r = run("decode", tmp_path / "l.pt", "-m", samples_dir / "tiny_kl_image.safetensors", "-o", "~/out/x.png")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "home" / "out" / "x.png").is_file() and not (tmp_path / "~").exists()


@pytest.mark.parametrize("content", ["[]", "null", '"s"', '{"model": 5}'])
def test_malformed_user_config_is_a_user_error(tmp_path, monkeypatch, content):
    from vaeopt import api

    cfg = tmp_path / "config.json"
    cfg.write_text(content)
    monkeypatch.setattr(api, "USER_CONFIG", cfg)
    monkeypatch.delenv("VAEOPT_MODEL", raising=False)
    torch.save(torch.randn(1, 4, 8, 8), tmp_path / "l.pt")
    r = run("decode", tmp_path / "l.pt")
    assert r.exit_code == 2 and 'expected {"model":' in r.output, r.output


def test_manifest_latent_space_and_empty_model(tmp_path, samples_dir):
    torch.save(torch.randn(1, 4, 8, 8), tmp_path / "l.pt")
    (tmp_path / "vaeopt.json").write_text(json.dumps({"files": {"l.pt": {"latent_space": "bogus"}}}))
    r = run("decode", tmp_path / "l.pt", "-m", samples_dir / "tiny_kl_image.safetensors")
    assert r.exit_code == 2 and 'must be "scaled" or "raw"' in r.output
    (tmp_path / "vaeopt.json").write_text(json.dumps({"files": {"l.pt": {"model": ""}}}))
    r = run("decode", tmp_path / "l.pt", "-m", samples_dir / "tiny_kl_image.safetensors", "-o", tmp_path / "o.png")
    assert r.exit_code == 0, r.output


def test_same_named_inputs_are_told_apart_by_their_folders(tmp_path, samples_dir):
    """Regression: a/x.pt and b/x.pt into one -o collided (an error,
    with advice that could not help for -o FILE). Their outputs are now named after their folders, and the log
    says which input went where; a collision that remains still gets the advice that fits."""
    m = samples_dir / "tiny_kl_image.safetensors"
    z = _small_latents(tmp_path, samples_dir)["coffee"]
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        torch.save(z, tmp_path / d / "x.pt")
    a, b = tmp_path / "a" / "x.pt", tmp_path / "b" / "x.pt"
    r = run("decode", a, b, "-m", m, "-o", str(tmp_path / "out") + "/", "-v")
    assert r.exit_code == 0, r.output
    assert sorted(os.listdir(tmp_path / "out")) == ["a_x.png", "b_x.png"]
    out = r.output.replace("\n", "")
    assert f"{a} -> {tmp_path / 'out' / 'a_x.png'}; {b} -> {tmp_path / 'out' / 'b_x.png'}" in out, r.output
    assert f"  {a}: (1, 4, 8, 8)" in r.output and f"plan {b} (1, 4, 8, 8)" in r.output  # which x.pt is which
    r = run("decode", a, b, "-m", m, "-o", tmp_path / "o.png")  # one file name, extended per input
    assert r.exit_code == 0 and (tmp_path / "o_a_x.png").exists() and (tmp_path / "o_b_x.png").exists(), r.output
    np.save(tmp_path / "a" / "x.npy", z.numpy())  # one folder, one name, two formats: beside them, by suffix
    r = run("decode", a, tmp_path / "a" / "x.npy", "-m", m, "--latent-space", "scaled")
    assert r.exit_code == 0, r.output
    assert sorted(os.listdir(tmp_path / "a")) == ["x.npy", "x.pt", "x_npy.png", "x_pt.png"]
    torch.save(z, tmp_path / "a_x.pt")  # the name a/x.pt gets is another input's own: refused before decoding
    r = run("decode", a, b, tmp_path / "a_x.pt", "-m", m, "-o", str(tmp_path / "out2") + "/")
    assert r.exit_code == 2 and "would write the same output" in r.output and "rename one of the inputs" in r.output
    assert not (tmp_path / "out2").exists()


def test_nan_weights_symlink_loops_and_full_stdout(tmp_path, samples_dir):
    from safetensors.torch import load_file, save_file

    torch.save(torch.randn(1, 4, 8, 8), tmp_path / "l.pt")
    sd = load_file(str(samples_dir / "tiny_kl_image.safetensors"))
    k = next(k for k in sd if k.startswith("decoder.") and k.endswith(".weight"))
    sd[k] = sd[k].clone()
    sd[k].view(-1)[0] = float("nan")
    save_file(sd, str(tmp_path / "nan.safetensors"))
    r = run("decode", tmp_path / "l.pt", "-m", tmp_path / "nan.safetensors", "-o", tmp_path / "o.png")
    assert r.exit_code == 2 and f"hold NaN/Inf (e.g. {k})" in r.output, r.output
    (tmp_path / "la").symlink_to(tmp_path / "lb")
    (tmp_path / "lb").symlink_to(tmp_path / "la")
    r = run("decode", tmp_path / "l.pt", "-m", samples_dir / "tiny_kl_image.safetensors", "-o", tmp_path / "la" / "x.png")
    assert r.exit_code == 2 and "not a usable" in r.output and "bug" not in r.output, r.output
    r = run("decode", tmp_path / "l.pt", "-m", tmp_path / "la")
    assert r.exit_code == 2 and "a broken or looping symlink" in r.output, r.output
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "vaeopt", "info", "--json"], stdout=full, stderr=subprocess.PIPE,
                           text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert p.returncode == 1 and "cannot write the output to stdout" in p.stderr and "Traceback" not in p.stderr


def test_mp4_without_pyav_is_refused_before_decoding(tmp_path, samples_dir, monkeypatch):
    """Regression: without PyAV installed, a thread traceback, then "no frames to write" after the decode."""
    from vaeopt import api, outputs

    z = torch.load(samples_dir / "tiny_wan_video_latents.pt", weights_only=True)["astronaut_pan"][:, :, :2, :8, :8]
    torch.save(z, tmp_path / "clip.pt")
    monkeypatch.setattr(api, "_have_pyav", lambda: False)
    r = run("decode", tmp_path / "clip.pt", "--model", samples_dir / "tiny_wan_video.safetensors", "--latent-space",
            "raw", "-o", tmp_path / "clip.mp4")
    assert r.exit_code == 2 and "MP4 output needs PyAV" in r.output, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.pt"]
    monkeypatch.setitem(sys.modules, "av", None)  # and the writer itself reports it, without a thread traceback
    w = outputs.Mp4Writer(tmp_path / "v.mp4")
    w._thread.join(10)
    with pytest.raises(OutputError, match="video encoding failed"):
        w.put(torch.zeros(1, 8, 8, 3, dtype=torch.uint8))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.pt"]


def test_broken_manifest_ignored_when_flags_say_it_all_and_dangling_output_parent(tmp_path, samples_dir):
    torch.save(torch.randn(1, 4, 8, 8), tmp_path / "l.pt")
    (tmp_path / "vaeopt.json").write_text("{not json")
    model = samples_dir / "tiny_kl_image.safetensors"
    r = run("decode", tmp_path / "l.pt", "-m", model, "-o", tmp_path / "o.png")  # the latent space could come from it
    assert r.exit_code == 2 and "unreadable manifest" in r.output
    r = run("decode", tmp_path / "l.pt", "-m", model, "--latent-space", "scaled", "-o", tmp_path / "o.png")
    # --model and --latent-space say all a manifest could: it is not read (nor able to fail the run)
    assert r.exit_code == 0 and "vaeopt.json" not in r.output and (tmp_path / "o.png").is_file(), r.output
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    r = run("decode", tmp_path / "l.pt", "-m", model, "--latent-space", "scaled", "-o", tmp_path / "dangling" / "x.png")
    assert r.exit_code == 2 and "is a broken symlink" in r.output and "wrote" not in r.output, r.output


def test_a_one_frame_clip_can_be_a_png(tmp_path, samples_dir):
    """One latent frame decodes to one frame (Wan used as a text-to-image model): `-o x.png` writes it; a longer
    clip to .png is still refused before decoding, with the way out."""
    z = torch.load(samples_dir / "tiny_wan_video_latents.pt", weights_only=True)["astronaut_pan"][:, :, :2, :8, :8]
    torch.save(z[:, :, :1].clone(), tmp_path / "one.pt")
    torch.save(z, tmp_path / "two.pt")
    model = samples_dir / "tiny_wan_video.safetensors"
    r = run("decode", tmp_path / "one.pt", "--model", model, "--latent-space", "raw", "-o", tmp_path / "one.png")
    assert r.exit_code == 0, r.output
    assert Image.open(tmp_path / "one.png").size == (64, 64)
    r = run("decode", tmp_path / "one.pt", "--model", model, "--latent-space", "raw", "-o", tmp_path / "f")
    assert r.exit_code == 0 and os.listdir(tmp_path / "f") == ["frame_00000.png"]  # the folder form, the same frame
    assert np.array_equal(np.asarray(Image.open(tmp_path / "one.png")),
                          np.asarray(Image.open(tmp_path / "f" / "frame_00000.png")))
    r = run("decode", tmp_path / "two.pt", "--model", model, "--latent-space", "raw", "-o", tmp_path / "two.png")
    assert r.exit_code == 2 and "a .png takes only a one-frame clip" in r.output
    assert not (tmp_path / "two.png").exists()


def test_key_keeps_the_entry_name_in_default_outputs(tmp_path, samples_dir):
    """Regression: with --key the default output lost the entry's name (x.png, not x_coffee.png), so
    decoding a second key collided with the first (or replaced it under --overwrite). A file of one latent plus
    other tensors keeps its plain name, with --key or without."""
    lat = torch.load(samples_dir / "tiny_kl_image_latents.pt", weights_only=True)
    two = {k: v[:, :, :8, :8] for k, v in lat.items()}
    torch.save(two, tmp_path / "two.pt")
    torch.save({"latents": two["coffee"], "prompt_embeds": torch.randn(1, 77, 64)}, tmp_path / "one.pt")
    model = samples_dir / "tiny_kl_image.safetensors"
    for key in two:
        r = run("decode", tmp_path / "two.pt", "-m", model, "--key", key, "--device", "cpu")
        assert r.exit_code == 0, r.output
    for args in ([], ["--key", "latents"]):
        r = run("decode", tmp_path / "one.pt", "-m", model, "--device", "cpu", "--overwrite", *args)
        assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.glob("*.png")) == sorted(["one.png"] + [f"two_{k}.png" for k in two])


def test_output_names_past_the_file_system_limit_are_refused_before_decoding(tmp_path, samples_dir, monkeypatch):
    """Regression: a 252-character latent name gives a 256-byte default output, and a 249-character -o
    with a batch of 2 gives ..._000.png: both failed after the decode as 'unexpected OSError ... a vaeopt bug'."""
    from vaeopt import api

    monkeypatch.setattr(api, "run_jobs", lambda *a, **k: pytest.fail("decoded before the check"))
    z = torch.randn(1, 4, 8, 8)
    long_in = tmp_path / ("K" * 252 + ".pt")
    torch.save(z, long_in)
    torch.save(torch.cat([z, z]), tmp_path / "b2.pt")
    model = samples_dir / "tiny_kl_image.safetensors"
    for args in ([long_in], [tmp_path / "b2.pt", "-o", tmp_path / ("L" * 249 + ".png")]):
        r = run("decode", *args, "-m", model, "--device", "cpu")
        assert r.exit_code == 2 and "more than the 255 a file system takes" in r.output, r.output
        assert "vaeopt bug" not in r.output


def test_messages_name_the_source_of_a_mistake(tmp_path, samples_dir):
    """Regression: four messages that did not say what was
    wrong where the user would look. A $VAEOPT_MODEL that points nowhere is named as the source; `--config .` names
    the folder that lacks config.json (it said 'config.json'); `-o /dev/null` says what -o takes (it said
    '/dev/null/x.png: /dev/null is a file'); `--device cpu:5` is refused (it decoded on the CPU)."""
    torch.save(torch.randn(1, 4, 8, 8), tmp_path / "l.pt")
    model = samples_dir / "tiny_kl_image.safetensors"
    env = {**os.environ, "VAEOPT_MODEL": str(tmp_path / "gone.safetensors")}
    r = run("decode", tmp_path / "l.pt", env=env)
    assert r.exit_code == 2 and "checkpoint not found" in r.output and "named by $VAEOPT_MODEL" in r.output, r.output
    (tmp_path / "cfgdir").mkdir()
    r = run("decode", tmp_path / "l.pt", "-m", model, "--config", tmp_path / "cfgdir")
    assert r.exit_code == 2 and f"the folder {tmp_path / 'cfgdir'} has no config.json" in r.output.replace("\n", ""), \
        r.output
    r = run("decode", tmp_path / "l.pt", "-m", model, "-o", os.devnull)
    assert r.exit_code == 2 and "a device, pipe or socket, not a folder or a .png/.mp4/.safetensors file" in r.output, \
        r.output
    r = run("decode", tmp_path / "l.pt", "-m", model, "--device", "cpu:5", "-o", tmp_path / "x.png")
    assert r.exit_code == 2 and "the CPU is one device" in r.output and not (tmp_path / "x.png").exists(), r.output
    assert "Traceback" not in r.output


def _small_latents(tmp_path, samples_dir):
    lat = torch.load(samples_dir / "tiny_kl_image_latents.pt", weights_only=True)
    return {k: v[:, :, :8, :8].clone() for k, v in lat.items()}


def test_a_checkpoint_given_as_latents_is_refused(tmp_path, samples_dir):
    """It decoded its 4-channel weights as 132 'images' and said wrote."""
    model = samples_dir / "tiny_kl_image.safetensors"
    copy = tmp_path / "vae_copy.safetensors"
    copy.write_bytes(model.read_bytes())
    for given in (model, copy):
        r = run("decode", given, "--model", model, "-o", tmp_path / "out/")
        assert r.exit_code == 2 and "holds model weights" in r.output and "--model" in r.output, r.output
        assert not (tmp_path / "out").exists()


def test_key_into_a_folder_keeps_the_entry_name(tmp_path, samples_dir):
    lat = tmp_path / "l.pt"
    torch.save(_small_latents(tmp_path, samples_dir), lat)
    m = samples_dir / "tiny_kl_image.safetensors"
    for key in ("coffee", "astronaut"):
        r = run("decode", lat, "--key", key, "--model", m, "-o", str(tmp_path / "out") + "/")
        assert r.exit_code == 0, r.output
    assert sorted(os.listdir(tmp_path / "out")) == ["l_astronaut.png", "l_coffee.png"]


def test_meta_and_sparse_latents(tmp_path, samples_dir):
    z = _small_latents(tmp_path, samples_dir)["coffee"]
    torch.save(torch.empty(1, 4, 8, 8, device="meta"), tmp_path / "meta.pt")
    torch.save(z.to_sparse(), tmp_path / "sparse.pt")
    torch.save(z, tmp_path / "dense.pt")
    m = samples_dir / "tiny_kl_image.safetensors"
    r = run("decode", tmp_path / "meta.pt", "--model", m, "-o", tmp_path / "m.png")
    assert r.exit_code == 2 and "meta device" in r.output and "bug" not in r.output, r.output
    for name in ("sparse", "dense"):
        assert run("decode", tmp_path / f"{name}.pt", "--model", m, "-o", tmp_path / f"{name}.png").exit_code == 0
    assert np.array_equal(np.asarray(Image.open(tmp_path / "sparse.png")), np.asarray(Image.open(tmp_path / "dense.png")))


def test_failed_decode_removes_every_folder_it_made(tmp_path, samples_dir):
    torch.save(torch.full((1, 4, 8, 8), 1e30), tmp_path / "overflow.pt")
    r = run("decode", tmp_path / "overflow.pt", "--model", samples_dir / "tiny_kl_image.safetensors",
            "-o", str(tmp_path / "new1" / "new2") + "/")
    assert r.exit_code != 0 and "non-finite" in r.output
    assert sorted(os.listdir(tmp_path)) == ["overflow.pt"]


def test_one_input_given_twice(tmp_path, samples_dir, monkeypatch):
    (tmp_path / "d").mkdir()
    torch.save(_small_latents(tmp_path, samples_dir)["coffee"], tmp_path / "d" / "a.pt")
    monkeypatch.chdir(tmp_path / "d")
    m = samples_dir / "tiny_kl_image.safetensors"
    for second in ("a.pt", "../d/a.pt"):
        r = run("decode", "a.pt", second, "--model", m)
        assert r.exit_code == 2 and "given twice" in r.output, r.output
    assert sorted(os.listdir(".")) == ["a.pt"]
    os.symlink("a.pt", "b.pt")  # two names for one blob (a Hugging Face cache snapshot): two inputs, two outputs
    r = run("decode", "a.pt", "b.pt", "--model", m)
    assert r.exit_code == 0, r.output
    assert sorted(os.listdir(".")) == ["a.png", "a.pt", "b.png", "b.pt"]


def test_user_config_model_path_is_relative_to_the_config(tmp_path, samples_dir, monkeypatch):
    import vaeopt.api as api

    cfg = tmp_path / "cfg" / "vaeopt" / "config.json"
    cfg.parent.mkdir(parents=True)
    (cfg.parent / "vae.safetensors").write_bytes((samples_dir / "tiny_kl_image.safetensors").read_bytes())
    cfg.write_text(json.dumps({"model": "vae.safetensors"}))
    monkeypatch.setattr(api, "USER_CONFIG", cfg)
    monkeypatch.delenv("VAEOPT_MODEL", raising=False)
    monkeypatch.chdir(tmp_path)
    path, source = api.resolve_model(None, [])
    assert path == cfg.parent / "vae.safetensors" and source == str(cfg)


def test_benchmark_outputs_expand_the_home_folder(tmp_path, samples_dir, monkeypatch):
    """'--json=~/r.json' reaches vaeopt with the '~' (the shell expands it only at a word's start)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    monkeypatch.chdir(tmp_path)
    r = run("benchmark", samples_dir / "tiny_kl_image.safetensors", "--shape", "1,4,8,8", "--repeats", "1",
            "--warmup", "0", "--peers", "tiling", "--device", "cpu", "--json=~/r.json", "--plot=~/r.png")
    assert r.exit_code == 0, r.output
    # (matplotlib keeps its font cache in ~/.cache: the dot folders are its, not the outputs)
    outs = sorted(n for n in os.listdir(tmp_path / "home") if not n.startswith("."))
    assert outs == ["r.json", "r.png"] and not (tmp_path / "~").exists()


def test_batch_numbers_sort_past_999():
    from pathlib import Path

    from vaeopt.outputs import numbered

    names = [numbered(Path("o.png"), i, 1001).name for i in (0, 100, 999, 1000)]
    assert names == ["o_0000.png", "o_0100.png", "o_0999.png", "o_1000.png"] == sorted(names)
    assert numbered(Path("o.png"), 7, 12).name == "o_007.png"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_stderr_does_not_fail_the_decode(tmp_path, samples_dir):
    """`2>/dev/full`: the log cannot be written, the PNG can; it used to abort the decode with nothing written."""
    torch.save(_small_latents(tmp_path, samples_dir)["coffee"], tmp_path / "a.pt")
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "vaeopt", "decode", str(tmp_path / "a.pt"), "--model",
                            str(samples_dir / "tiny_kl_image.safetensors"), "-o", str(tmp_path / "a.png")],
                           stderr=full, stdout=subprocess.PIPE, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert p.returncode == 0 and np.asarray(Image.open(tmp_path / "a.png")).shape == (64, 64, 3)


def test_top_level_manifest_model_and_latent_space_hint(tmp_path, samples_dir, monkeypatch):
    """A vaeopt.json with a top-level "model" serves every file of its folder; a latent-space hint
    (latents.space_hint) is printed as a warning and the decode goes on."""
    from vaeopt import latents as lat
    from vaeopt.families import get_family

    torch.manual_seed(0)
    raw_like, scaled = torch.randn(1, 4, 16, 16) * 5.5, torch.randn(1, 4, 16, 16)
    sd15, wan = get_family("sd15"), get_family("wan21")  # scaling 0.18215; per-channel mean / std
    assert "look raw" in lat.space_hint(raw_like, sd15, "scaled") and "--latent-space raw" in lat.space_hint(
        raw_like, sd15, "scaled")
    assert lat.space_hint(raw_like, sd15, "raw") is None and lat.space_hint(scaled, sd15, "scaled") is None
    assert "pass --latent-space scaled" in lat.space_hint(scaled, sd15, "raw")
    # regression: std 0.19 read as raw was called "near 1"; it fits neither space, and says so
    odd = lat.space_hint(scaled * 0.19, sd15, "raw")
    assert "fits neither" in odd and "std 0.19" in odd and "near 1" not in odd.split("(")[0], odd
    assert "fits neither" in lat.space_hint(raw_like * 20, sd15, "scaled")
    huge = lat.space_hint(scaled * 1e30, sd15, "scaled")  # a spread past any latent space: short, not 31 digits
    assert "fits neither" in huge and re.search(r"std 1\.\d*e\+30\b", huge), huge
    zw = torch.randn(1, 16, 3, 8, 8)
    assert lat.space_hint(zw, wan, "scaled") is None and lat.space_hint(wan.unscale(zw), wan, "raw") is None
    # the sample VAE's factor (0.305) tells the spaces apart: pipeline-like latents pass quietly, raw-like ones are named
    torch.save(raw_like, tmp_path / "rawlike.pt")
    torch.save(scaled, tmp_path / "scaled.pt")
    (tmp_path / "vaeopt.json").write_text(json.dumps({"model": str(samples_dir / "tiny_kl_image.safetensors")}))
    r = run("decode", tmp_path / "scaled.pt", "-o", tmp_path / "a.png", "-v")
    assert r.exit_code == 0 and "vaeopt.json beside the latents" in r.output and "look" not in r.output, r.output
    r = run("decode", tmp_path / "rawlike.pt", "-o", tmp_path / "r.png")
    assert r.exit_code == 0 and "warning: rawlike.pt: these latents look raw" in r.output, r.output
    monkeypatch.setattr(lat, "space_hint", lambda z, fam, space: f"these latents look odd for {space}")
    r = run("decode", tmp_path / "rawlike.pt", "-o", tmp_path / "b.png", "--latent-space", "raw")
    assert r.exit_code == 0 and "warning: rawlike.pt: these latents look odd for raw" in r.output, r.output
    assert (tmp_path / "b.png").is_file()
    # the hint looks only at tensors that are latents for this VAE (a ComfyUI dict's noise_mask is not)
    seen = []
    monkeypatch.setattr(lat, "space_hint", lambda z, fam, space: seen.append(tuple(z.shape)))
    torch.save({"samples": raw_like, "noise_mask": torch.rand(1, 1, 16, 16)}, tmp_path / "comfy.pt")
    r = run("decode", tmp_path / "comfy.pt", "--key", "noise_mask", "-o", tmp_path / "m.png")
    assert r.exit_code == 2 and seen == [], (r.output, seen)
    r = run("decode", tmp_path / "comfy.pt", "-o", tmp_path / "c.png")
    assert r.exit_code == 0 and seen == [(1, 4, 16, 16)], (r.output, seen)


def test_folder_latent_space_does_not_override_what_a_file_says(tmp_path, samples_dir):
    """A top-level latent_space in vaeopt.json is the folder's default: a per-file entry beats it, and so do a
    ComfyUI latent file's format (raw) and vaeopt's own safetensors metadata."""
    from safetensors.torch import save_file

    from vaeopt import latents as lat

    z = torch.randn(1, 4, 8, 8)
    torch.save(z, tmp_path / "plain.pt")
    torch.save(z, tmp_path / "own.pt")
    save_file({"latent_tensor": z, "latent_format_version_0": torch.tensor([])}, str(tmp_path / "c.latent"))
    lat.save_latents(tmp_path / "meta.safetensors", {"z": z}, "scaled")
    (tmp_path / "vaeopt.json").write_text(json.dumps({"latent_space": "raw",
                                                      "files": {"own.pt": {"latent_space": "scaled"}}}))
    got = {n: lat.read_latents(tmp_path / n).default_space
           for n in ("plain.pt", "own.pt", "c.latent", "meta.safetensors")}
    assert got == {"plain.pt": "raw", "own.pt": "scaled", "c.latent": "raw", "meta.safetensors": "scaled"}, got
    (tmp_path / "vaeopt.json").write_text(json.dumps({"latent_space": "scaled"}))
    assert lat.read_latents(tmp_path / "c.latent").default_space == "raw"
    (tmp_path / "vaeopt.json").write_text(json.dumps({"latent_space": "bogus"}))
    with pytest.raises(lat.LatentError, match='must be "scaled" or "raw"'):
        lat.read_latents(tmp_path / "plain.pt")
    (tmp_path / "vaeopt.json").write_text(json.dumps({"model": 3}))
    with pytest.raises(lat.LatentError, match='top-level "model" must be a path'):
        lat.read_latents(tmp_path / "plain.pt")


def test_two_keys_of_one_file_mapping_to_one_name_get_advice_that_fits(tmp_path, samples_dir):
    z = torch.randn(1, 4, 8, 8)
    torch.save({"a.b": z, "a_b": z * 0.5}, tmp_path / "keys.pt")
    for extra in ((), ("-o", str(tmp_path / "kf") + "/"), ("-o", tmp_path / "k.png")):
        r = run("decode", tmp_path / "keys.pt", "-m", samples_dir / "tiny_kl_image.safetensors", *extra)
        assert r.exit_code == 2 and "its tensors 'a.b', 'a_b' would write the same output" in r.output, r.output
        assert "--key NAME and its own -o" in r.output and "rename one of the inputs" not in r.output


def test_bad_dtype_and_device_fail_before_the_checkpoint_loads(tmp_path, samples_dir, monkeypatch):
    from vaeopt import loading

    torch.save(torch.randn(1, 4, 8, 8), tmp_path / "l.pt")
    monkeypatch.setattr(loading, "load_vae", lambda *a, **k: pytest.fail("the checkpoint was loaded"))
    for extra, msg in ((("--dtype", "int8"), "unknown dtype 'int8'"), (("--device", "tpu"), "expected cpu, cuda")):
        r = run("decode", tmp_path / "l.pt", "-m", samples_dir / "tiny_kl_image.safetensors", *extra)
        assert r.exit_code == 2 and msg in r.output, r.output


def test_input_errors_come_before_the_load_and_say_what_to_do(tmp_path, samples_dir, monkeypatch):
    """Regression: a bad -o suffix, an existing output and --peers foo were
    reported only after the checkpoint had loaded; `decode --json` printed nothing on stdout when it failed; a Hub
    id got a bare 'not found'; a full-size benchmark on the CPU ran for many minutes without a word."""
    from vaeopt import benchmark as bm
    from vaeopt import loading

    model = samples_dir / "tiny_kl_image.safetensors"
    z = tmp_path / "a.pt"
    torch.save(_small_latents(tmp_path, samples_dir)["coffee"], z)
    loads = []
    real = loading.load_vae
    monkeypatch.setattr(loading, "load_vae", lambda *a, **k: loads.append(a) or real(*a, **k))
    r = run("decode", z, "-m", model, "-o", tmp_path / "a.jpg")
    assert r.exit_code == 2 and "unknown output type '.jpg'" in r.output and loads == []
    (tmp_path / "taken.png").write_bytes(b"mine")
    r = run("decode", z, "-m", model, "-o", tmp_path / "taken.png", "--json")
    assert r.exit_code == 2 and "already exists" in r.output and loads == []
    assert json.loads(r.stdout) == {"error": f"{tmp_path / 'taken.png'}: already exists (pass --overwrite to replace "
                                             "it)", "exit_code": 2}
    assert (tmp_path / "taken.png").read_bytes() == b"mine"
    r = run("benchmark", tmp_path / "nosuch.safetensors", "--peers", "foo")
    assert r.exit_code == 2 and "--peers: unknown foo" in r.output
    for flag, name in (("--json", "r.json"), ("--plot", "r.png")):  # a '~user' that does not exist: one line, exit 2
        r = run("benchmark", model, flag, f"~nosuchuser_vaeopt/{name}")  # (not an internal error)
        assert r.exit_code == 2 and f"{flag} ~nosuchuser_vaeopt/{name}: '~nosuchuser_vaeopt' names no user" in r.output
    for args in (("-m", "~nosuchuser_vaeopt/v.safetensors"), ("-m", model, "-o", "~nosuchuser_vaeopt/o.png"),
                 ("-m", model, "--config", "~nosuchuser_vaeopt/c.json")):  # decode's paths too: exit 2, before a load
        r = run("decode", z, *args)
        assert r.exit_code == 2 and "'~nosuchuser_vaeopt' names no user" in r.output and loads == [], (args, r.output)
    (tmp_path / "a:x:b.pt").write_bytes(z.read_bytes())  # printed as typed: no emoji for ':x:'
    r = run("decode", tmp_path / "a:x:b.pt", "-m", model, "-o", f"{tmp_path / 'o:thumbs_up:'}/")
    assert r.exit_code == 0 and "read a:x:b.pt" in r.output and "o:thumbs_up:" in r.output, r.output
    r = run("decode", z, "-m", "stabilityai/sdxl-vae")
    assert "Hugging Face Hub id" in r.output and "huggingface-cli download stabilityai/sdxl-vae" in r.output
    r = run("decode", z, "-m", "black-forest-labs/FLUX.1-dev/vae")
    assert "--include 'vae/*'" in r.output and "-m FLUX.1-dev/vae" in r.output
    assert "Hub id" not in run("decode", z, "-m", tmp_path / "gone" / "vae.safetensors").output
    monkeypatch.setattr(bm, "run_benchmark", lambda *a, **k: (_ for _ in ()).throw(VaeoptError("stop here")))
    r = run("benchmark", model, "--shape", "1,4,80,80", "--device", "cpu", "--peers", "tiling")
    assert "each decode takes a minute or more" in r.output and "--shape 1,4,32,32" in r.output
    r = run("benchmark", model, "--shape", "1,4,16,16", "--device", "cpu", "--peers", "tiling")
    assert "a minute" not in r.output and "stop here" in r.output


def test_latent_files_named_as_another_format(tmp_path, samples_dir):
    """A safetensors file saved as .pt, and a torch.save file named .safetensors, are read by their content (with a
    note); a truncated torch file's error is one sentence, not torch's paragraph cut mid-word."""
    from safetensors.torch import save_file

    from vaeopt import latents as lat

    z = _small_latents(tmp_path, samples_dir)["coffee"]
    save_file({"z": z.contiguous()}, tmp_path / "st.pt")
    f = lat.read_latents(tmp_path / "st.pt")
    assert f.format == "safetensors" and torch.equal(f.entries[0].tensor, z)
    assert any("a safetensors file despite its '.pt' suffix" in n for n in f.notes)
    torch.save({"z": z}, tmp_path / "zip.safetensors")
    f = lat.read_latents(tmp_path / "zip.safetensors")
    assert f.format == "pt" and torch.equal(f.entries[0].tensor, z)
    assert any("a torch.save file despite its '.safetensors' suffix" in n for n in f.notes)
    data = (samples_dir / "tiny_kl_image_latents.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[:3000])
    with pytest.raises(LatentError) as e:
        lat.read_latents(tmp_path / "cut.pt")
    msg = str(e.value)
    assert "corrupt or truncated" in msg and msg.endswith(")") and "If you are seeing" not in msg, msg


def test_manifest_typos_and_a_bad_input_among_several(tmp_path, samples_dir):
    """Regression: a vaeopt.json key spelled like the flag ("latent-space")
    was ignored and the file decoded in the other latent space; a manifest without an entry for the file gave the
    bare 'no VAE checkpoint'; an unusable decode among several inputs said 'nothing was written' although the
    earlier outputs were."""
    import numpy as np

    model = samples_dir / "tiny_kl_image.safetensors"
    (tmp_path / "kl.safetensors").write_bytes(model.read_bytes())
    z = np.random.default_rng(0).standard_normal((1, 4, 8, 8)).astype("float32")
    np.save(tmp_path / "lat.npy", z)
    m = tmp_path / "vaeopt.json"
    m.write_text(json.dumps({"files": {"lat.npy": {"model": "kl.safetensors", "latent-space": "raw"}}}))
    r = run("decode", tmp_path / "lat.npy", "-o", tmp_path / "o.png")
    assert r.exit_code == 2 and 'unknown key "latent-space" for lat.npy (did you mean "latent_space"?)' in r.output
    m.write_text(json.dumps({"_doc": "a note", "fles": {}}))
    assert 'unknown key "fles" at the top level (did you mean "files"?)' in run("decode", tmp_path / "lat.npy").output
    m.write_text(json.dumps({"files": {"LAT.npy": {"model": "kl.safetensors"}}}))
    r = run("decode", tmp_path / "lat.npy", "-o", tmp_path / "o.png")
    assert r.exit_code == 2 and "has no entry for lat.npy (it lists LAT.npy" in r.output, r.output
    m.write_text(json.dumps({"_doc": "comments are fine", "files": {"lat.npy": {"model": "kl.safetensors",
                                                                             "latent_space": "raw"}}}))
    r = run("decode", tmp_path / "lat.npy", "-o", tmp_path / "o.png")
    assert r.exit_code == 0 and "raw latents" in r.output, r.output
    # a folder-wide latent_space still serves a file the "files" table does not list
    m.write_text(json.dumps({"latent_space": "raw", "files": {"other.npy": {"model": "kl.safetensors"}}}))
    r = run("decode", tmp_path / "lat.npy", "-m", model, "-o", tmp_path / "o2.png")
    assert r.exit_code == 0 and "raw latents" in r.output, r.output
    m.unlink()
    np.save(tmp_path / "b.npy", z * 1e30)  # finite, but the decode overflows
    np.save(tmp_path / "c.npy", z)
    r = run("decode", tmp_path / "lat.npy", tmp_path / "b.npy", tmp_path / "c.npy", "-m", model, "-o",
            tmp_path / "mix/")
    assert r.exit_code == 2 and "nothing was written for it" in r.output
    assert "kept the 1 output(s) written before it" in r.output and "1 input(s) after it not decoded" in r.output
    assert sorted(os.listdir(tmp_path / "mix")) == ["lat.png"]


def test_odd_latents_outputs_and_tiles_are_said_before_work(tmp_path, samples_dir, monkeypatch):
    """Regression: a .latent without ComfyUI's key was read as
    plain safetensors without a word; an output folder that cannot be written was found after the decode; `-o .png`
    made a hidden folder; `--tile 100000` printed the tile asked for, not the one used; `--gpus 1 --device cpu` was
    refused."""
    from safetensors.torch import save_file

    from vaeopt import loading

    m = samples_dir / "tiny_kl_image.safetensors"
    z = _small_latents(tmp_path, samples_dir)["coffee"].contiguous()
    save_file({"samples": z}, tmp_path / "plain.latent")
    r = run("decode", tmp_path / "plain.latent", "-m", m, "-o", tmp_path / "p.png")
    assert r.exit_code == 0 and (tmp_path / "p.png").exists(), r.output
    assert "no 'latent_tensor' key, which ComfyUI's .latent files hold: read as plain safetensors (key 'samples')" \
        in r.output and "--latent-space raw if these are raw" in r.output and "scaled latents" in r.output, r.output
    save_file({"latent_tensor": z, "latent_format_version_0": torch.tensor([])}, tmp_path / "comfy.latent")
    r = run("decode", tmp_path / "comfy.latent", "-m", m, "-o", tmp_path / "c.png")
    assert r.exit_code == 0 and "raw latents" in r.output and "no 'latent_tensor'" not in r.output, r.output

    torch.save(z, tmp_path / "l.pt")
    loads = []
    real = loading.load_vae
    monkeypatch.setattr(loading, "load_vae", lambda *a, **k: loads.append(a) or real(*a, **k))
    if os.path.isdir("/proc"):  # root passes os.access there: the file made and removed at once tells
        r = run("decode", tmp_path / "l.pt", "-m", m, "-o", "/proc/x.png")
        assert r.exit_code == 2 and "-o /proc/x.png: " in r.output and "/proc" in r.output.split(": ", 2)[-1], r.output
        assert loads == [] and "Traceback" not in r.output
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    access = os.access  # root writes into a 0555 folder anyway: tell it what a user is told
    monkeypatch.setattr(os, "access", lambda p, mode, **k: False if str(p) == str(ro) else access(p, mode, **k))
    for o in (ro / "x.png", str(ro / "new") + "/"):
        r = run("decode", tmp_path / "l.pt", "-m", m, "-o", o, "--json")
        assert r.exit_code == 2 and f"folder {ro} is not writable" in r.output and loads == [], r.output
        assert json.loads(r.stdout)["exit_code"] == 2
    ro.chmod(0o755)
    assert os.listdir(ro) == []

    monkeypatch.chdir(tmp_path)
    for bare in (".png", ".mp4", "sub/.safetensors"):
        r = run("decode", "l.pt", "-m", m, "-o", bare)
        assert r.exit_code == 2 and "a suffix alone is not a file name" in r.output and loads == [], r.output
        assert not os.path.lexists(bare) and not os.path.lexists("sub")
    assert "a bare suffix (-o .png) is refused" in " ".join(re.sub("[│─╭╮╰╯]", " ", run("decode", "--help").output)
                                                            .split())
    r = run("decode", "l.pt", "-m", m, "-o", "t.png", "--tile", "100000", "-v")
    assert r.exit_code == 0 and Image.open("t.png").size == (64, 64), r.output
    assert "tile 64px (the tile of 100000 asked for is larger than the 8x8 latent: one tile, the whole image)" in \
        r.output, r.output
    assert "800000px" not in r.output
    r = run("decode", "l.pt", "-m", m, "-o", "g.png", "--gpus", "1", "--device", "cpu")
    assert r.exit_code == 0 and "--gpus 1 --device cpu: one CPU decode" in r.output, r.output
    assert os.path.exists("g.png")
    g = np.asarray(Image.open("g.png")).astype(int)
    assert np.array_equal(g, np.asarray(Image.open("p.png")))  # the plain decode of the same latents
    assert np.abs(g - np.asarray(Image.open("t.png"))).max() <= 1  # one tile: the whole decode, to rounding
    r = run("decode", "l.pt", "-m", m, "-o", "g2.png", "--gpus", "2", "--device", "cpu")
    assert r.exit_code == 2 and "--gpus 2" in r.output and not os.path.exists("g2.png")


def test_benchmark_hints_name_only_flags_it_has(tmp_path, samples_dir):
    """The stage lines' hints name `vaeopt decode`'s flags; `vaeopt benchmark` has few of them: its
    table and JSON say them as decode's, or as its own."""
    r = run("benchmark", samples_dir / "tiny_kl_image.safetensors", "--shape", "1,4,16,16", "--device", "cpu",
            "--repeats", "1", "--warmup", "0", "--peers", "tiling", "--json", tmp_path / "r.json", "-v")
    assert r.exit_code == 0, r.output  # (-v: the skip reasons in full)
    out = " ".join(r.output.split())
    assert "plus `vaeopt decode --triton on` forces it" in out and "plus --triton on" not in out
    assert "`vaeopt decode --triton on --conv-kernel on` forces it" in out
    data = json.loads((tmp_path / "r.json").read_text())
    details = [s["detail"] for row in data["rows"] for s in row.get("stages") or []]
    assert details and any("`vaeopt decode --triton on`" in d for d in details)
    bare = [re.sub(r"`vaeopt decode [^`]*`", "", d) for d in details]  # outside what is named as decode's
    assert not any(re.search(r"--(triton|conv-kernel|upsample-conv|graphs|channels-last)\b", d) for d in bare)


def test_decode_tells_the_fp8_gate_the_largest_latent(tmp_path, samples_dir, monkeypatch):
    """With --fp8, `vaeopt decode` builds its pipeline with the largest input latent's shape (batch 1), where the
    int8 convs' gate measures (stages/triton_conv.apply_fp8); without --fp8 it passes none."""
    from vaeopt import pipeline

    z = torch.load(samples_dir / "tiny_kl_image_latents.pt", weights_only=True)["coffee"]
    torch.save(torch.cat([z, z])[:, :, :8, :8], tmp_path / "small.pt")
    torch.save(z[:, :, :12, :16], tmp_path / "big.pt")
    seen = []
    real = pipeline.Pipeline.__init__
    monkeypatch.setattr(pipeline.Pipeline, "__init__",
                        lambda self, loaded, options=None, *a, **k: seen.append(options) or real(self, loaded, options,
                                                                                               *a, **k))
    model = samples_dir / "tiny_kl_image.safetensors"
    for fp8, want in (("on", (1, z.shape[1], 12, 16)), ("off", None)):
        r = run("decode", tmp_path / "small.pt", tmp_path / "big.pt", "-m", model, "-o", tmp_path / f"o{fp8}",
                "--fp8", fp8, "--dtype", "fp32")
        assert r.exit_code == 0, r.output
        assert seen[-1].decode_shape == want


def test_output_names_that_cannot_be_meant(tmp_path, samples_dir, monkeypatch):
    """Regression: `-o -` made a folder named '-'; `-o out.png.` (a trailing dot) silently became a
    folder; `-o noext` naming an existing file said "pass --overwrite", after which it failed with "noext is a file,
    not a folder". Each is refused before the checkpoint loads, with nothing written."""
    from vaeopt import loading

    m = samples_dir / "tiny_kl_image.safetensors"
    torch.save(_small_latents(tmp_path, samples_dir)["coffee"], tmp_path / "l.pt")
    loads = []
    real = loading.load_vae
    monkeypatch.setattr(loading, "load_vae", lambda *a, **k: loads.append(a) or real(*a, **k))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "noext").touch()
    cases = {"-": "error: -o -: writing to stdout is not supported; give a file (out.png, out.mp4, out.safetensors) "
                  "or a folder (out/)",
             "out.png.": "error: -o out.png.: the name ends in '.', likely a typo; name a .png/.mp4/.safetensors "
                         "file, or a folder with a trailing '/' (out.png./) if that is the name you want",
             "noext": "error: -o noext: a name without a suffix is a folder output, but noext is a file, which "
                      "--overwrite does not replace with a folder; name a .png/.mp4/.safetensors file, or another "
                      "folder (nothing was written)"}
    for o, msg in cases.items():
        for extra in ([], ["--overwrite"]):
            r = run("decode", "l.pt", "-m", m, "-o", o, *extra)
            assert r.exit_code == 2 and msg in " ".join(r.output.split()) and loads == [], r.output
    assert sorted(os.listdir(tmp_path)) == ["l.pt", "noext"] and (tmp_path / "noext").stat().st_size == 0
    # what stays accepted: an explicit folder of that name, an existing one, and "."
    r = run("decode", "l.pt", "-m", m, "-o", "out.png./")
    assert r.exit_code == 0 and (tmp_path / "out.png." / "l.png").is_file(), r.output
    r = run("decode", "l.pt", "-m", m, "-o", "out.png.", "--overwrite")
    assert r.exit_code == 0, r.output
    r = run("decode", "l.pt", "-m", m, "-o", ".")
    assert r.exit_code == 0 and (tmp_path / "l.png").is_file(), r.output


def test_latent_space_takes_any_case(tmp_path, samples_dir):
    """Regression: --latent-space RAW was refused ("must be 'scaled' or 'raw', got 'RAW'")."""
    m = samples_dir / "tiny_kl_image.safetensors"
    torch.save(_small_latents(tmp_path, samples_dir)["coffee"], tmp_path / "l.pt")
    for i, space in enumerate(("RAW", "Scaled")):
        r = run("decode", tmp_path / "l.pt", "-m", m, "-o", tmp_path / f"o{i}.png", "--latent-space", space, "-v")
        assert r.exit_code == 0 and f"(pt, {space.lower()} latents)" in r.output, r.output
    r = run("decode", tmp_path / "l.pt", "-m", m, "-o", tmp_path / "o.png", "--latent-space", "Pixel")
    assert r.exit_code == 2 and "--latent-space must be 'scaled' or 'raw', got 'Pixel'" in r.output
    assert not (tmp_path / "o.png").exists()


def test_clashing_outputs_get_advice_that_helps(tmp_path, samples_dir):
    """Regression: p.pt holding {'q', 'r'} beside p_q.pt both write p_q.png; the error said "pass -o a
    folder", where they clash again. A folder is suggested only where it tells the outputs apart (the same folder
    reached through a symlink); otherwise: rename an input, or separate runs (--key for the dict's tensor)."""
    m = samples_dir / "tiny_kl_image.safetensors"
    z = _small_latents(tmp_path, samples_dir)["coffee"]
    d = tmp_path / "cc"
    d.mkdir()
    torch.save({"q": z, "r": z}, d / "p.pt")
    torch.save(z, d / "p_q.pt")
    fix = ("rename one of the inputs, or decode them in separate runs, each with its own -o (--key q decodes "
           f"{d / 'p.pt'}[q] alone)")
    for o in ([], ["-o", str(tmp_path / "out") + "/"]):
        r = run("decode", d / "p.pt", d / "p_q.pt", "-m", m, *o)
        out = " ".join(r.output.split())
        assert r.exit_code == 2 and f"two inputs ({d / 'p.pt'}[q] and {d / 'p_q.pt'}) would write the same " \
            "output " in out and out.endswith(fix), r.output
        assert "pass -o a folder" not in out
    assert sorted(os.listdir(d)) == ["p.pt", "p_q.pt"] and not (tmp_path / "out").exists()
    (tmp_path / "link").symlink_to(d)  # one folder under two names: beside the inputs they meet, in -o DIR/ not
    r = run("decode", d / "p_q.pt", tmp_path / "link" / "p_q.pt", "-m", m)
    assert r.exit_code == 2 and " ".join(r.output.split()).endswith("would write the same output "
                                                                     f"{d / 'p_q.png'}: pass -o a folder"), r.output
    r = run("decode", d / "p_q.pt", tmp_path / "link" / "p_q.pt", "-m", m, "-o", str(tmp_path / "out") + "/")
    assert r.exit_code == 0 and sorted(os.listdir(tmp_path / "out")) == ["cc_p_q.png", "link_p_q.png"], r.output


def test_default_output_is_short_quiet_is_silent_verbose_has_the_stages(tmp_path, samples_dir):
    """A default decode says what was read, the model, one line of what the optimizer did, and each file with its
    plan and time, in a few short lines; -q prints nothing on success; -v has every stage's line."""
    (tmp_path / "l.pt").write_bytes(b"")
    torch.save(_small_latents(tmp_path, samples_dir), tmp_path / "l.pt")
    (tmp_path / "vaeopt.json").write_text(json.dumps(
        {"files": {"l.pt": {"model": str(samples_dir / "tiny_kl_image.safetensors"), "family": "sd15"}}}))
    r = run("decode", tmp_path / "l.pt", "-o", tmp_path / "both.png")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert len(lines) <= 8 and all(len(ln) <= 100 + len(str(tmp_path)) for ln in lines), r.output
    assert lines[0].startswith("read l.pt: astronaut 1x4x8x8, coffee 1x4x8x8")
    assert lines[1].startswith("model tiny_kl_image.safetensors: Stable Diffusion 1.x")
    assert lines[2].startswith("optimized: channels_last (fp32, CPU") and "-v for details" in lines[2]
    assert "assumed" not in r.output  # the manifest names the family
    assert "✓" not in r.output and "fp8: skipped" not in r.output  # the stage lines are -v's
    # -o both.png on a dict of two tensors: both_<key>.png (not both_l_astronaut.png)
    assert sorted(p.name for p in tmp_path.glob("both*.png")) == ["both_astronaut.png", "both_coffee.png"]
    assert f"wrote {tmp_path / 'both_astronaut.png'}  (whole decode in " in r.output
    r = run("decode", tmp_path / "l.pt", "-o", tmp_path / "q.png", "-q")
    assert r.exit_code == 0 and r.output == "" and (tmp_path / "q_coffee.png").is_file()
    r = run("decode", tmp_path / "l.pt", "-o", tmp_path / "q.png", "-q")  # errors still print under -q
    assert r.exit_code == 2 and r.output.startswith("error:") and "already exists" in r.output
    r = run("decode", tmp_path / "l.pt", "-o", tmp_path / "v.png", "-v")
    assert r.exit_code == 0, r.output
    assert "✓ channels_last: converted" in r.output and "– fp8: skipped" in r.output and "plan l.pt[coffee]" in r.output
    assert "family sd15 as requested" in r.output and "(family sd15: named by vaeopt.json beside the latents)" in r.output
    r = run("decode", tmp_path / "l.pt", "-v", "-q")
    assert r.exit_code == 2 and "contradict" in r.output
    # without the manifest's family the guess is said in one short line (in full with -v)
    (tmp_path / "vaeopt.json").write_text(json.dumps(
        {"files": {"l.pt": {"model": str(samples_dir / "tiny_kl_image.safetensors")}}}))
    r = run("decode", tmp_path / "l.pt", "-o", tmp_path / "g.png")
    guess = [ln for ln in r.output.splitlines() if "assumed" in ln]
    assert r.exit_code == 0 and len(guess) == 1 and len(guess[0]) <= 100 and "--family sdxl" in guess[0], r.output
    (tmp_path / "vaeopt.json").write_text(json.dumps({"files": {"l.pt": {"model": "x", "family": 15}}}))
    r = run("decode", tmp_path / "l.pt")
    assert r.exit_code == 2 and '"family" must be a family name' in r.output


def test_optimizer_summary_says_what_ran_or_why_not():
    from vaeopt.cli.report import optimizer_summary
    from vaeopt.stages import StageResult

    cpu = torch.device("cpu")
    st = [StageResult("precision", "applied", "bf16"), StageResult("fused_norms", "applied", "x"),
          StageResult("channels_last", "applied", "x"), StageResult("upsample_conv", "applied", "x"),
          StageResult("attention", "applied", "x"), StageResult.skipped("fp8", "off")]
    line = optimizer_summary(st, torch.device("cuda", 0), torch.bfloat16)
    assert line.startswith("optimized: fused norms, channels_last, upsample convs, attention (bf16, cuda:0")
    assert len(line) <= 100
    many = st + [StageResult(n, "applied", "x") for n in ("fused_epilogues", "stacked_conv3d", "triton_conv", "graphs")]
    line = optimizer_summary(many, torch.device("cuda", 0), torch.bfloat16)
    assert len(line) <= 104 and line.startswith("optimized: fused norms, channels_last") and " more (bf16" in line
    plain = [StageResult("precision", "applied", "fp32")] + [StageResult.skipped(n, "off") for n in ("fp8", "x")]
    assert "plain diffusers decode" in optimizer_summary(plain, cpu, torch.float32) and "switched off" in \
        optimizer_summary(plain, cpu, torch.float32)
    fell = st + [StageResult("triton_conv", "fallback", "x")]
    assert "fell back: Triton convs" in optimizer_summary(fell, torch.device("cuda", 0), torch.bfloat16)


def test_argument_mistakes_are_reported_before_torch_loads(tmp_path):
    """A missing input or a bad -o is reported before torch and diffusers are imported (seconds): at once."""
    import time

    code = ("import sys\nfrom vaeopt.cli import app\n"
            "try:\n    app(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
            "print('torch loaded' if 'torch' in sys.modules else 'torch not loaded', code)\n")
    for args, msg in (([str(tmp_path / "missing.pt")], "missing.pt: no such file"),
                      ([__file__, "-o", str(tmp_path / "x.jpg")], "unknown output type '.jpg'"),
                      ([__file__, "-o", ".png"], "a suffix alone is not a file name")):
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-c", code, "decode", *args], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "COLUMNS": "200"})
        took = time.perf_counter() - t0
        assert "torch not loaded 2" in p.stdout and msg in p.stderr, (p.stdout, p.stderr)
        assert took < 10, took  # (about 0.5 s on an idle machine; the bound is loose for busy test runners)


def test_progress_bar_on_a_terminal_only(tmp_path, samples_dir, monkeypatch):
    """A decode that runs for a while shows a progress bar (tiles or frames done, the rate) on a terminal; not in a
    log or a pipe, and not with -q."""
    import io

    from rich.console import Console

    from vaeopt.cli import printing, report

    torch.save(_small_latents(tmp_path, samples_dir)["coffee"].repeat(1, 1, 2, 2), tmp_path / "l.pt")
    m = samples_dir / "tiny_kl_image.safetensors"
    monkeypatch.setattr(report.DecodeProgress, "SHOW_AFTER_S", 0.0)
    r = run("decode", tmp_path / "l.pt", "-m", m, "--family", "sd15", "--tile", "8", "-o", tmp_path / "a.png")
    assert r.exit_code == 0 and "tiles/s" not in r.output and "tiles of 8 latent px" in r.output, r.output
    buf = io.StringIO()
    monkeypatch.setattr(printing, "console", Console(file=buf, force_terminal=True, width=120, highlight=False))
    r = run("decode", tmp_path / "l.pt", "-m", m, "--family", "sd15", "--tile", "8", "-o", tmp_path / "b.png")
    assert r.exit_code == 0
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buf.getvalue())
    assert "l.pt tiles" in shown and "tiles/s" in shown and re.search(r"\b(\d+)/\1\b", shown), shown[-400:]
    buf.truncate(0)
    r = run("decode", tmp_path / "l.pt", "-m", m, "--family", "sd15", "--tile", "8", "-o", tmp_path / "c.png", "-q")
    assert r.exit_code == 0 and buf.getvalue().strip("\x00") == ""


def test_api_decode_reports_tile_progress(samples_dir):
    import vaeopt

    z = torch.load(samples_dir / "tiny_kl_image_latents.pt", weights_only=True)["coffee"][:, :, :16, :16].float()
    calls = []
    out = vaeopt.decode(z, samples_dir / "tiny_kl_image.safetensors", options=vaeopt.Options(device="cpu", tile=8),
                        progress=lambda d, t: calls.append((d, t)))
    assert out.shape == (1, 3, 128, 128)
    assert calls and calls[-1][0] == calls[-1][1] and [d for d, _ in calls] == sorted(d for d, _ in calls)
    zv = torch.load(samples_dir / "tiny_wan_video_latents.pt", weights_only=True)["astronaut_pan"][:, :, :3, :8, :8].float()
    calls = []
    out = vaeopt.decode(zv, samples_dir / "tiny_wan_video.safetensors", latent_space="raw",
                        options=vaeopt.Options(device="cpu", chunk=1), progress=lambda d, t: calls.append((d, t)))
    assert out.shape[2] == 9 and calls == [(1, 9), (5, 9), (9, 9)]  # frames out after each latent frame's call


def test_output_links_are_never_followed_and_devices_refused_before_the_load(tmp_path, samples_dir):
    """-o a dangling link: refused (exit 2) without --overwrite, nothing written where it points; with --overwrite
    the link itself becomes the PNG. -o /dev/null: refused before the model is loaded."""
    torch.save(torch.randn(1, 4, 4, 4), tmp_path / "l.pt")
    model = samples_dir / "tiny_kl_image.safetensors"
    out = tmp_path / "out.png"
    out.symlink_to(tmp_path / "elsewhere.png")
    r = run("decode", tmp_path / "l.pt", "-m", model, "-o", out)
    assert r.exit_code == 2 and "as a symbolic link" in r.output and "load" not in r.output, r.output
    assert not (tmp_path / "elsewhere.png").exists() and out.is_symlink()
    r = run("decode", tmp_path / "l.pt", "-m", model, "-o", out, "--overwrite")
    assert r.exit_code == 0, r.output
    assert not out.is_symlink() and out.is_file() and not (tmp_path / "elsewhere.png").exists()
    r = run("decode", tmp_path / "l.pt", "-m", model, "-o", "/dev/null", "--overwrite")
    assert r.exit_code == 2 and "never replaces a device" in r.output and "load" not in r.output, r.output


def test_work_per_input_file_is_bounded_before_the_first_decode(tmp_path, samples_dir):
    """A 40 KB .pt whose list holds one 1x1 latent 20,000 times is refused when read (before the model loads); a batch
    asking for more outputs or more GB than allowed is refused after planning, before anything is decoded; each
    bound says how to allow more."""
    model = samples_dir / "tiny_kl_image.safetensors"
    one = torch.randn(1, 4, 1, 1)
    torch.save([one] * 20000, tmp_path / "many.pt")
    r = run("decode", tmp_path / "many.pt", "-m", model, "-o", tmp_path / "out/")
    assert r.exit_code == 2 and "20000 tensors (1 distinct" in r.output and "--max-outputs 20000" in r.output
    assert "load" not in r.output and not (tmp_path / "out").exists(), r.output
    torch.save(torch.randn(5, 4, 64, 64), tmp_path / "b.pt")
    r = run("decode", tmp_path / "b.pt", "-m", model, "-o", tmp_path / "o.png", "--max-outputs", "3")
    assert r.exit_code == 2 and "asks for 5 outputs" in r.output and "pass --max-outputs 5" in r.output, r.output
    assert "optimize" not in r.output and not list(tmp_path.glob("o*.png"))
    r = run("decode", tmp_path / "b.pt", "-m", model, "-o", tmp_path / "o.png", "--max-output-gb", "0.001")
    assert r.exit_code == 2 and "would be 3.9 MB decoded (8-bit RGB)" in r.output, r.output
    assert "--max-output-gb 1 to allow it" in r.output and "optimize" not in r.output
    r = run("decode", tmp_path / "b.pt", "-m", model, "-o", tmp_path / "o.png", "--max-outputs", "0")
    assert r.exit_code == 2 and "--max-outputs must be" in r.output


def test_a_full_disk_mid_batch_leaves_nothing_and_says_so(tmp_path, samples_dir, monkeypatch):
    """A batch of 3 into a folder vaeopt makes (-o out/): the disk fills at the 2nd PNG. No PNG of the batch stays,
    no temporary, and the folder vaeopt made is removed; the message says none of the batch was written."""
    from vaeopt import outputs

    calls = []
    real_save = outputs._save_png

    def full_on_second(t, im):
        calls.append(t)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(t, im)

    monkeypatch.setattr(outputs, "_save_png", full_on_second)
    torch.save(torch.randn(3, 4, 8, 8), tmp_path / "b.pt")
    for out in (f"{tmp_path / 'out'}/", tmp_path / "new" / "out.png"):  # a folder the CLI makes; one a write makes
        calls.clear()
        r = run("decode", tmp_path / "b.pt", "-m", samples_dir / "tiny_kl_image.safetensors", "-o", out)
        assert r.exit_code == 2, r.output
        line = next(ln for ln in r.output.splitlines() if ln.startswith("error"))
        assert "disk full" in line and "none of the batch's 3 outputs was written" in line, r.output
        assert "wrote" not in r.output and "nothing was left behind" not in r.output
        assert sorted(os.listdir(tmp_path)) == ["b.pt"]


def test_a_full_disk_at_a_later_input_says_what_was_kept(tmp_path, samples_dir, monkeypatch):
    """Two inputs, the disk fills at the second's PNG: the first input's output stays (it landed whole), and the
    message says so, naming it, instead of claiming nothing was left."""
    from vaeopt import outputs

    calls = []
    real_save = outputs._save_png

    def full_on_second(t, im):
        calls.append(t)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(t, im)

    monkeypatch.setattr(outputs, "_save_png", full_on_second)
    for n in ("a", "b"):
        torch.save(torch.randn(1, 4, 8, 8), tmp_path / f"{n}.pt")
    out = tmp_path / "out"
    r = run("decode", tmp_path / "a.pt", tmp_path / "b.pt", "-m", samples_dir / "tiny_kl_image.safetensors", "-o",
            f"{out}/")
    assert r.exit_code == 2, r.output
    line = next(ln for ln in r.output.splitlines() if ln.startswith("error"))
    assert "b.png: disk full" in line and "kept the 1 output(s) written before it" in line and "a.png" in line, line
    assert sorted(os.listdir(out)) == ["a.png"]


def test_decode_without_diffusers_is_one_line(tmp_path, samples_dir, monkeypatch):
    """A missing (or broken) diffusers install: `vaeopt decode` says what to install in one line, exit 2, and
    writes nothing; it is not reported as a bug of vaeopt's."""
    monkeypatch.setitem(sys.modules, "diffusers", None)  # every `import diffusers...` raises ImportError
    out = tmp_path / "out"
    r = run("decode", samples_dir / "tiny_kl_image_latents.pt", "--model", samples_dir / "tiny_kl_image.safetensors",
            "--device", "cpu", "-o", f"{out}/")
    assert r.exit_code == 2, r.output
    assert "diffusers is not installed" in r.output and "pip install diffusers" in r.output
    assert "vaeopt bug" not in r.output and "Traceback" not in r.output
    assert not out.exists()


def test_bad_option_values_are_reported_before_torch_loads(tmp_path):
    """A misspelled switch, dtype or device, or an out-of-range number, is an argument mistake like a missing file:
    reported before torch and diffusers are imported (seconds on a busy machine), not after."""
    code = ("import sys\nfrom vaeopt.cli import app\n"
            "try:\n    app(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
            "print('torch loaded' if 'torch' in sys.modules else 'torch not loaded', code)\n")
    for args, msg in ((["--channels-last", "maybe"], "channels_last (--channels-last) must be one of auto, on, off"),
                      (["--fp8", "bogus"], "fp8 (--fp8) must be one of"),
                      (["--tile", "-3"], "--tile -3: tiles must be at least 8 latent pixels"),
                      (["--tile", "16", "--tiling", "off"], "--tile conflicts with --tiling off"),
                      (["--chunk", "0"], "--chunk 0: must be at least 1 latent frame"),
                      (["--vram-budget", "-1"], "--vram-budget must be a positive number of GB"),
                      (["--dtype", "fp64"], "unknown dtype 'fp64' (auto, fp32, bf16, fp16)"),
                      (["--device", "tpu"], "--device tpu: expected cpu, cuda or cuda:N"),
                      (["--gpus", "0"], "--gpus must be at least 1"),
                      (["--height", "64"], "--height and --width go together, as positive pixel counts (got 64, None)"),
                      (["--height", "64", "--width", "0"], "--height and --width go together"),
                      (["--max-outputs", "0"], "--max-outputs must be a whole number of at least 1"),
                      (["--max-output-gb", "-2"], "--max-output-gb must be a positive number of GB"),
                      # a GPU asked of a CPU-only torch (this machine's, where it is one)
                      *([(["--device", "cuda"], f"no CUDA GPU is visible to torch {torch.__version__} (a CPU-only")]
                        if torch.version.cuda is None and torch.version.hip is None else [])):
        p = subprocess.run([sys.executable, "-c", code, "decode", __file__, *args], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "COLUMNS": "200"})
        assert "torch not loaded 2" in p.stdout and msg in p.stderr, (args, p.stdout, p.stderr)


@pytest.mark.parametrize("text,expected", [
    ("__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\nhip: Optional[str] = None\n", "2.13.0+cpu"),
    ("__version__ = '2.13.0+cu130'\ncuda: Optional[str] = '13.0'\nhip: Optional[str] = None\n", None),
    ("__version__ = '2.13.0+rocm7.0'\ncuda: Optional[str] = None\nhip: Optional[str] = '7.0'\n", None),
    ("__version__ = '2.13.0'\n", None),  # a version file that does not say: torch answers later
    (None, None),  # none at all
])
def test_cpu_only_torch_is_read_from_its_version_file(tmp_path, monkeypatch, text, expected):
    """`--device cuda` on a CPU-only torch is refused before torch loads, from torch/version.py read as text; any
    doubt (a GPU build, no such file, torch already imported) leaves the answer to torch."""
    import importlib.util
    import types

    from vaeopt import options

    pkg = tmp_path / "torch"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    if text is not None:
        (pkg / "version.py").write_text("from typing import Optional\n" + text)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: types.SimpleNamespace(origin=str(pkg / "__init__.py")))
    monkeypatch.delitem(sys.modules, "torch")
    assert options.cpu_only_torch() == expected
    monkeypatch.setitem(sys.modules, "torch", torch)  # imported: torch.cuda answers, not the file
    assert options.cpu_only_torch() is None


def test_read_only_output_folder_is_refused_before_the_decode(tmp_path, samples_dir):
    """-o into a folder the user cannot write (a file, a folder, a sub-folder to make): one line naming the folder,
    exit 2, nothing written, before any decode. As root, the child runs without the capability that overrides file
    modes, as an ordinary user's process would."""
    import shutil

    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root, and no setpriv to drop the override of file modes")
        prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    torch.save(torch.randn(1, 4, 8, 8), tmp_path / "l.pt")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if subprocess.run([*prefix, "touch", str(ro / "probe")], capture_output=True).returncode == 0:
            pytest.skip("this filesystem lets the folder be written despite its mode")
        for out in (ro / "out.png", f"{ro}/", ro / "sub" / "out.png"):
            p = subprocess.run([*prefix, sys.executable, "-m", "vaeopt", "decode", str(tmp_path / "l.pt"), "-m",
                                str(samples_dir / "tiny_kl_image.safetensors"), "-o", str(out)],
                               capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
            assert p.returncode == 2 and f"folder {ro} is not writable" in p.stderr, (out, p.stdout, p.stderr)
            assert "Traceback" not in p.stderr and not list(ro.iterdir())
    finally:
        ro.chmod(0o755)


def test_missing_model_is_reported_before_torch_loads(tmp_path):
    """-m naming a checkpoint file that is not there is a typo like a missing latent file: said at once, in the
    loader's words, not after torch, diffusers and the latents have loaded."""
    code = ("import sys\nfrom vaeopt.cli import app\n"
            "try:\n    app(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
            "print('torch loaded' if 'torch' in sys.modules else 'torch not loaded', code)\n")
    missing = tmp_path / "nope.safetensors"
    p = subprocess.run([sys.executable, "-c", code, "decode", __file__, "-m", str(missing)], capture_output=True,
                       text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert "torch not loaded 2" in p.stdout and f"checkpoint not found: {missing}" in p.stderr, (p.stdout, p.stderr)


def test_benchmark_and_warmup_argument_mistakes_before_torch_loads():
    """benchmark's and warmup's argument mistakes (a bad --shape, --repeats, --dtype, --device, workload name,
    FP8 gate) are said before torch loads, as decode's are: at once, not seconds later."""
    code = ("import sys\nfrom vaeopt.cli import app\n"
            "try:\n    app(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
            "print('torch loaded' if 'torch' in sys.modules else 'torch not loaded', code)\n")
    for args, msg in ((["benchmark"], "give a checkpoint, --family or --workload"),
                      (["benchmark", "--shape", "foo"], "--shape 'foo': expected integers like 1,4,128,128"),
                      (["benchmark", "--shape", "1,4,0,8"], "every dimension must be at least 1"),
                      (["benchmark", "--repeats", "0"], "--repeats must be at least 1, got 0"),
                      (["benchmark", "--warmup", "-1"], "--warmup must be 0 or more, got -1"),
                      (["benchmark", "--fp8-gate", "-5"], "--fp8-gate must be a PSNR in dB"),
                      (["benchmark", "--dtype", "fp64"], "unknown dtype 'fp64'"),
                      (["benchmark", "--device", "tpu"], "--device tpu: expected cpu, cuda or cuda:N"),
                      (["benchmark", "--workload", "nope"], "unknown workload 'nope' (known: sdxl-1024"),
                      (["benchmark", "--peers", "bogus"], "--peers: unknown bogus (choose from fp32, bf16, tiling, "
                                                          "compile)"),
                      (["warmup", "--shape", "1,4,x"], "--shape '1,4,x': expected integers"),
                      (["warmup", "--dtype", "fp64"], "unknown dtype 'fp64'"),
                      (["warmup", "--fp8", "bogus"], "fp8 (--fp8) must be one of"),
                      (["warmup", "--device", "tpu"], "--device tpu: expected cpu, cuda or cuda:N")):
        p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "COLUMNS": "200"})
        assert "torch not loaded 2" in p.stdout and msg in p.stderr, (args, p.stdout, p.stderr)



def test_output_naming_an_input_or_the_model_is_said_before_torch_loads(tmp_path):
    """-o naming the latent file or the checkpoint itself (even with --overwrite) is refused at once, in the words
    the planner uses, not after torch, diffusers and the model have loaded."""
    code = ("import sys\nfrom vaeopt.cli import app\n"
            "try:\n    app(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
            "print('torch loaded' if 'torch' in sys.modules else 'torch not loaded', code)\n")
    z, m = tmp_path / "z.safetensors", tmp_path / "vae.safetensors"
    z.write_bytes(b"x" * 64)
    m.write_bytes(b"y" * 64)
    for args, msg in ((["-o", str(z)], "would overwrite an input latent file (even --overwrite does not replace"),
                      (["-o", str(m)], "would overwrite the model (even --overwrite does not replace")):
        p = subprocess.run([sys.executable, "-c", code, "decode", str(z), "-m", str(m), "--overwrite", *args],
                           capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
        assert "torch not loaded 2" in p.stdout and msg in p.stderr, (args, p.stdout, p.stderr)
    assert z.read_bytes() == b"x" * 64 and m.read_bytes() == b"y" * 64


def test_latent_mistakes_are_reported_before_the_model_loads(tmp_path, samples_dir, monkeypatch):
    """NaN/Inf in the latents, and a wrong channel count where the family is named (--family, or vaeopt.json beside
    the latents), are refused before the checkpoint loads (seconds), with the line the check after the load gives;
    nothing is written. A family the weights alone would tell still gets the check after the load."""
    import time

    import vaeopt.loading

    model = samples_dir / "tiny_kl_image.safetensors"
    torch.save(torch.randn(1, 8, 8, 8), tmp_path / "c8.pt")
    nan = torch.randn(4, 8, 8)
    nan[0, 1, 2] = float("nan")
    torch.save(nan, tmp_path / "nan.pt")
    late = {name: run("decode", tmp_path / name, "-m", model, "-o", tmp_path / "o.png").output
            for name in ("c8.pt", "nan.pt")}  # the model loads (its family from the weights), then the check

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(vaeopt.loading, "load_vae", no_load)
    (tmp_path / "m").mkdir()
    torch.save(torch.randn(1, 8, 8, 8), tmp_path / "m" / "c8.pt")
    (tmp_path / "m" / "vaeopt.json").write_text(json.dumps({"model": str(model), "family": "sd15"}))
    for args in ((tmp_path / "nan.pt", "-m", model), (tmp_path / "c8.pt", "-m", model, "--family", "sd15"),
                 (tmp_path / "m" / "c8.pt",)):
        t0 = time.perf_counter()
        r = run("decode", *args, "-o", tmp_path / "o.png")
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
        assert time.perf_counter() - t0 < 1.0  # (torch is imported already in this process)
        assert "non-finite value (1 NaN, 0 Inf) in (4, 8, 8) latents" in r.output or "8 latent channels" in r.output
        error = next(line for line in r.output.splitlines() if line.startswith("error:"))
        error = error.replace(str(args[0]), str(tmp_path / args[0].name))  # (m/c8.pt: the same file name)
        assert error in late[args[0].name].splitlines(), (r.output, late)  # the line the check after the load gives
    assert not (tmp_path / "o.png").exists()


def test_unknown_family_is_reported_before_torch_loads():
    """--family with a name no family has is an argument mistake like a bad --dtype: decode, benchmark and warmup say
    so before torch loads (at once), not after the latents, torch and diffusers (seconds)."""
    code = ("import sys\nfrom vaeopt.cli import app\n"
            "try:\n    app(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
            "print('torch loaded' if 'torch' in sys.modules else 'torch not loaded', code)\n")
    for args in (["decode", __file__, "--family", "foo"], ["benchmark", "--family", "foo", "--shape", "1,4,8,8"],
                 ["warmup", "--family", "foo"]):
        p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "COLUMNS": "200"})
        assert "torch not loaded 2" in p.stdout, (args, p.stdout, p.stderr)
        assert "unknown family 'foo'. Known: sd15, sd2, sdxl" in p.stderr, (args, p.stderr)


def test_benchmark_output_names_refused_before_torch_loads(tmp_path):
    """--json naming a file that is not .json, or --plot one that is not .png, is a typo in the arguments: said
    before torch loads, as a bad --shape is, not seconds later."""
    code = ("import sys\nfrom vaeopt.cli import app\n"
            "try:\n    app(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
            "print('torch loaded' if 'torch' in sys.modules else 'torch not loaded', code)\n")
    for args, msg in ((["--json", str(tmp_path / "r.txt")], "the results are a JSON file; give a .json file name"),
                      (["--plot", str(tmp_path / "p.jpg")], "the chart is a PNG; give a .png file name")):
        p = subprocess.run([sys.executable, "-c", code, "benchmark", "--family", "sd15", "--shape", "1,4,8,8", *args],
                           capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
        assert "torch not loaded 2" in p.stdout and msg in p.stderr, (args, p.stdout, p.stderr)
    assert not any(tmp_path.iterdir())


def test_integer_and_meta_latents_are_refused_before_the_model_loads(tmp_path, samples_dir, monkeypatch):
    """A file's one tensor that is integer or has no values (meta) is refused whatever the VAE: before the checkpoint
    loads, with the line the check after the load gives."""
    import vaeopt.loading

    model = samples_dir / "tiny_kl_image.safetensors"
    torch.save(torch.randint(0, 5, (1, 4, 8, 8)), tmp_path / "int.pt")
    torch.save(torch.empty(1, 4, 8, 8, device="meta"), tmp_path / "meta.pt")
    late = {name: run("decode", tmp_path / name, "-m", model, "-o", tmp_path / "o.png").output
            for name in ("int.pt", "meta.pt")}

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(vaeopt.loading, "load_vae", no_load)
    for name, msg in (("int.pt", "latents must be floating point, got torch.int64"),
                      ("meta.pt", "a tensor on the meta device: it has a shape (1, 4, 8, 8) but no values")):
        r = run("decode", tmp_path / name, "-m", model, "-o", tmp_path / "o.png")
        assert r.exit_code == 2 and "Traceback" not in r.output and msg in r.output, r.output
        error = next(line for line in r.output.splitlines() if line.startswith("error:"))
        assert error in late[name].splitlines(), (r.output, late)
    assert not (tmp_path / "o.png").exists()


def test_a_latent_file_given_twice_is_said_before_torch_loads(tmp_path):
    """The same latent file named twice (a.pt and ./a.pt alike) is an argument mistake: said at once, in the words
    the planner uses, not after torch, the latents and the model have loaded."""
    code = ("import sys\nfrom vaeopt.cli import app\n"
            "try:\n    app(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
            "print('torch loaded' if 'torch' in sys.modules else 'torch not loaded', code)\n")
    z = tmp_path / "z.pt"
    z.write_bytes(b"x" * 64)
    (tmp_path / "vae.pt").write_bytes(b"y" * 64)
    (tmp_path / "sub").mkdir()
    again = tmp_path / "sub" / ".." / "z.pt"
    p = subprocess.run([sys.executable, "-c", code, "decode", str(z), str(again), "-m", str(tmp_path / "vae.pt")],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert "torch not loaded 2" in p.stdout, (p.stdout, p.stderr)
    assert f"error: {again}: given twice (also as {z}); name each latent file once" in p.stderr, p.stderr


def test_missing_config_is_reported_before_torch_loads(tmp_path):
    """--config naming a file that is not there (or a folder without config.json) is a typo like a missing -m: said
    at once, in the loader's words, not after torch, the latents and diffusers have loaded."""
    code = ("import sys\nfrom vaeopt.cli import app\n"
            "try:\n    app(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
            "print('torch loaded' if 'torch' in sys.modules else 'torch not loaded', code)\n")
    (tmp_path / "empty").mkdir()
    for config, msg in ((tmp_path / "nope.json", f"config file not found: {tmp_path / 'nope.json'}"),
                        (tmp_path / "empty", f"config file not found: the folder {tmp_path / 'empty'} has no "
                                             "config.json")):
        p = subprocess.run([sys.executable, "-c", code, "decode", __file__, "--config", str(config)],
                           capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
        assert "torch not loaded 2" in p.stdout and msg in p.stderr, (config, p.stdout, p.stderr)
