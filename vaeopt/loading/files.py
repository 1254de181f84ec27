"""Reading checkpoint files: what a file is (sniff), safetensors and torch files (weights_only, numpy scalars
allowed), diffusers folders and shard indexes, and the JSON vaeopt is given. Nothing is downloaded."""

from __future__ import annotations

import contextlib
import json
import pickle
import re
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from vaeopt.errors import CheckpointError
from vaeopt.loading.layouts import no_vae_error, vae_prefix
from vaeopt.options import expand_home


# The weights of a diffusers model folder, in diffusers' order of precedence (variant=None first, sharded or not; then
# the fp16/bf16 variants; then HunyuanVideo's original vae/ folder, whose config.json is for AutoencoderKLCausal3D).
# An ".index...json" entry names a shard index (save_pretrained(max_shard_size=...)).
_DIR_WEIGHTS = (
    "diffusion_pytorch_model.safetensors.index.json",
    "diffusion_pytorch_model.safetensors",
    "diffusion_pytorch_model.bin",
    "diffusion_pytorch_model.safetensors.index.fp16.json",
    "diffusion_pytorch_model.fp16.safetensors",
    "diffusion_pytorch_model.safetensors.index.bf16.json",
    "diffusion_pytorch_model.bf16.safetensors",
    "diffusion_pytorch_model.fp16.bin",
    "pytorch_model.pt",
)
_NESTING_KEYS = ("state_dict", "model", "module", "model_state_dict", "net", "vae")
_MAX_HEADER = 100 * 1024 * 1024
# JSON (config.json, vaeopt.json, the user config, a checkpoint's config metadata) nested deeper than this is refused:
# real ones nest 2-3 levels, and Python's parser and copy.deepcopy recurse per level (a file of 100k '[' would raise
# RecursionError).
MAX_JSON_DEPTH = 32


def parse_json(text: str | bytes):
    """json.loads for files vaeopt is given: nesting beyond MAX_JSON_DEPTH raises ValueError, as malformed JSON does."""
    try:
        obj = json.loads(text)
    except RecursionError:
        raise ValueError(f"nested more than {MAX_JSON_DEPTH} levels deep") from None
    stack = [(obj, 0)]
    while stack:
        o, depth = stack.pop()
        if isinstance(o, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise ValueError(f"nested more than {MAX_JSON_DEPTH} levels deep")
            stack.extend((v, depth + 1) for v in (o.values() if isinstance(o, dict) else o))
    return obj


def expand_user(path, what: str) -> Path:
    """Path(path).expanduser(), with a '~name' whose user does not exist a CheckpointError naming `what`."""
    return expand_home(path, what, CheckpointError)


def safetensors_header_problem(path: Path, head: bytes, size: int) -> str | None:
    """What is wrong with a safetensors file's 8-byte header length, in the words both the checkpoint and the latent
    readers use ("header too large", "truncated"); None when it is plausible."""
    if len(head) < 8:
        return f"corrupt or truncated safetensors file ({size} bytes)"
    n = struct.unpack("<Q", head[:8])[0]
    if n > _MAX_HEADER:
        return (f"corrupt safetensors file (header too large: its first 8 bytes declare a {n}-byte header, more than "
                f"the {_MAX_HEADER} bytes vaeopt reads)")
    if n + 8 > size:
        return f"corrupt or truncated safetensors file (header says {n} bytes, file has {size})"
    return None


def short_error(e: BaseException, n: int = 160) -> str:
    s = " ".join(str(e).split()) or type(e).__name__
    return s if len(s) <= n else s[: n - 3] + "..."


def few(keys, n: int = 3) -> str:
    keys = list(keys)
    return ", ".join(keys[:n]) + (f" (+{len(keys) - n} more)" if len(keys) > n else "")


def magic_name(head: bytes) -> str:
    for magic, name in ((b"\x89PNG", "a PNG image"), (b"\xff\xd8\xff", "a JPEG image"), (b"GIF8", "a GIF image"),
                        (b"%PDF", "a PDF document"), (b"RIFF", "a RIFF (WebP/WAV/AVI) file"),
                        (b"\x1f\x8b", "a gzip archive"), (b"GGUF", "a GGUF file (not supported)"),
                        (b"\x93NUMPY", "a NumPy array"), (b"<", "an HTML/XML document"), (b"{", "a JSON/text file"),
                        (b"version https://git-lfs", "a Git LFS pointer (the weights were never downloaded)")):
        if head.startswith(magic):
            return name
    return "unrecognised file header"


def sniff(path: Path) -> str:
    """'safetensors' | 'torch-zip' | 'pickle', or CheckpointError."""
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"{path}: empty file (0 bytes), not a checkpoint")
    with open(path, "rb") as f:
        head = f.read(32)
    if head.startswith(b"PK\x03\x04"):
        return "torch-zip"
    # safetensors first: a header of 640, 896, 1152 or 1408 bytes makes the file start 80 02..05 like a pickle
    if len(head) >= 9 and head[8:9] == b"{":
        n = struct.unpack("<Q", head[:8])[0]
        if n > 0:
            problem = safetensors_header_problem(path, head, size)
            if problem:
                raise CheckpointError(f"{path}: {problem}")
            return "safetensors"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "pickle"
    if len(head) < 9 and path.suffix.lower() in (".safetensors", ".sft"):
        raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({size} bytes)")
    raise CheckpointError(
        f"{path}: not a checkpoint ({magic_name(head)}); expected a .safetensors file or a torch .pt/.ckpt/.pth/.bin"
    )


def _read_safetensors(path: Path, select_vae: bool) -> tuple[dict[str, Tensor], dict, list[str]]:
    """Tensors, metadata and all key names of a safetensors file; with select_vae only the VAE's tensors are read
    (the rest of a full checkpoint stays on disk), and a file without a VAE is refused before any tensor is read."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            keys, meta = list(f.keys()), dict(f.metadata() or {})
            prefix = vae_prefix(keys) if select_vae else ""
            if prefix is None and keys:  # say so without reading e.g. a whole UNet
                raise no_vae_error(str(path), keys)
            return {k: f.get_tensor(k) for k in keys if k.startswith(prefix or "")}, meta, keys
    except CheckpointError:
        raise
    except Exception as e:  # SafetensorError and friends
        raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({short_error(e)})") from None


def _unwrap(obj, path: Path) -> dict[str, Tensor]:
    for _ in range(4):
        if not isinstance(obj, dict):
            break
        nested = next((k for k in _NESTING_KEYS if isinstance(obj.get(k), dict)), None)
        loose = [v for v in obj.values() if isinstance(v, Tensor)]
        # a state dict beside a few scalar tensors (Lightning's {"state_dict": ..., "global_step": tensor(1000)})
        # is still the state dict; a dict of many tensors is itself the state dict
        if loose and (nested is None or len(loose) > 4 or any(v.numel() > 1 for v in loose)):
            break
        for k in _NESTING_KEYS:
            if isinstance(obj.get(k), dict):
                obj = obj[k]
                break
        else:
            break
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: not a checkpoint: the file holds a {type(obj).__name__}, not a state dict")
    tensors = {k: v for k, v in obj.items() if isinstance(k, str) and isinstance(v, Tensor)}
    if not tensors:
        raise CheckpointError(
            f"{path}: not a checkpoint: no tensors found "
            f"(top-level keys: {', '.join(map(str, list(obj)[:5])) or 'none'})"
        )
    return tensors


def refused_global(e: BaseException) -> str | None:
    """The class or function a weights_only torch.load refused to rebuild, read from torch's message."""
    m = re.search(r"GLOBAL ([\w.]+)|but got <class '([\w.]+)'>", str(e))
    return (m[1] or m[2]) if m else None


def allow_numpy_scalars():
    """A context in which weights_only torch.load also rebuilds numpy scalars and dtypes (old training checkpoints
    store a numpy `global_step`/`epoch`): plain data, not code. Exactly numpy's scalar reconstructor (under numpy 2's
    and numpy 1's module names) and np.dtype with its bool/integer/float/complex dtype classes; nothing else."""
    import numpy as np

    sg = getattr(torch.serialization, "safe_globals", None)  # torch 2.5+
    if sg is None:
        return contextlib.nullcontext()
    try:
        from numpy._core.multiarray import scalar
    except ImportError:  # numpy 1
        from numpy.core.multiarray import scalar
    if torch.__version__ >= (2, 6):  # (object, name) pairs: a numpy-1 file loads under numpy 2 and the reverse
        scalars = [(scalar, "numpy._core.multiarray.scalar"), (scalar, "numpy.core.multiarray.scalar")]
    else:
        scalars = [scalar]
    dtypes = {type(np.dtype(c)) for c in "?" + np.typecodes["AllInteger"] + np.typecodes["AllFloat"]}
    return sg([*scalars, np.dtype, *dtypes])


def _read_torch(path: Path, kind: str, select_vae: bool = False) -> tuple[dict[str, Tensor], list[str]]:
    """Tensors of a torch checkpoint (weights_only=True, never arbitrary pickles; numpy scalars allowed) and all its
    key names. Zip files are memory-mapped, so that a full SD checkpoint's UNet is never read when only its VAE is
    wanted."""
    try:
        with warnings.catch_warnings(), allow_numpy_scalars():
            warnings.simplefilter("ignore")
            if path.suffix.lower() in (".safetensors", ".sft"):  # a torch file under a safetensors name: torch.load
                with open(path, "rb") as fh:  # would pick its safetensors reader by the name, so give it the bytes
                    obj = torch.load(fh, map_location="cpu", weights_only=True)
            else:
                obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=(kind == "torch-zip"))
    except pickle.UnpicklingError as e:
        name = refused_global(e)
        if name is None and kind == "pickle":  # pickle.dump, not torch.save: torch's "Weights only load failed" says
            raise CheckpointError(  # nothing of that (the latent reader's words)
                f"{path}: a plain pickle stream (pickle.dump), not a torch.save file: vaeopt does not unpickle (even "
                "tensors come through pickle's code paths there); where you trust the file, load it and save its "
                "state_dict with safetensors.torch.save_file") from None
        what = f"it refers to {name}" if name else short_error(e).split(". ")[0]
        hint = ""
        if name and name.split(".")[0] in ("pytorch_lightning", "lightning"):
            hint = (", a PyTorch Lightning class: a training checkpoint, whose callbacks/optimizer state are pickled "
                    "objects; its weights are under 'state_dict'")
        raise CheckpointError(
            f"{path}: refusing to unpickle arbitrary objects (weights_only=True): the file holds more than tensors "
            f"({what}{hint}); to convert it, load it with torch.load in an environment you trust and save its "
            f"state_dict with safetensors.torch.save_file"
        ) from None
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read torch checkpoint, corrupt or truncated? "
                              f"({short_error(e)})") from None
    tensors = _unwrap(obj, path)
    keys = list(tensors)
    prefix = vae_prefix(keys) if select_vae else None
    if prefix:
        tensors = {k: v for k, v in tensors.items() if k.startswith(prefix)}
    if kind == "torch-zip":  # own the memory: do not keep the file mapped behind the model's back
        tensors = {k: v.clone() for k, v in tensors.items()}
    return tensors, keys


def _resolve_dir(path: Path) -> tuple[Path, list[Path]]:
    """A diffusers model (or pipeline) directory -> (model dir, weight files)."""
    for d in (path, path / "vae"):
        if not (d / "config.json").is_file():
            continue
        name = next((n for n in _DIR_WEIGHTS if (d / n).is_file()), None)
        if name is not None and ".index." in name:
            idx = d / name
            try:
                shards = sorted(set(parse_json(idx.read_text())["weight_map"].values()))
                if not all(isinstance(s, str) and s for s in shards):
                    raise ValueError("its weight_map must map tensor names to file names")
            except Exception as e:
                raise CheckpointError(f"{idx}: unreadable shard index ({short_error(e)})") from None
            # by name, not by where a file points: a Hugging Face cache links every shard into ../../blobs/
            outside = [s for s in shards if Path(s).is_absolute() or ".." in Path(s).parts]
            if outside:  # a shard index names files beside it, never elsewhere on the disk
                raise CheckpointError(f"{idx}: shard {outside[0]!r} is outside the model folder")
            return d, [d / s for s in shards]
        if name is not None:
            return d, [d / name]
    if (path / "model_index.json").is_file():
        raise CheckpointError(
            f"{path}: pipeline directory without a usable vae/ folder (need vae/config.json and weights)"
        )
    raise CheckpointError(
        f"{path}: directory holds no model (expected config.json with diffusion_pytorch_model.safetensors/.bin, "
        f"or a pipeline with a vae/ subfolder)"
    )


@dataclass
class Source:
    tensors: dict[str, Tensor]
    metadata: dict
    path: Path
    is_dir: bool
    all_keys: list[str]
    hint_names: list[str]


def _hub_hint(path: Path) -> str:
    """For a missing path that reads like a Hugging Face Hub id ('owner/name', or 'owner/name/vae'): vaeopt never
    downloads, so say how to get the files."""
    parts = str(path).split("/")
    if (len(parts) not in (2, 3) or str(path).startswith((".", "~"))
            or path.suffix.lower() in (".safetensors", ".ckpt", ".pt", ".pth", ".bin", ".sft", ".json")
            or not all(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", p) for p in parts)):
        return ""
    repo = "/".join(parts[:2])
    sub = f" --include '{parts[2]}/*'" if len(parts) == 3 else ""
    local = parts[1] + (f"/{parts[2]}" if len(parts) == 3 else "")
    return (f" (this looks like a Hugging Face Hub id: vaeopt reads local files only and never downloads; fetch it "
            f"first, e.g. `huggingface-cli download {repo}{sub} --local-dir {parts[1]}`, then pass -m {local})")


def read_source(path: Path, select_vae: bool = False) -> Source:
    path = expand_user(path, "checkpoint")
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}" + (" (a broken or looping symlink)" if path.is_symlink()
                                                                 else _hub_hint(path)))
    if path.is_dir():
        d, files = _resolve_dir(path)
        tensors, meta = {}, {}
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f}: shard listed in the index is missing")
            t, m, _ = _read_file(f)
            tensors.update(t)
            meta.update(m)
        try:
            cfg_text = (d / "config.json").read_text()
            cfg = parse_json(cfg_text)
        except Exception as e:
            raise CheckpointError(f"{d / 'config.json'}: not valid JSON ({short_error(e)})") from None
        if not isinstance(cfg, dict):  # (was ignored: default settings, a wrong decode without a word)
            raise CheckpointError(f"{d / 'config.json'}: must be a JSON object (the model's settings), got "
                                  f"{type(cfg).__name__}")
        meta["config"] = cfg_text
        names = [d.name] + ([d.parent.name] if d.name == "vae" or d != path else [])
        return Source(tensors, meta, path, True, list(tensors), names)
    if not path.is_file():
        raise CheckpointError(f"{path}: not a regular file")
    tensors, meta, keys = _read_file(path, select_vae=select_vae)
    return Source(tensors, meta, path, False, keys, [path.name])


def _read_file(path: Path, select_vae: bool = False) -> tuple[dict[str, Tensor], dict, list[str]]:
    kind = sniff(path)
    if kind == "safetensors":
        tensors, meta, keys = _read_safetensors(path, select_vae)
    else:
        (tensors, keys), meta = _read_torch(path, kind, select_vae), {}
    if not tensors:
        raise CheckpointError(f"{path}: not a checkpoint: it holds no tensors")
    return tensors, meta, keys


def read_state_dict(path: Path) -> tuple[dict[str, Tensor], dict]:
    """All tensors of a checkpoint file or diffusers directory, and its metadata (safetensors metadata; for a
    directory also "config": the text of config.json). Pickles are read with weights_only=True only."""
    src = read_source(Path(path))
    return src.tensors, src.metadata
