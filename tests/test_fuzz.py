"""Mutation fuzzing of every reader vaeopt points at a user's files, through the CLI as a user runs it.

Each reader gets valid seed files (latents as .pt, .safetensors, .npy, .npz and ComfyUI .latent; a checkpoint;
a vaeopt.json manifest; a --config config.json), mutated by hypothesis (bytes flipped, set to edge values, 8-byte
lengths overwritten, inserted, deleted, truncated; JSON values replaced by arbitrary JSON). The property, for every
mutant: exit 0 with a real decoded image in -o, or exit 2 with one "error:" line; never exit 1 (an internal error),
a traceback, a hang (an alarm fails the example), a file written outside -o, or code run (a canary file).

Bounded for CI: a fixed number of examples per reader, the same ones every run (derandomized); set
VAEOPT_FUZZ_EXAMPLES=200 (and VAEOPT_FUZZ_RANDOM=1 for new examples each run) to search longer. The decodes are
bounded by --max-output-gb, as a service decoding untrusted files would run vaeopt. Findings are kept as regression
tests at the end of this file.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from safetensors.torch import save_file
from typer.testing import CliRunner

from vaeopt.cli import app
from vaeopt.families import build_model, get_family

EXAMPLES = int(os.environ.get("VAEOPT_FUZZ_EXAMPLES", "12"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                derandomize=not os.environ.get("VAEOPT_FUZZ_RANDOM"),
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])
HANG_S = 60  # one example (a read, a model load, a 32x32 decode) takes well under a second
LIMITS = ["--max-output-gb", "0.01", "--max-outputs", "8"]  # how a service decoding untrusted files bounds the work
runner = CliRunner()


class Hang(BaseException):  # not an Exception: the CLI's own error handling must not catch it
    pass


# ---------------------------------------------------------------------------------------------------- seeds


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    """A small SD-style VAE (32x32 images from 4x4 latents) with its config in the file's metadata, and valid latent
    files of every format for it."""
    d = tmp_path_factory.mktemp("seeds")
    torch.manual_seed(0)
    model = build_model(get_family("sd15"), block_out_channels=[8, 8, 16, 16], norm_num_groups=4, layers_per_block=1)
    cfg = {k: v for k, v in dict(model.config).items() if not k.startswith("_")}
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k.startswith(("decoder.", "post_quant_conv."))}
    save_file(sd, str(d / "vae.safetensors"), metadata={"config": json.dumps(cfg)})
    z = torch.randn(1, 4, 4, 4)
    torch.save(z, d / "l.pt")
    torch.save({"a": z, "b": z[:, :, :2]}, d / "d.pt")
    save_file({"x": z}, str(d / "l.safetensors"), metadata={"latent_space": "scaled"})
    save_file({"latent_tensor": z, "latent_format_version_0": torch.tensor([])}, str(d / "l.latent"))
    np.save(d / "l.npy", z.numpy())
    np.savez_compressed(d / "l.npz", a=z.numpy(), seed=np.array([7]))
    (d / "vaeopt.json").write_text(json.dumps({"files": {"l.pt": {"model": "vae.safetensors",
                                                                 "latent_space": "scaled"}}}))
    (d / "config.json").write_text(json.dumps({"norm_num_groups": 4, "scaling_factor": 0.18215}))
    return d


# ---------------------------------------------------------------------------------------------------- mutations

_EDGE_BYTES = [0x00, 0x01, 0x7F, 0x80, 0xFF, ord("{"), ord("["), ord('"'), ord("0")]
_EDGE_U64 = [0, 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1, 10**8, 10**12]


@st.composite
def mutated(draw, data: bytes, hot: int = 0) -> bytes:
    """1-6 edits of `data`; half of them in its first `hot` bytes (the header, where the parser's decisions are)."""
    b = bytearray(data)
    for _ in range(draw(st.integers(1, 6))):
        if not b:
            break
        span = hot if hot and draw(st.booleans()) else len(b)
        pos = draw(st.integers(0, max(0, min(span, len(b)) - 1)))
        op = draw(st.sampled_from(["flip", "edge", "u64", "insert", "delete", "truncate", "repeat"]))
        if op == "flip":
            b[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "edge":
            b[pos] = draw(st.sampled_from(_EDGE_BYTES))
        elif op == "u64":
            b[pos:pos + 8] = struct.pack("<Q", draw(st.sampled_from(_EDGE_U64)))
        elif op == "insert":
            b[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del b[pos:pos + draw(st.integers(1, 64))]
        elif op == "truncate":
            del b[pos:]
        else:  # a chunk repeated: lengths and counts that no longer match
            chunk = b[pos:pos + draw(st.integers(1, 32))]
            b[pos:pos] = chunk * draw(st.integers(1, 8))
    return bytes(b)


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=4), max_leaves=12)


@st.composite
def mutated_json(draw, obj: dict, keys: list[str]) -> bytes:
    """Either the JSON text byte-mutated, or some values (of known keys, or new ones) replaced by arbitrary JSON."""
    if draw(st.booleans()):
        return draw(mutated(json.dumps(obj).encode()))
    o = json.loads(json.dumps(obj))
    target = o
    if "files" in o:  # the manifest: its per-file entry too
        target = o["files"]["l.pt"] if draw(st.booleans()) else o
    for _ in range(draw(st.integers(1, 3))):
        target[draw(st.sampled_from(keys) | st.text(max_size=6))] = draw(_JSON)
    return json.dumps(o, allow_nan=True).encode()


# ---------------------------------------------------------------------------------------------------- the property


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if not p.is_dir()}


def check_run(args: list, box: Path, out: Path) -> None:
    """Run `vaeopt decode args` in-process and check the property (module docstring)."""
    canary = box / "canary"
    before = _files(box)

    def alarm(signum, frame):
        raise Hang(f"no answer after {HANG_S} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(HANG_S)
    try:
        r = runner.invoke(app, ["decode", *map(str, args), *LIMITS], catch_exceptions=True)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    text = r.output
    assert not isinstance(r.exception, Hang), f"hang: {args}"
    assert r.exit_code in (0, 2), f"exit {r.exit_code}: {text[-600:]} {r.exception!r}"
    assert "Traceback" not in text and "vaeopt bug" not in text, text[-600:]
    assert not canary.exists()
    new = _files(box) - before
    assert all(out in p.parents for p in new), f"written outside -o: {sorted(new)}"
    if r.exit_code == 2:
        errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1, text[-600:]
    else:
        pngs = sorted(out.rglob("*.png"))
        assert pngs and len(pngs) == len(new), (text[-600:], new)
        for p in pngs:
            with Image.open(p) as im:
                a = np.asarray(im.convert("RGB"))
            assert a.shape[0] % 8 == 0 and a.shape[1] % 8 == 0 and a.shape[2] == 3 and a.std() > 0, p
    shutil.rmtree(out, ignore_errors=True)


def _box(tmp_path: Path, name: str) -> Path:
    box = tmp_path / name
    if box.exists():
        shutil.rmtree(box)
    box.mkdir()
    return box


# ---------------------------------------------------------------------------------------------------- the fuzzers

LATENT_SEEDS = ["l.pt", "d.pt", "l.safetensors", "l.latent", "l.npy", "l.npz"]


@pytest.mark.parametrize("seed", LATENT_SEEDS)
def test_fuzz_latent_readers(seeds, tmp_path, seed):
    data = (seeds / seed).read_bytes()

    @FUZZ
    @given(blob=mutated(data, hot=256))
    def run(blob):
        box = _box(tmp_path, "box")
        (box / seed).write_bytes(blob)
        check_run([box / seed, "-m", seeds / "vae.safetensors", "-o", f"{box / 'out'}/"], box, box / "out")

    run()


def test_fuzz_checkpoint_reader(seeds, tmp_path):
    data = (seeds / "vae.safetensors").read_bytes()
    header = 8 + struct.unpack("<Q", data[:8])[0]

    @FUZZ
    @given(blob=mutated(data, hot=header))
    def run(blob):
        box = _box(tmp_path, "box")
        (box / "vae.safetensors").write_bytes(blob)
        shutil.copy(seeds / "l.pt", box / "l.pt")
        check_run([box / "l.pt", "-m", box / "vae.safetensors", "-o", box / "out" / "x.png"], box, box / "out")

    run()


def test_fuzz_manifest_reader(seeds, tmp_path):
    obj = json.loads((seeds / "vaeopt.json").read_text())

    @FUZZ
    @given(blob=mutated_json(obj, ["files", "model", "latent_space", "_doc"]))
    def run(blob):
        box = _box(tmp_path, "box")
        shutil.copy(seeds / "l.pt", box / "l.pt")
        shutil.copy(seeds / "vae.safetensors", box / "vae.safetensors")
        (box / "vaeopt.json").write_bytes(blob)
        check_run([box / "l.pt", "-o", f"{box / 'out'}/"], box, box / "out")

    run()


def test_fuzz_config_reader(seeds, tmp_path):
    obj = json.loads((seeds / "config.json").read_text())
    keys = ["norm_num_groups", "scaling_factor", "shift_factor", "block_out_channels", "latent_channels",
            "layers_per_block", "force_upcast", "use_post_quant_conv", "act_fn", "_class_name", "up_block_types"]

    @FUZZ
    @given(blob=mutated_json(obj, keys))
    def run(blob):
        box = _box(tmp_path, "box")
        shutil.copy(seeds / "l.pt", box / "l.pt")
        (box / "config.json").write_bytes(blob)
        check_run([box / "l.pt", "-m", seeds / "vae.safetensors", "--config", box / "config.json", "-o",
                   f"{box / 'out'}/"], box, box / "out")

    run()


def test_a_pickle_that_would_run_code_is_refused(seeds, tmp_path):
    """The canary: a .pt whose pickle calls os.system. weights_only refuses it; the property checks nothing ran."""
    box = _box(tmp_path, "box")

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {box / 'canary'}",)

    torch.save({"z": torch.randn(1, 4, 4, 4), "x": Evil()}, box / "evil.pt")
    check_run([box / "evil.pt", "-m", seeds / "vae.safetensors", "-o", f"{box / 'out'}/"], box, box / "out")


# ---------------------------------------------------------------------------------------------------- findings, kept


def test_finding_npy_header_split_by_a_newline(seeds, tmp_path):
    """A .npy header with a newline inside its dict: numpy's header parser (Python's tokenize) raised TokenError,
    reported as an internal error (exit 1)."""
    box = _box(tmp_path, "box")
    data = bytearray((seeds / "l.npy").read_bytes())
    data[8] += 1  # the header length one more: the header then ends in its "\n" and the first data byte,
    data[128] = ord("(")  # here an open parenthesis (tokenize: "EOF in multi-line statement")
    (box / "l.npy").write_bytes(bytes(data))
    check_run([box / "l.npy", "-m", seeds / "vae.safetensors", "-o", f"{box / 'out'}/"], box, box / "out")


def test_finding_config_class_name_not_text(seeds, tmp_path):
    """"_class_name": [] in --config: a dict lookup with a list raised TypeError (exit 1)."""
    box = _box(tmp_path, "box")
    shutil.copy(seeds / "l.pt", box / "l.pt")
    (box / "config.json").write_text('{"norm_num_groups": 4, "scaling_factor": 0.18215, "_class_name": []}')
    check_run([box / "l.pt", "-m", seeds / "vae.safetensors", "--config", box / "config.json", "-o",
               f"{box / 'out'}/"], box, box / "out")


def test_finding_config_shift_factor_a_list(seeds, tmp_path):
    """"shift_factor": [null]: family detection compared it as a number before any check (TypeError, exit 1)."""
    box = _box(tmp_path, "box")
    shutil.copy(seeds / "l.pt", box / "l.pt")
    (box / "config.json").write_text('{"norm_num_groups": 4, "scaling_factor": 0.18215, "shift_factor": [null]}')
    check_run([box / "l.pt", "-m", seeds / "vae.safetensors", "--config", box / "config.json", "-o",
               f"{box / 'out'}/"], box, box / "out")
