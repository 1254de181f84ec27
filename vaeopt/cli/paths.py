"""Checks on the paths decode is given, made before torch loads: the inputs exist, -o names a usable file or
folder, and a folder made for a decode that fails is removed again."""

from __future__ import annotations

import contextlib
import itertools
import os
from pathlib import Path
from typing import List

from vaeopt import cleanup, outputs
from vaeopt.errors import OutputError, VaeoptError
from vaeopt.options import expand_home


def check_inputs_exist(latents: List[Path]) -> None:
    """A missing latent file, or one named twice, said before torch loads (vaeopt.latents.read_latents checks the
    rest)."""
    given: dict[str, Path] = {}
    for p in latents:
        if not p.exists():
            raise VaeoptError(f"{p}: " + ("a broken or looping symlink" if p.is_symlink() else "no such file"))
        r = os.path.abspath(p)  # as the planner counts them: a.pt and ./a.pt are one file
        if r in given:
            raise VaeoptError(f"{p}: given twice (also as {given[r]}); name each latent file once")
        given[r] = p


def _expanded(p: Path | None, what: str) -> Path | None:
    """p with '~' expanded (None for no path); a '~nosuchuser' is said now, in the loader's words."""
    return None if p is None else expand_home(p, what)


def check_config_exists(config: Path | None) -> None:
    """A --config that is not there, said before torch loads in the loader's words (vaeopt.loading.config reads it)."""
    path = _expanded(config, "--config")
    if path is None:
        return
    if path.is_dir() and not (path / "config.json").is_file():
        raise VaeoptError(f"config file not found: the folder {path.resolve()} has no config.json")
    if not path.exists() and not path.is_symlink():
        raise VaeoptError(f"config file not found: {path}")


CHECKPOINT_SUFFIXES = (".safetensors", ".sft", ".ckpt", ".pt", ".pth", ".bin", ".json")


def check_model_exists(model: Path | None) -> None:
    """A --model file that is not there, said before torch loads. Names that may be a Hugging Face Hub id (owner/name,
    relative, no checkpoint suffix) are left to the loader, whose message says how to fetch one."""
    path = _expanded(model, "checkpoint")
    if path is None:
        return
    # a dot in a Hub repository name ('Wan-AI/Wan2.1-T2V-1.3B-Diffusers') reads as a suffix: only a checkpoint's
    # suffix, or a name with no owner/name form, is surely a local file
    parts = str(model).split("/")
    hub_like = len(parts) in (2, 3) and path.suffix.lower() not in CHECKPOINT_SUFFIXES
    if not path.exists() and (path.suffix and not hub_like or path.is_absolute() or str(model).startswith((".", "~"))):
        raise VaeoptError(f"checkpoint not found: {path}" + (" (a broken or looping symlink)" if path.is_symlink()
                                                             else ""))


def output_arg(output: str | None) -> tuple[Path | None, bool]:
    """-o as typed -> (path, is a folder). A trailing separator means a folder whatever the name looks like
    ("renders/2024.06.01/", "renders/run.safetensors/"); Path() drops it, so it is read from the text."""
    if output is None:
        return None, False
    if not output.strip():
        raise OutputError("-o is empty: name a file or a folder")
    if output.strip() == "-":  # (it would make a folder named '-')
        raise OutputError("-o -: writing to stdout is not supported; give a file (out.png, out.mp4, out.safetensors) "
                          "or a folder (out/)")
    path = expand_home(output, "-o", OutputError)  # as --model is; a quoted '~/x.png' would otherwise make a folder '~'
    try:
        path.is_dir()
    except (OSError, RuntimeError) as e:  # a name too long for the file system, a symlink loop
        raise OutputError(f"-o {output}: not a usable path ({getattr(e, 'strerror', None) or e})") from None
    folder = output.endswith(("/", os.sep))
    if folder and path.exists() and not path.is_dir():
        raise OutputError(f"-o {output}: the trailing '/' asks for a folder, but {path} is a file; choose another "
                          "-o (nothing was written)")
    if not folder and not path.is_dir() and path.name.endswith(".") and path.name != "..":
        # 'out.png.' has no suffix, so it would silently become a folder named so
        raise OutputError(f"-o {output}: the name ends in '.', likely a typo; name a .png/.mp4/.safetensors file, or "
                          f"a folder with a trailing '/' ({output}/) if that is the name you want")
    if not folder and path.suffix == "" and path.is_file():  # before "exists, pass --overwrite", which would not help
        raise OutputError(f"-o {output}: a name without a suffix is a folder output, but {path} is a file, which "
                          "--overwrite does not replace with a folder; name a .png/.mp4/.safetensors file, or "
                          "another folder (nothing was written)")
    if not folder and not path.is_dir() and path.suffix and path.suffix.lower() not in outputs.OUTPUT_SUFFIXES:
        # before the checkpoint loads (the same check runs again when the outputs are planned)
        raise OutputError(outputs.unknown_type(f"-o {output}", path.suffix))
    if not folder and not path.is_dir() and path.name.lower() in outputs.OUTPUT_SUFFIXES:  # a hidden folder, else
        raise OutputError(f"-o {output}: a suffix alone is not a file name; name the file "
                          f"({path.with_name('out' + path.name)}), or leave -o out to write each output beside its input")
    outputs.check_output_folder(path, folder, f"-o {output}")  # /proc, a read-only folder: now, not after the decode
    return path, folder


def check_output_not_an_input(output: Path | None, out_folder: bool, latents: List[Path],
                              model: Path | None) -> None:
    """-o naming an input latent file or the checkpoint, said before torch loads (api.plan_jobs checks every output
    name again, numbered and keyed ones included)."""
    if output is None or out_folder:
        return
    try:
        r = output.resolve()
        inputs = {p.resolve() for p in latents}
        model_r = model.expanduser().resolve() if model is not None else None
    except (OSError, RuntimeError):  # a symlink loop, '~nosuchuser': said where the paths are used
        return
    if r in inputs or r == model_r:
        raise VaeoptError(f"{output}: would overwrite {'an input latent file' if r in inputs else 'the model'}"
                          " (even --overwrite does not replace inputs); choose another -o")


@contextlib.contextmanager
def output_folder(path: Path | None):
    """Make the -o folder (a trailing '/'); if the decode then fails or is interrupted and the folder it made is still
    empty, remove it, so that "nothing was left behind" holds."""
    made = []  # the folders mkdir makes, innermost first (-o new/newer/ makes both)
    if path is not None:
        made = list(itertools.takewhile(lambda p: not os.path.lexists(p), [path, *path.parents]))
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"{path}/: cannot create the output folder ({e.strerror or e})") from None
        cleanup.add_folders(made)  # (removed if still empty when a signal must end the process at once)
    try:
        yield
    except BaseException:
        outputs.remove_empty(made)  # (only as far as they are empty)
        raise
