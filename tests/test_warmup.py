"""`vaeopt warmup` (vaeopt/warmup.py): decodes the planned shapes once, fills the caches, says what and where; a later
`vaeopt decode` of the same checkpoint and size reuses the FP8 verdict instead of probing."""

import json

import torch
from typer.testing import CliRunner

from vaeopt import cache
from vaeopt.cli import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def test_warmup_then_decode_reuses_the_fp8_verdict(tmp_path, samples_dir, monkeypatch):
    from vaeopt.quant import gate

    probes = []
    real = gate._decode
    monkeypatch.setattr(gate, "_decode", lambda model, z: (probes.append(1), real(model, z))[1])
    model = samples_dir / "tiny_kl_image.safetensors"
    r = run("warmup", model, "--shape", "1,4,16,16", "--shape", "1x4x8x12", "--fp8", "weights", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout[r.stdout.index("{"):r.stdout.rindex("}") + 1])
    assert [s["shape"] for s in doc["shapes"]] == [[1, 4, 16, 16], [1, 4, 8, 12]]
    assert all("whole decode" in s["plan"] and s["seconds"] > 0 for s in doc["shapes"])
    assert doc["cache_dir"] == str(cache.cache_dir()) and len(doc["written"]) == 1 and "fp8_gate" in doc["written"][0]
    assert f"vaeopt's cache: {cache.cache_dir()} (1 entry written: fp8_gate)" in r.output
    assert ("Triton: not used on the CPU" in r.output or "Triton: not installed" in r.output)
    assert "Triton's kernel cache" not in r.output  # (a CPU warm-up keeps nothing of Triton's)
    n = len(probes)
    assert n >= 3
    lat = torch.load(samples_dir / "tiny_kl_image_latents.pt", weights_only=True)["coffee"][:, :, :16, :16]
    torch.save(lat, tmp_path / "z.pt")
    r = run("decode", tmp_path / "z.pt", "-m", model, "-o", tmp_path / "out.png", "--fp8", "weights", "-v")
    assert r.exit_code == 0, r.output
    assert len(probes) == n  # the decode did not probe
    assert "verdict reused from" in r.output and (tmp_path / "out.png").is_file()
    r = run("warmup", model, "--shape", "1,4,16,16", "--fp8", "weights")  # again: nothing new
    assert r.exit_code == 0 and "nothing new to store" in r.output and len(probes) == n


def test_warmup_bad_input_is_one_line_exit_2(samples_dir):
    model = samples_dir / "tiny_kl_image.safetensors"
    for args, msg in ((["--shape", "1,4,x"], "expected integers"),
                      (["--shape", "1,16,8,8"], "does not fit"),
                      (["--shape", "1,4,0,8"], "at least 1"),
                      (["--fp8", "maybe"], "must be one of")):
        r = run("warmup", model, *args)
        assert r.exit_code == 2 and msg in r.output and "Traceback" not in r.output, (args, r.output)
    r = run("warmup")
    assert r.exit_code == 2 and "checkpoint, --workload or --family" in r.output
    r = run("warmup", "--workload", "nope")
    assert r.exit_code == 2 and "unknown workload" in r.output


def test_warmup_workload_random_weights_and_its_default_shape(monkeypatch):
    """--workload: its family's architecture with random weights; without --shape the workload's latent shape (here
    decoded at a small --shape: the 512² decode of the full-width model takes long on a CPU)."""
    from vaeopt import warmup as wu

    loaded, shapes = wu.load(None, "sd15-512", None, None)
    assert loaded.family.name == "sd15" and shapes == [(1, 4, 64, 64)] and loaded.layout == "random-init"
    _, shapes = wu.load(None, "sd15-512", None, ["1,4,8,8"])
    assert shapes == [(1, 4, 8, 8)]
    rep = wu.run(loaded, shapes, log=None)
    assert rep.shapes[0].shape == (1, 4, 8, 8) and rep.written == []  # fp8 off: nothing to store but kernels
    assert "nothing new to store" in "\n".join(wu.summary(rep))
