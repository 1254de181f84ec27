"""Load a VAE checkpoint of any common layout into a diffusers model, working out its family and real widths.

Layouts: diffusers (single file or a directory with config.json, also a pipeline directory with vae/), the original
LDM / A1111 / ComfyUI files (with or without `first_stage_model.` / `vae.` prefix, full SD checkpoints included),
FLUX's `ae.safetensors`, the original Wan 2.1 / 2.2 `.pth` files, and the original TAESD decoder files. The family is
read from the weights (class, latent channels, quant convs) and, where weights cannot tell (SD 1.x vs SD 2.x vs SDXL,
SD3 vs FLUX, TAESD vs TAESDXL), from the `family=` argument, the file's metadata, the other weights in a full
checkpoint, then the file name; else a documented default (see docs/user-guide.md). Nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import math
import os
import pickle
import re
import struct
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from vaeopt.errors import CheckpointError, VaeoptError
from vaeopt.families import FamilySpec, family_names, get_family, model_class

__all__ = ["LoadedVAE", "read_state_dict", "detect", "load_vae"]


class Notice(str):
    """A loading note worth showing without -v (a guess the user may need to correct); `short` is its one-line
    form, the full text stays the note."""

    short: str

    def __new__(cls, text: str, short: str) -> "Notice":
        obj = super().__new__(cls, text)
        obj.short = short
        return obj

    def __reduce__(self):  # pickles (spawned ranks) as what it is, short form included
        return Notice, (str(self), self.short)


@dataclass
class LoadedVAE:
    model: torch.nn.Module
    family: FamilySpec
    layout: str
    path: Path | None
    notes: list[str] = field(default_factory=list)
    dtype_on_disk: torch.dtype | None = None


# ----------------------------------------------------------------------------------------------------------------------
# Reading files
# ----------------------------------------------------------------------------------------------------------------------

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
    """Path(path).expanduser(), with a '~name' whose user does not exist reported as an input error naming `what`."""
    p = Path(path)
    try:
        return p.expanduser()
    except (RuntimeError, KeyError):  # "Could not determine home directory."
        user = str(path).split("/", 1)[0]
        raise CheckpointError(f"{what} {path}: '{user}' names no user on this system (so no home folder)") from None


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


def _short(e: BaseException, n: int = 160) -> str:
    s = " ".join(str(e).split()) or type(e).__name__
    return s if len(s) <= n else s[: n - 3] + "..."


def magic_name(head: bytes) -> str:
    for magic, name in (
        (b"\x89PNG", "a PNG image"),
        (b"\xff\xd8\xff", "a JPEG image"),
        (b"GIF8", "a GIF image"),
        (b"%PDF", "a PDF document"),
        (b"RIFF", "a RIFF (WebP/WAV/AVI) file"),
        (b"\x1f\x8b", "a gzip archive"),
        (b"GGUF", "a GGUF file (not supported)"),
        (b"\x93NUMPY", "a NumPy array"),
        (b"<", "an HTML/XML document"),
        (b"{", "a JSON/text file"),
        (b"version https://git-lfs", "a Git LFS pointer (the weights were never downloaded)"),
    ):
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


def _safetensors_keys(path: Path) -> tuple[list[str], dict]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys()), dict(f.metadata() or {})
    except CheckpointError:
        raise
    except Exception as e:  # SafetensorError and friends
        raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({_short(e)})") from None


def _read_safetensors(path: Path, want=None) -> tuple[dict[str, Tensor], dict]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            keys = [k for k in f.keys() if want is None or want(k)]
            return {k: f.get_tensor(k) for k in keys}, meta
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({_short(e)})") from None


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
    sg = getattr(torch.serialization, "safe_globals", None)  # torch 2.5+
    try:
        import numpy as np
    except ImportError:
        np = None
    if sg is None or np is None:
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
        what = f"it refers to {name}" if name else _short(e).split(". ")[0]
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
        raise CheckpointError(f"{path}: cannot read torch checkpoint, corrupt or truncated? ({_short(e)})") from None
    tensors = _unwrap(obj, path)
    keys = list(tensors)
    prefix = _vae_prefix(keys) if select_vae else None
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
                raise CheckpointError(f"{idx}: unreadable shard index ({_short(e)})") from None
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
class _Source:
    tensors: dict[str, Tensor]
    metadata: dict
    path: Path
    is_dir: bool
    all_keys: list[str]
    hint_names: list[str]


@contextlib.contextmanager
def quiet_diffusers():
    """diffusers' logger at error level for the block: it warns about `.to(dtype)` on every model with fp32 modules
    (Wan), and vaeopt casts deliberately (the weights, and its meta-device skeletons for memory estimates)."""
    from diffusers.utils import logging as dlog

    level = dlog.get_verbosity()
    dlog.set_verbosity_error()
    try:
        yield
    finally:
        dlog.set_verbosity(level)


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


def _read(path: Path, select_vae: bool = False) -> _Source:
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
            raise CheckpointError(f"{d / 'config.json'}: not valid JSON ({_short(e)})") from None
        if not isinstance(cfg, dict):  # (was ignored: default settings, a wrong decode without a word)
            raise CheckpointError(f"{d / 'config.json'}: must be a JSON object (the model's settings), got "
                                  f"{type(cfg).__name__}")
        meta["config"] = cfg_text
        names = [d.name] + ([d.parent.name] if d.name == "vae" or d != path else [])
        return _Source(tensors, meta, path, True, list(tensors), names)
    if not path.is_file():
        raise CheckpointError(f"{path}: not a regular file")
    tensors, meta, keys = _read_file(path, select_vae=select_vae)
    return _Source(tensors, meta, path, False, keys, [path.name])


def _read_file(path: Path, select_vae: bool = False) -> tuple[dict[str, Tensor], dict, list[str]]:
    kind = sniff(path)
    if kind == "safetensors":
        keys, meta = _safetensors_keys(path)
        prefix = _vae_prefix(keys) if select_vae else None
        if select_vae and prefix is None and keys:  # say so without reading e.g. a whole UNet
            raise _no_vae_error(str(path), keys)
        tensors, meta = _read_safetensors(path, (lambda k: k.startswith(prefix)) if prefix else None)
    else:
        (tensors, keys), meta = _read_torch(path, kind, select_vae), {}
    if not tensors:
        raise CheckpointError(f"{path}: not a checkpoint: it holds no tensors")
    return tensors, meta, keys


def read_state_dict(path: Path) -> tuple[dict[str, Tensor], dict]:
    """All tensors of a checkpoint file or diffusers directory, and its metadata (safetensors metadata; for a
    directory also "config": the text of config.json). Pickles are read with weights_only=True only."""
    src = _read(Path(path))
    return src.tensors, src.metadata


# ----------------------------------------------------------------------------------------------------------------------
# Key layouts -> diffusers keys
# ----------------------------------------------------------------------------------------------------------------------

_PREFIXES = ("first_stage_model.", "vae.", "autoencoder.", "model.", "module.")
_TAESD_INDEX = re.compile(r"^\d+\.")


def _looks_vae(keys) -> bool:
    keys = list(keys)
    if any(k.startswith("decoder.") for k in keys):
        return True
    return bool(keys) and all(_TAESD_INDEX.match(k) for k in keys) and "1.weight" in keys


def _vae_prefix(keys: list[str]) -> str | None:
    """The prefix under which the VAE lives ('' for none); None if no VAE is visible."""
    if _looks_vae(keys):
        return ""
    if any(k.startswith("taesd_decoder.") for k in keys):  # ComfyUI-style combined TAESD
        return "taesd_"
    for p in _PREFIXES:
        sub = [k[len(p):] for k in keys if k.startswith(p)]
        if sub and _looks_vae(sub):
            return p
    return None


_WAN_RES = {
    "residual.0.gamma": "norm1.gamma",
    "residual.2.weight": "conv1.weight",
    "residual.2.bias": "conv1.bias",
    "residual.3.gamma": "norm2.gamma",
    "residual.6.weight": "conv2.weight",
    "residual.6.bias": "conv2.bias",
    "shortcut.weight": "conv_shortcut.weight",
    "shortcut.bias": "conv_shortcut.bias",
}
_WAN_TOP = {
    "conv1.weight": "quant_conv.weight",
    "conv1.bias": "quant_conv.bias",
    "conv2.weight": "post_quant_conv.weight",
    "conv2.bias": "post_quant_conv.bias",
}


def _convert_wan22_original(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Original Wan 2.2 (vae2_2.py) keys, nested `decoder.upsamples.{b}.upsamples.{j}`, -> AutoencoderKLWan
    (is_residual=True). diffusers' convert_wan_vae_to_diffusers only knows the flat Wan 2.1 layout."""
    out = {}
    nested = re.compile(r"^(encoder|decoder)\.(downsamples|upsamples)\.(\d+)\.(downsamples|upsamples)\.(\d+)\.(.+)$")
    for k, v in sd.items():
        new = None
        if k in _WAN_TOP:
            new = _WAN_TOP[k]
        elif m := re.match(r"^(encoder|decoder)\.conv1\.(weight|bias)$", k):
            new = f"{m[1]}.conv_in.{m[2]}"
        elif m := re.match(r"^(encoder|decoder)\.head\.(0\.gamma|2\.weight|2\.bias)$", k):
            head = {"0.gamma": "norm_out.gamma", "2.weight": "conv_out.weight", "2.bias": "conv_out.bias"}
            new = f"{m[1]}.{head[m[2]]}"
        elif m := re.match(r"^(encoder|decoder)\.middle\.([02])\.(.+)$", k):
            if m[3] in _WAN_RES:
                new = f"{m[1]}.mid_block.resnets.{int(m[2]) // 2}.{_WAN_RES[m[3]]}"
        elif m := re.match(r"^(encoder|decoder)\.middle\.1\.(.+)$", k):
            new = f"{m[1]}.mid_block.attentions.0.{m[2]}"
        elif m := nested.match(k):
            part, b, rest = m[1], m[3], m[6]
            blocks = "down_blocks" if part == "encoder" else "up_blocks"
            sampler = "downsampler" if part == "encoder" else "upsampler"
            if rest in _WAN_RES:
                new = f"{part}.{blocks}.{b}.resnets.{m[5]}.{_WAN_RES[rest]}"
            elif rest.startswith(("resample.", "time_conv.")):
                new = f"{part}.{blocks}.{b}.{sampler}.{rest}"
        out[new or k] = v  # unknown keys pass through unchanged and are reported by the strict load
    return out


_HY_CONV_WRAP = re.compile(r"^(.*\.(?:conv_in|conv_out|conv1|conv2|nin_shortcut|conv))\.conv\.(weight|bias)$")
_HY_CONV_UNWRAP = re.compile(
    r"^((?:encoder|decoder)\..*(?:conv_in|conv_out|conv1|conv2|conv_shortcut|samplers\.0\.conv))\.(weight|bias)$"
)
_ATTN_LINEAR = re.compile(r"\.attentions\.\d+\.(to_q|to_k|to_v|to_out\.0)\.weight$")
_OLD_ATTN = {".query.": ".to_q.", ".key.": ".to_k.", ".value.": ".to_v.", ".proj_attn.": ".to_out.0."}


def _convert_ldm(sd: dict[str, Tensor], notes: list[str]) -> tuple[dict[str, Tensor], list[str]]:
    """LDM / A1111 / ComfyUI VAE keys -> diffusers keys, via diffusers' own converter. Returns the converted dict and
    the source keys the converter did not use (diffusers drops them silently)."""
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    video = any(v.ndim == 5 for k, v in sd.items() if k.startswith("decoder."))
    if video:  # 3-D (HunyuanVideo, ComfyUI style): causal convs wrap an inner `.conv`
        unwrapped = {}
        for k, v in sd.items():
            m = _HY_CONV_WRAP.match(k)
            unwrapped[f"{m[1]}.{m[2]}" if m else k] = v
        sd = unwrapped

    def n_blocks(part: str, word: str) -> int:
        ids = {int(m[1]) for k in sd if (m := re.match(rf"^{part}\.{word}\.(\d+)\.", k))}
        return max(ids) + 1 if ids else 0

    cfg = {
        "down_block_types": ["DownEncoderBlock2D"] * n_blocks("encoder", "down"),
        "up_block_types": ["UpDecoderBlock2D"] * n_blocks("decoder", "up"),
    }
    out = convert_ldm_vae_checkpoint(sd, cfg)
    used = {v.data_ptr() for v in out.values()}
    unused = [k for k, v in sd.items() if v.data_ptr() not in used]
    if any(v.ndim > 2 for k, v in sd.items() if re.search(r"\.attn_1\.(q|k|v|proj_out)\.weight$", k)):
        notes.append("attention 1x1-conv weights reshaped to linear")
    if video:
        out = {(f"{m[1]}.conv.{m[2]}" if (m := _HY_CONV_UNWRAP.match(k)) else k): v for k, v in out.items()}
    return out, unused


def _fix_attention(sd: dict[str, Tensor], notes: list[str]) -> dict[str, Tensor]:
    """Old diffusers attention names (query/key/value/proj_attn) and conv-shaped attention weights -> linear."""
    from diffusers.loaders.single_file_utils import conv_attn_to_linear

    if any(o in k for k in sd for o in _OLD_ATTN):
        sd = dict(sd)
        conv_attn_to_linear(sd)
        renamed = {}
        for k, v in sd.items():
            for old, new in _OLD_ATTN.items():
                k = k.replace(old, new)
            renamed[k] = v
        sd = renamed
        notes.append("old attention names (query/key/value/proj_attn) renamed to to_q/to_k/to_v/to_out.0")
    squeezed = False
    for k in list(sd):
        v = sd[k]
        if _ATTN_LINEAR.search(k) and v.ndim > 2 and all(s == 1 for s in v.shape[2:]):
            sd[k] = v.reshape(v.shape[0], v.shape[1])
            squeezed = True
    if squeezed and "attention 1x1-conv weights reshaped to linear" not in notes:
        notes.append("attention 1x1-conv weights reshaped to linear")
    return sd


def _convert_taesd_original(sd: dict[str, Tensor], part: str) -> dict[str, Tensor]:
    """Original TAESD (madebyollin) Sequential-index keys -> AutoencoderTiny keys. The original decoder starts with a
    parameter-free Clamp layer, which diffusers does in forward(), so decoder indices shift by one."""
    out = {}
    for k, v in sd.items():
        i, rest = k.split(".", 1)
        idx = int(i) - 1 if part == "decoder" else int(i)
        out[f"{part}.layers.{idx}.{rest}"] = v
    return out


def _refuse_unbuildable_taesd(sd: dict[str, Tensor], label: str) -> None:
    """TAESD-family decoders that AutoencoderTiny cannot build (original Sequential-index keys; the pooled kind also
    under diffusers' decoder.layers.N names): say which and why, instead of a list of keys that do not fit."""
    pooled = sorted(k for k in sd if re.match(r"^(?:decoder\.layers\.)?\d+\.pool\.", k))
    if pooled:  # taef2_decoder.pth (Sequential indices), or taef2.safetensors (diffusers' decoder.layers.N names)
        blocks = {k.rsplit(".pool.", 1)[0] for k in pooled}
        raise CheckpointError(
            f"{label}: a TAESD-family decoder with GroupNorm pooling blocks (TAEF2, for FLUX.2; {len(blocks)} blocks "
            f"have a .pool branch, e.g. {min(blocks)}.pool.*): diffusers' AutoencoderTiny has no such layers, so "
            "vaeopt cannot run it; the file itself looks fine"
        )
    convs = sorted((int(k.split(".", 1)[0]), v.shape) for k, v in sd.items()
                   if re.fullmatch(r"\d+\.weight", k) and v.ndim == 4)
    if len(convs) < 3 or all(shape[0] == shape[1] for _, shape in convs[1:-1]):
        return
    widths = [int(convs[0][1][0])]  # the first conv, then the conv after each upsample
    for _, shape in convs[1:-1]:
        if int(shape[0]) != widths[-1]:
            widths.append(int(shape[0]))
    name = "TAESana, for Sana's 32x DC-AE; " if len(convs) - 2 == 5 else ""  # 5 upsamples: upstream's F32Decoder
    raise CheckpointError(
        f"{label}: a TAESD-family decoder whose width changes between stages ({name}widths "
        f"{' -> '.join(map(str, widths))}): diffusers' AutoencoderTiny keeps one width throughout, so vaeopt cannot "
        "run it; the file itself looks fine"
    )


# ----------------------------------------------------------------------------------------------------------------------
# Structure: class, diffusers state dict, widths
# ----------------------------------------------------------------------------------------------------------------------

_VAE_ROOTS = ("encoder.", "decoder.", "quant_conv.", "post_quant_conv.")


@dataclass
class _Analysis:
    cls_name: str
    layout: str
    sd: dict[str, Tensor]
    inferred: dict
    latent: int
    has_encoder: bool
    notes: list[str]
    unused_decoder: list[str]
    is_residual: bool = False
    extra: dict = field(default_factory=dict)  # per-checkpoint latent statistics (FLUX.2's bn, LTX-2's mean/std)


def _idx(sd, pattern: str) -> list[int]:
    rx = re.compile(pattern)
    return sorted({int(m[1]) for k in sd if (m := rx.match(k))})


def _unrecognised(label: str, keys, extra: str = "") -> CheckpointError:
    keys = list(keys)
    return CheckpointError(
        f"{label}: not a recognised VAE checkpoint: found {len(keys)} tensors, e.g. {', '.join(keys[:3])}{extra}; "
        f"recognised families: {', '.join(family_names())}"
    )


# key prefixes of the other parts of a diffusion model (original, ComfyUI and diffusers layouts)
_NOT_VAE = ("model.diffusion_model.", "diffusion_model.", "time_embedding.", "double_blocks.", "joint_blocks.",
            "transformer_blocks.", "cond_stage_model.", "conditioner.", "text_model.", "text_encoders.")


def _no_vae_error(label: str, keys: list[str]) -> CheckpointError:
    enc = ("encoder.", "taesd_encoder.")
    if any(k.startswith(enc) or (k.startswith(_PREFIXES) and k.split(".", 1)[1].startswith(enc)) for k in keys) or (
        keys and all(_TAESD_INDEX.match(k) for k in keys) and "0.weight" in keys
    ):
        return CheckpointError(f"{label}: encoder weights only (no decoder): nothing to decode with")
    other = next((k for k in keys if k.startswith(_NOT_VAE)), None)
    if other is not None:
        return CheckpointError(
            f"{label}: this checkpoint has no VAE weights (a UNet/text-encoder checkpoint? {len(keys)} tensors, e.g. "
            f"{other}; none under first_stage_model./vae./decoder.) — pass the VAE file with --model"
        )
    return _unrecognised(label, keys)


def _analyse(state_dict: dict[str, Tensor], label: str, notes: list[str], n_total: int = 0) -> _Analysis:
    keys = list(state_dict)
    prefix = _vae_prefix(keys)
    if prefix is None:
        raise _no_vae_error(label, keys)

    # -- take the VAE part ---------------------------------------------------------------------------------------------
    if prefix == "taesd_":  # ComfyUI-style combined TAESD: taesd_decoder.N / taesd_encoder.N
        dec = {k[len("taesd_decoder."):]: v for k, v in state_dict.items() if k.startswith("taesd_decoder.")}
        enc = {k[len("taesd_encoder."):]: v for k, v in state_dict.items() if k.startswith("taesd_encoder.")}
        _refuse_unbuildable_taesd(dec, label)
        sd = {**_convert_taesd_original(dec, "decoder"), **_convert_taesd_original(enc, "encoder")}
        return _finish(sd, "taesd-original+taesd_decoder", notes, [], label)
    sub = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    suffix = f"+{prefix.rstrip('.')}" if prefix else ""
    if prefix:
        others = max(n_total, len(state_dict)) - len(sub)
        extra = f" ({others} other tensors, e.g. UNet/text encoders, ignored)" if others else ""
        notes.append(f"VAE taken from under the '{prefix}' prefix: {len(sub)} tensors{extra}")

    if all(_TAESD_INDEX.match(k) for k in sub):
        _refuse_unbuildable_taesd(sub, label)
        return _finish(_convert_taesd_original(sub, "decoder"), "taesd-original" + suffix, notes, [], label)

    sub, extra = _take_latent_stats(sub, notes)  # FLUX.2's BatchNorm, LTX-2's per-channel statistics
    special = _analyse_video_families(sub, suffix, notes, label)  # HunyuanVideo 1.5, LTX-2
    if special is not None:
        special.extra.update(extra)
        return special

    dkeys = [k for k in sub if k.startswith("decoder.")]
    if any(k.startswith("decoder.layers.") for k in dkeys):
        _refuse_unbuildable_taesd(sub, label)  # TAEF2 under diffusers' AutoencoderTiny names
        style = "diffusers"
    elif any(k.startswith(("decoder.middle.", "decoder.upsamples.", "decoder.head.")) for k in dkeys):
        style = "wan-original"
    elif any(k.startswith(("decoder.up.", "decoder.mid.")) for k in dkeys):
        style = "ldm"
    elif any(k.startswith(("decoder.up_blocks.", "decoder.mid_block.", "decoder.conv_in.")) for k in dkeys):
        style = "diffusers"
    else:
        raise _unrecognised(label, state_dict)

    roots = _VAE_ROOTS + (("conv1.", "conv2.") if style == "wan-original" else ())
    dropped = [k for k in sub if not k.startswith(roots)]
    if dropped:
        sub = {k: v for k, v in sub.items() if k.startswith(roots)}
        ema = [k for k in dropped if k.startswith("model_ema.")]
        if any(re.match(r"model_ema\.(encoder|decoder|quant_conv|post_quant_conv)", k) for k in ema):
            # LDM's LitEma keeps a second copy of the VAE (names without dots), e.g. vae-ft-mse-840000-ema-pruned.ckpt
            notes.append(f"the checkpoint holds the VAE twice, plain and as an EMA copy (model_ema.*, {len(ema)} "
                         "tensors): the plain weights are used, the EMA copy is ignored")
            dropped = [k for k in dropped if not k.startswith("model_ema.")]
        if dropped:
            notes.append(f"ignored {len(dropped)} non-VAE tensors, e.g. {', '.join(dropped[:3])}")

    unused: list[str] = []
    if style == "ldm":
        sd, unused = _convert_ldm(sub, notes)
    elif style == "wan-original":
        if any(re.match(r"^decoder\.upsamples\.\d+\.upsamples\.", k) for k in sub):
            sd = _convert_wan22_original(sub)
            notes.append("original Wan 2.2 layout (nested upsamples) converted")
        else:
            from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

            sd = convert_wan_vae_to_diffusers(sub)
    else:
        sd = sub
    sd = _fix_attention(sd, notes)
    a = _finish(sd, style + suffix, notes, [k for k in unused if k.startswith("decoder.")], label)
    a.extra.update(extra)
    return a


def _finish(sd: dict[str, Tensor], layout: str, notes: list[str], unused_dec: list[str], label: str) -> _Analysis:
    has_encoder = any(k.startswith("encoder.") for k in sd)
    if "decoder.layers.0.weight" in sd:
        return _infer_tiny(sd, layout, notes, unused_dec, has_encoder, label)
    if any(k.startswith("decoder.") and (k.endswith(".gamma") or ".to_qkv." in k) for k in sd):
        return _infer_wan(sd, layout, notes, unused_dec, has_encoder, label)
    w = sd.get("decoder.conv_in.conv.weight")
    if w is not None and w.ndim == 5:
        return _infer_kl(sd, layout, notes, unused_dec, has_encoder, label, "AutoencoderKLHunyuanVideo")
    w = sd.get("decoder.conv_in.weight")
    if w is not None and w.ndim == 4:
        return _infer_kl(sd, layout, notes, unused_dec, has_encoder, label, "AutoencoderKL")
    raise _unrecognised(label, sd, " (a decoder without conv_in)")


def _shape(sd, key, label) -> torch.Size:
    if key not in sd:
        raise CheckpointError(f"{label}: VAE checkpoint is missing {key}")
    return sd[key].shape


def _infer_kl(sd, layout, notes, unused_dec, has_encoder, label, cls_name) -> _Analysis:
    c = ".conv" if cls_name == "AutoencoderKLHunyuanVideo" else ""
    ups = _idx(sd, r"^decoder\.up_blocks\.(\d+)\.")
    if not ups or ups != list(range(len(ups))):
        raise _unrecognised(label, sd, " (decoder up blocks missing or not numbered 0..n-1)")
    rev = [_shape(sd, f"decoder.up_blocks.{i}.resnets.0.conv2{c}.weight", label)[0] for i in ups]
    n_res = len(_idx(sd, r"^decoder\.up_blocks\.0\.resnets\.(\d+)\."))
    latent = _shape(sd, f"decoder.conv_in{c}.weight", label)[1]
    out_ch = _shape(sd, f"decoder.conv_out{c}.weight", label)[0]
    in_ch = sd["encoder.conv_in" + c + ".weight"].shape[1] if f"encoder.conv_in{c}.weight" in sd else out_ch
    n = len(ups)
    down_t = "HunyuanVideoDownBlock3D" if c else "DownEncoderBlock2D"
    up_t = "HunyuanVideoUpBlock3D" if c else "UpDecoderBlock2D"
    inferred = {
        "in_channels": int(in_ch),
        "out_channels": int(out_ch),
        "latent_channels": int(latent),
        "block_out_channels": [int(x) for x in reversed(rev)],
        "layers_per_block": max(n_res - 1, 1),
        "down_block_types": [down_t] * n,
        "up_block_types": [up_t] * n,
        "mid_block_add_attention": any(k.startswith("decoder.mid_block.attentions.") for k in sd),
    }
    if cls_name == "AutoencoderKL":
        post = "post_quant_conv.weight" in sd
        quant = "quant_conv.weight" in sd if has_encoder else post
        inferred["use_post_quant_conv"] = post
        inferred["use_quant_conv"] = quant
    return _Analysis(cls_name, layout, sd, inferred, int(latent), has_encoder, notes, unused_dec)


def _infer_wan(sd, layout, notes, unused_dec, has_encoder, label) -> _Analysis:
    ups = _idx(sd, r"^decoder\.up_blocks\.(\d+)\.")
    if not ups or ups != list(range(len(ups))):
        raise _unrecognised(label, sd, " (Wan decoder up blocks missing or not numbered 0..n-1)")
    residual = any(re.match(r"^decoder\.up_blocks\.\d+\.upsampler\.", k) for k in sd)
    z = int(_shape(sd, "decoder.conv_in.weight", label)[1])
    dec_base = int(_shape(sd, "decoder.conv_out.weight", label)[1])
    out_ch = int(_shape(sd, "decoder.conv_out.weight", label)[0])
    outs = [int(_shape(sd, f"decoder.up_blocks.{i}.resnets.0.conv2.weight", label)[0]) for i in ups]
    if any(o % dec_base for o in outs):
        raise CheckpointError(f"{label}: Wan decoder widths {outs} are not multiples of {dec_base}; pass config")
    dim_mult = [o // dec_base for o in reversed(outs)]
    n_res = len(_idx(sd, r"^decoder\.up_blocks\.0\.resnets\.(\d+)\.")) - 1
    sampler = "upsampler" if residual else "upsamplers.0"
    t_up = [f"decoder.up_blocks.{i}.{sampler}.time_conv.weight" in sd for i in ups[:-1]]
    enc_w = sd.get("encoder.conv_in.weight")
    in_ch = int(enc_w.shape[1]) if enc_w is not None else out_ch
    patch = int(round((out_ch / 3) ** 0.5)) if out_ch % 3 == 0 else 1
    inferred = {
        "decoder_base_dim": dec_base,
        "z_dim": z,
        "dim_mult": dim_mult,
        "num_res_blocks": n_res,
        "temperal_downsample": list(reversed(t_up)),
        "is_residual": residual,
        "in_channels": in_ch,
        "out_channels": out_ch,
    }
    if enc_w is not None:
        inferred["base_dim"] = int(enc_w.shape[0])
    if patch > 1:
        inferred["patch_size"] = patch
        inferred["scale_factor_spatial"] = 2 ** (len(dim_mult) - 1) * patch
    return _Analysis("AutoencoderKLWan", layout, sd, inferred, z, has_encoder, notes, unused_dec, residual)


def _tiny_layers(sd, part: str) -> list[tuple[str, torch.Size]]:
    """AutoencoderTiny `layers` in order: ("block", conv.4 shape) or ("conv", weight shape)."""
    items = []
    for i in _idx(sd, rf"^{part}\.layers\.(\d+)\."):
        if f"{part}.layers.{i}.conv.4.weight" in sd:
            items.append(("block", sd[f"{part}.layers.{i}.conv.4.weight"].shape))
        elif f"{part}.layers.{i}.weight" in sd:
            items.append(("conv", sd[f"{part}.layers.{i}.weight"].shape))
    return items


def _infer_tiny(sd, layout, notes, unused_dec, has_encoder, label) -> _Analysis:
    items = _tiny_layers(sd, "decoder")
    if not items or items[0][0] != "conv" or items[-1][0] != "conv":
        raise _unrecognised(label, sd, " (tiny decoder without first/last conv)")
    latent = int(items[0][1][1])
    chans, counts, cur, n = [], [], int(items[0][1][0]), 0
    for kind, shape in items[1:]:
        if kind == "block":
            cur, n = int(shape[0]), n + 1
        else:
            chans.append(cur)
            counts.append(n)
            n = 0
    inferred = {
        "latent_channels": latent,
        "out_channels": int(items[-1][1][0]),
        "decoder_block_out_channels": chans,
        "num_decoder_blocks": counts,
    }
    if has_encoder:
        eitems = _tiny_layers(sd, "encoder")
        if eitems and eitems[0][0] == "conv":
            inferred["in_channels"] = int(eitems[0][1][1])
            echans, ecounts = [], []
            for kind, shape in eitems[:-1]:
                if kind == "conv":
                    echans.append(int(shape[0]))
                    ecounts.append(0)
                else:
                    ecounts[-1] += 1
            inferred["encoder_block_out_channels"] = echans
            inferred["num_encoder_blocks"] = ecounts
    else:
        inferred["in_channels"] = inferred["out_channels"]
    return _Analysis("AutoencoderTiny", layout, sd, inferred, latent, has_encoder, notes, unused_dec)


# ----------------------------------------------------------------------------------------------------------------------
# Family
# ----------------------------------------------------------------------------------------------------------------------

_NAME_HINTS = [  # (family, pattern) on the lower-cased file/dir name or metadata text; first match wins
    ("taesdxl", r"taesd[-_]?xl"),
    ("taesd", r"taesd"),
    ("wan22", r"wan[-_ ]?2[._]?2|ti2v"),
    ("wan21", r"wan[-_ ]?2[._]?1"),
    ("hunyuanvideo15", r"(hunyuan|hy)[-_ ]?video[-_ ]?1[._]?5|hunyuan[-_ ]?1[._]5"),
    ("hunyuanvideo", r"hunyuan|hyvideo"),
    ("ltx2", r"ltx"),
    ("qwenimage", r"qwen"),
    ("flux2", r"flux[-_ .]?2"),
    ("sd3", r"sd[-_ ]?3|stable[-_ ]?diffusion[-_ ]?3"),
    ("flux", r"flux|^ae\.(safetensors|sft)$"),
    ("sdxl", r"sdxl|sd[-_ ]xl|xl(?![a-z])"),
    ("sd2", r"sd[-_ ]?2|v2[-_]1|768-v|stable[-_ ]?diffusion[-_ ]?2"),
    ("sd15", r"sd[-_ ]?v?1(?!\d)|sd[-_ ]?1\.?5|v1[-_][45]|stable[-_ ]?diffusion[-_ ]?v?1"),
]
_KEY_HINTS = [  # other weights of a full checkpoint -> family
    ("sd3", ("model.diffusion_model.joint_blocks.",), "SD3 MMDiT weights"),
    ("flux", ("model.diffusion_model.double_blocks.", "double_blocks."), "FLUX transformer weights"),
    ("sdxl", ("conditioner.embedders.1.", "conditioner.embedders.0.model."), "SDXL text encoders"),
    ("sd2", ("cond_stage_model.model.",), "OpenCLIP text encoder (SD 2.x)"),
    ("sd15", ("cond_stage_model.transformer.",), "CLIP text encoder (SD 1.x)"),
]
_DEFAULTS = {"AutoencoderKLHunyuanVideo": "hunyuanvideo", "AutoencoderTiny": "taesd",
             "AutoencoderKLHunyuanVideo15": "hunyuanvideo15", "AutoencoderKLLTX2Video": "ltx2"}


def _name_hint(text: str) -> str | None:
    text = text.lower()
    for fam, pat in _NAME_HINTS:
        if re.search(pat, text):
            return fam
    return None


def _compatible(spec: FamilySpec, a: _Analysis) -> bool:
    if spec.cls_name != a.cls_name:
        return False
    return a.cls_name == "AutoencoderTiny" or spec.latent_channels == a.latent


def _structure(a: _Analysis) -> str:
    if a.cls_name == "AutoencoderKLWan":
        return f"{a.cls_name} with z_dim {a.latent}"
    return f"{a.cls_name} with {a.latent} latent channels"


def _scaling_match(cfg: dict, a: _Analysis) -> str | None:
    if not isinstance(cfg, dict) or cfg.get("scaling_factor") is None or a.cls_name == "AutoencoderTiny":
        return None
    if isinstance(cfg["scaling_factor"], bool) or not isinstance(cfg["scaling_factor"], int | float):
        return None  # not a number: _build_spec refuses it with a clear message
    hits = []
    for name in family_names():
        spec = get_family(name)
        if _compatible(spec, a) and spec.config.get("scaling_factor") is not None:
            same_scale = abs(float(spec.config["scaling_factor"]) - float(cfg["scaling_factor"])) < 1e-6
            same_shift = abs(float(spec.config.get("shift_factor") or 0) - float(cfg.get("shift_factor") or 0)) < 1e-6
            if same_scale and same_shift:
                hits.append(name)
    if len(hits) > 1 and cfg.get("sample_size") is not None:
        by_size = [h for h in hits if get_family(h).config.get("sample_size") == cfg.get("sample_size")]
        hits = by_size or hits
    return hits[0] if hits else None


def _choose_family(a: _Analysis, family, explicit, meta_cfg, metadata, other_keys, names, notes, label) -> FamilySpec:
    if family:
        spec = get_family(family)
        if not _compatible(spec, a):
            raise CheckpointError(
                f"{label}: family '{spec.name}' ({spec.cls_name}, {spec.latent_channels} latent channels) does not "
                f"match the checkpoint: its weights are an {_structure(a)}"
            )
        notes.append(f"family {spec.name} as requested")
        return spec
    if (spec := _choose_new_family(a, explicit, meta_cfg, metadata, names, notes)) is not None:
        return spec
    if a.cls_name == "AutoencoderKLWan":  # shapes decide
        name = "wan22" if a.is_residual or a.latent == 48 else "wan21"
        spec = get_family(name)
        why = f"{'residual up blocks, ' if a.is_residual else ''}z_dim {a.latent}"
        notes.append(f"family {name} from the weights ({why})")
        if spec.latent_channels != a.latent:
            notes.append(f"z_dim {a.latent} differs from {name}'s {spec.latent_channels}: latents_mean/std do not fit")
        return spec

    ignored = set()

    def accept(name: str | None, source: str, verb: str = "from") -> FamilySpec | None:
        if not name:
            return None
        spec = get_family(name)
        if _compatible(spec, a):
            notes.append(f"family {name} {verb} {source}")
            return spec
        if name not in ignored:
            ignored.add(name)
            notes.append(f"{source} suggests {name}, but the weights are an {_structure(a)}: ignored")
        return None

    for cfg, where in ((explicit, "the given config"), (meta_cfg, "the checkpoint's config")):
        if spec := accept(_scaling_match(cfg, a), f"{where} (scaling_factor {cfg and cfg.get('scaling_factor')})"):
            return spec
    texts = [str(v) for k, v in (metadata or {}).items() if k != "config" and isinstance(v, str)]
    if isinstance(meta_cfg, dict) and meta_cfg.get("_name_or_path"):
        texts.append(str(meta_cfg["_name_or_path"]))
    for t in texts:
        if spec := accept(_name_hint(t), f"the file's metadata ('{t[:60]}')"):
            return spec
    for fam, prefixes, what in _KEY_HINTS:
        if any(k.startswith(prefixes) for k in other_keys):
            if spec := accept(fam, f"the checkpoint's other weights ({what})"):
                return spec
    for n in names:
        if n and (spec := accept(_name_hint(n), f"file name '{n}'", "guessed from")):
            return spec

    # Defaults.
    if a.cls_name == "AutoencoderKL":
        if a.latent == 4:
            notes.append(Notice(
                "family sd15 assumed: SD 1.x, SD 2.x and SDXL VAEs have identical shapes and nothing in the metadata "
                "or file name tells them apart (sd15's scaling_factor 0.18215 is also SD 2.x's); for an SDXL "
                "VAE pass family='sdxl' (--family sdxl)",
                "family sd15 assumed (SD 1.x/2.x and SDXL VAEs look alike): --family sdxl for an SDXL VAE"))
            return get_family("sd15")
        if a.latent == 16:
            notes.append(Notice(
                "family flux assumed: SD3 and FLUX VAEs have identical shapes (16 channels, no quant convs) and "
                "nothing in the metadata or file name tells them apart; for an SD3/3.5 VAE pass family='sd3' "
                "(--family sd3)",
                "family flux assumed (SD3 and FLUX VAEs look alike): --family sd3 for an SD3 VAE"))
            return get_family("flux")
    elif a.cls_name in _DEFAULTS:
        name = _DEFAULTS[a.cls_name]
        spec = get_family(name)
        if a.cls_name == "AutoencoderTiny":
            if a.latent == spec.latent_channels:
                notes.append(Notice(
                    "family taesd assumed: TAESD and TAESDXL have identical shapes; for TAESDXL pass family='taesdxl'",
                    "family taesd assumed (TAESD and TAESDXL look alike): --family taesdxl for TAESDXL"))
            else:
                notes.append(f"{a.latent}-channel tiny autoencoder (e.g. TAESD3/TAEF1): no family of its own, using "
                             f"taesd settings with latent_channels {a.latent}")
            return spec
        if _compatible(spec, a):
            notes.append(f"family {name} from the weights")
            return spec
    if explicit or (isinstance(meta_cfg, dict) and meta_cfg.get("scaling_factor") is not None):
        if a.cls_name == "AutoencoderKL":
            base = "sd15" if "post_quant_conv.weight" in a.sd else "flux"
        else:
            base = _DEFAULTS.get(a.cls_name, "sd15")
        notes.append(f"{_structure(a)} matches no known family; using {base} as the base config (scaling from config)")
        return get_family(base)
    raise CheckpointError(
        f"{label}: not a recognised VAE checkpoint: an {_structure(a)} matches no known family; pass family= and "
        f"config= (recognised families: {', '.join(family_names())})"
    )


# ----------------------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------------------


def _init_params(cls_name: str) -> set[str]:
    return set(inspect.signature(model_class(cls_name).__init__).parameters) - {"self"}


def _load_config_arg(config) -> dict | None:
    if config is None:
        return None
    if isinstance(config, dict):
        if not isinstance(config.get("_class_name", ""), str):
            raise CheckpointError(f"config: \"_class_name\" must be the name of a diffusers class, got "
                                  f"{config['_class_name']!r:.40}")
        return copy.deepcopy(config)
    p = expand_user(config, "--config")
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise CheckpointError(f"config file not found: the folder {p.resolve()} has no config.json")
        p = p / "config.json"
    if p.exists() and not p.is_file():  # a FIFO or a device: it exists, and reading it could block for ever
        raise CheckpointError(f"--config {p}: not a regular file (a FIFO, socket or device); give a config.json file")
    if not p.is_file():
        raise CheckpointError(f"config file not found: {p}")
    try:
        cfg = parse_json(p.read_text())
    except Exception as e:
        raise CheckpointError(f"{p}: config is not valid JSON ({_short(e)})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{p}: config must be a JSON object")
    if not isinstance(cfg.get("_class_name", ""), str):
        raise CheckpointError(f"{p}: \"_class_name\" must be the name of a diffusers class, got "
                              f"{json.dumps(cfg['_class_name'])[:40]}")
    return cfg


def _meta_config(metadata: dict | None, notes: list[str]) -> dict | None:
    raw = (metadata or {}).get("config")
    if raw is None:
        return None
    try:
        cfg = parse_json(raw) if isinstance(raw, str) else raw
    except Exception:
        notes.append("metadata 'config' is not valid JSON: ignored")
        return None
    if isinstance(cfg, dict) and not isinstance(cfg.get("_class_name", ""), str):
        notes.append("metadata 'config' names no class (its \"_class_name\" is not text): ignored")
        return None
    return cfg if isinstance(cfg, dict) else None


# original class names of configs shipped beside original weights -> the diffusers class that ports them
_CLASS_ALIASES = {"AutoencoderKLCausal3D": "AutoencoderKLHunyuanVideo"}


def _alias_config(cfg: dict | None, where: str, notes: list[str]) -> dict | None:
    """HunyuanVideo's original vae/config.json (AutoencoderKLCausal3D) is read as diffusers' AutoencoderKLHunyuanVideo
    config: the same parameters (scaling_factor, widths, ...), except its *_block_types, which name the original's
    block classes and mean nothing to diffusers: dropped (the weights give the block types)."""
    if not isinstance(cfg, dict) or cfg.get("_class_name") not in _CLASS_ALIASES:
        return cfg
    orig = cfg["_class_name"]
    cfg = {k: v for k, v in cfg.items() if not k.endswith("_block_types")}
    cfg["_class_name"] = _CLASS_ALIASES[orig]
    notes.append(f"{where} is for {orig} (the original HunyuanVideo VAE): read as diffusers' {cfg['_class_name']}, "
                 "without its block type names")
    return cfg


_GROUPS_HINT = ("give its group count (CLI: --config with a config.json holding \"norm_num_groups\"; Python: "
                "config={'norm_num_groups': N})")


def _norm_groups(cfg: dict, widths: list[int], source: str, notes: list[str]) -> None:
    g = cfg.get("norm_num_groups") or 32
    if (isinstance(g, bool) or not isinstance(g, int) or g < 1
            or not all(isinstance(w, int) and not isinstance(w, bool) and w > 0 for w in widths)):
        return  # not a usable number: _check_config_values says so, naming where it came from
    if source == "family default" and any(w % g for w in widths):
        g2 = max(d for d in range(1, g + 1) if all(w % d == 0 for w in widths))
        notes.append(
            f"norm_num_groups {g} (family default) does not divide the widths {widths}; using {g2} — a guess; "
            f"{_GROUPS_HINT} if the model was trained with another value"
        )
        cfg["norm_num_groups"] = g2
    elif source == "family default":
        notes.append(
            f"norm_num_groups {g} assumed (family default; group count cannot be read from the weights) — "
            f"{_GROUPS_HINT} if the model was trained with another value"
        )
    else:
        notes.append(f"norm_num_groups {g} from {source}")


def _describe(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items())


def _build_spec(a: _Analysis, spec: FamilySpec, meta_cfg, explicit, notes, label) -> FamilySpec:
    params = _init_params(a.cls_name)
    cfg = copy.deepcopy(spec.config)
    if meta_cfg:
        mc = meta_cfg.get("_class_name")
        if mc and mc != a.cls_name:
            notes.append(f"the checkpoint's config is for {mc}, but the weights are an {a.cls_name}: config ignored")
            meta_cfg = None
    meta_use = {k: v for k, v in (meta_cfg or {}).items() if k in params}
    cfg.update(meta_use)
    shaped = {}
    for k, v in a.inferred.items():
        if k not in params:
            continue
        if k in meta_use and _norm(meta_use[k]) != _norm(v):
            notes.append(f"the checkpoint's config says {k} {meta_use[k]}, the weights say {v}: using the weights")
        if _norm(spec.config.get(k)) != _norm(v) and k not in meta_use:
            shaped[k] = v
        cfg[k] = v
    if a.cls_name == "AutoencoderKLWan" and not a.has_encoder and "base_dim" not in meta_use:
        cfg["base_dim"] = cfg["decoder_base_dim"]  # the encoder is left at init anyway: keep it as small as the decoder
    if shaped:
        keys = [k for k in ("base_dim", "decoder_base_dim", "block_out_channels", "layers_per_block",
                            "latent_channels", "z_dim", "dim_mult", "num_res_blocks",
                            "decoder_block_out_channels", "num_decoder_blocks") if k in shaped]
        if keys:
            notes.append("widths inferred from shapes: " + _describe({k: shaped[k] for k in keys}))
    if "norm_num_groups" in params:
        if explicit and "norm_num_groups" in explicit:
            source = "the given config"
        elif "norm_num_groups" in meta_use:
            source = "the checkpoint's config metadata"
        else:
            source = "family default"
        standard = _norm(cfg.get("block_out_channels")) == _norm(spec.config.get("block_out_channels"))
        if source == "the checkpoint's config metadata" or (source == "family default" and not standard):
            # (a model with the family's own widths uses the family's group count: nothing worth a note)
            _norm_groups(cfg, list(cfg.get("block_out_channels", [])), source, notes)
    for k in ("scaling_factor", "shift_factor"):  # say where the factor in use came from
        if explicit and k in explicit:
            notes.append(f"{k} {explicit[k]} from the given config" + (
                f" (over {meta_use[k]} in the checkpoint's config metadata)" if k in meta_use else
                f" ({spec.name}'s default is {spec.config.get(k)})"))
        elif k in meta_use and _norm(meta_use[k]) != _norm(spec.config.get(k)):
            notes.append(f"{k} {meta_use[k]} from the checkpoint's config metadata ({spec.name}'s default is "
                         f"{spec.config.get(k)})")
    if explicit:
        xc = explicit.get("_class_name")
        if xc and xc != a.cls_name:
            raise CheckpointError(f"{label}: the given config is for {xc}, but the weights are an {a.cls_name}")
        use = {k: v for k, v in explicit.items() if k in params}
        unknown = [k for k in explicit if k not in params and not k.startswith("_")]
        if unknown:
            notes.append(f"ignored unknown config keys for {a.cls_name}: {', '.join(unknown[:5])}")
        for k, v in use.items():
            if k in a.inferred and _norm(a.inferred[k]) != _norm(v):
                notes.append(f"the given config sets {k} {v}, the weights suggest {a.inferred[k]}")
        cfg.update(use)
        if "norm_num_groups" in use:
            notes.append(f"norm_num_groups {use['norm_num_groups']} from the given config")
    if a.cls_name == "AutoencoderKL" and "post_quant_conv.weight" not in a.sd and _post_quant_expected(
            spec, meta_use, explicit):
        raise CheckpointError(
            f"{label}: the weights have no post_quant_conv, which {spec.title} VAEs have (a decoder-only export that "
            "dropped it?): the decode would be wrong. If this VAE really has none, pass a config with "
            '"use_post_quant_conv": false')
    for k in ("scaling_factor", "shift_factor"):  # what unscales "scaled" latents: usable numbers only
        v = cfg.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)
                              or (k == "scaling_factor" and v <= 0)):
            raise CheckpointError(f"{label}: {k} {v!r} in the config is not a "
                                  f"{'positive ' if k == 'scaling_factor' else ''}finite number")
    _check_config_values(a.cls_name, cfg, lambda k: "the given config" if explicit and k in explicit else (
        "the checkpoint's config" if k in meta_use else f"{spec.name}'s settings"), label)
    cfg["_class_name"] = a.cls_name
    return FamilySpec(spec.name, spec.title, cfg)


_MAX_CONFIG_INT = 65536  # no VAE setting (widths, channels, groups, blocks) comes near it; a width of 10**9 would be
# refused only after allocating (or failing to allocate) its weights


def _value_problem(param: inspect.Parameter, v) -> str | None:
    """None if v fits the type a model class's __init__ declares for this setting, else what it should be: a whole
    number >= 1 (0 where that is the default) for an int, a finite number for a float, true/false for a bool, text
    for a str, a list of those for a list or tuple. Settings of no such type are left to the class."""
    import typing

    def kind_ok(want, v, default) -> str | None:
        if want is bool:
            return None if isinstance(v, bool) else "true or false"
        if want is int:
            lo = 0 if default == 0 else 1
            ok = isinstance(v, int) and not isinstance(v, bool) and lo <= v <= _MAX_CONFIG_INT
            return None if ok else f"a whole number from {lo} to {_MAX_CONFIG_INT}"
        if want is float:
            ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            if param.name == "scaling_factor":  # latents are divided by it
                return None if ok and v > 0 else "a positive finite number"
            return None if ok else "a finite number"
        if want is str:
            return None if isinstance(v, str) else "text"
        return None

    ann = param.annotation
    if isinstance(ann, str) or ann is inspect.Parameter.empty:
        return None
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    origin = typing.get_origin(ann)
    if v is None and (type(None) in typing.get_args(ann) or param.default is None):  # `x: int = None`: unset
        return None
    if origin in (list, tuple) or (origin is not None and args and typing.get_origin(args[0]) in (list, tuple)):
        inner = args if origin in (list, tuple) else typing.get_args(args[0])
        inner = [a for a in inner if a is not Ellipsis][:1]
        if not isinstance(v, list | tuple) or len(v) > 1024:
            return "a list"
        why = next((w for x in v if (w := kind_ok(inner[0], x, None) if inner else None)), None)
        return f"a list of {why.replace('a ', '', 1)}s" if why else None
    if ann in (bool, int, float, str):
        return kind_ok(ann, v, param.default)
    if args and all(a in (bool, int, float, str) for a in args):  # e.g. float | None, int | None
        return kind_ok(args[0], v, param.default)
    return None


def _check_config_values(cls_name: str, cfg: dict, source_of, label: str) -> None:
    """Every setting the model class takes, checked against the type its __init__ declares (_value_problem) before
    the model is built. Caught here, a bad value is an error naming the setting and where it came from; caught by
    torch, it was a crash at the first decode (norm_num_groups -4, true)."""
    sig = inspect.signature(model_class(cls_name).__init__).parameters
    for k, v in cfg.items():
        if k in sig and not k.startswith("_") and (why := _value_problem(sig[k], v)):
            raise CheckpointError(f"{label}: {k} {json.dumps(v)[:40]} in {source_of(k)} is not {why}")


_DETECT_CLASSES = ("AutoencoderKL", "AutoencoderKLWan", "AutoencoderKLHunyuanVideo", "AutoencoderTiny",
                   "AutoencoderKLFlux2", "AutoencoderKLQwenImage", "AutoencoderKLHunyuanVideo15",
                   "AutoencoderKLLTX2Video")


def _precheck_config(cfg: dict | None, source: str, label: str) -> None:
    """Before detection reads a config (scaling_factor, shift_factor, latent_channels decide families): a setting
    that fits no model class's declared type is refused now (the class is not known yet)."""
    if not cfg:
        return
    sigs = [inspect.signature(model_class(c).__init__).parameters for c in _DETECT_CLASSES]
    for k, v in cfg.items():
        if k.startswith("_"):
            continue
        problems = [_value_problem(sig[k], v) for sig in sigs if k in sig]
        if problems and all(problems):
            raise CheckpointError(f"{label}: {k} {json.dumps(v)[:40]} in {source} is not {problems[0]}")


def _post_quant_expected(spec: FamilySpec, meta_use: dict, explicit) -> bool:
    """Whether the config in use says the model has a post_quant_conv: the given config, else the checkpoint's
    metadata, else the family (SD 1.x/2.x/SDXL: yes, diffusers' default; SD3/FLUX: no)."""
    for cfg in (explicit or {}, meta_use, spec.config):
        if "use_post_quant_conv" in cfg:
            return cfg["use_post_quant_conv"] is not False
    return True


def _norm(v):
    if isinstance(v, tuple | list):
        return [_norm(x) for x in v]
    return v


# ----------------------------------------------------------------------------------------------------------------------
# FLUX.2, Qwen-Image, HunyuanVideo 1.5, LTX-2
# ----------------------------------------------------------------------------------------------------------------------

# FLUX.2's original ae.safetensors (BFL) keeps the quant convs inside the encoder/decoder; diffusers'
# scripts/convert_flux2_to_diffusers.py (DIFFUSERS_VAE_TO_FLUX2_MAPPING) moves them to the top level, the rest is LDM.
_FLUX2_ORIGINAL = {"encoder.quant_conv.": "quant_conv.", "decoder.post_quant_conv.": "post_quant_conv."}
# LTX-2's original per-channel statistics (diffusers' convert_ltx2_vae_to_diffusers: mean-of-means and std-of-means
# become the latents_mean / latents_std buffers; `channel` and mean-of-stds are dropped)
_LTX2_STATS = {"per_channel_statistics.mean-of-means": "latents_mean",
               "per_channel_statistics.std-of-means": "latents_std"}


def _take_latent_stats(sd: dict[str, Tensor], notes: list[str]) -> tuple[dict[str, Tensor], dict]:
    """Per-checkpoint latent statistics out of the state dict: FLUX.2's BatchNorm (`bn.running_mean/var`, which
    AutoencoderKL, the class vaeopt builds FLUX.2 as, has no place for), and LTX-2's latents_mean/std (kept in the
    state dict too: they are buffers of AutoencoderKLLTX2Video). FLUX.2's original quant-conv names are moved."""
    extra: dict = {}
    if "bn.running_mean" in sd or "bn.running_var" in sd:
        extra["bn"] = {k: sd[f"bn.{k}"].float() for k in ("running_mean", "running_var") if f"bn.{k}" in sd}
        sd = {k: v for k, v in sd.items() if not k.startswith("bn.")}
        moved = [k for k in sd if k.startswith(tuple(_FLUX2_ORIGINAL))]
        if moved:
            renamed = {}
            for k, v in sd.items():
                for old, new in _FLUX2_ORIGINAL.items():
                    if k.startswith(old):
                        k = new + k[len(old):]
                renamed[k] = v
            sd = renamed
            notes.append("original FLUX.2 layout (quant convs inside encoder/decoder) converted")
    if any(k.startswith("per_channel_statistics.") for k in sd):
        sd = {_LTX2_STATS.get(k, k): v for k, v in sd.items()
              if k in _LTX2_STATS or not k.startswith("per_channel_statistics.")}
    if "latents_mean" in sd and "latents_std" in sd:
        extra["latents_mean"], extra["latents_std"] = sd["latents_mean"].float(), sd["latents_std"].float()
    return sd, extra


# HunyuanVideo 1.5's original (Tencent) VAE keys -> AutoencoderKLHunyuanVideo15, after diffusers'
# scripts/convert_hunyuan_video1_5_to_diffusers.py (convert_hunyuan_video_15_vae_checkpoint_to_diffusers): a pure
# renaming; the attention's q/k/v/proj_out are 1x1x1 convs on both sides.
_HY15_RENAMES = [
    (re.compile(r"^(encoder|decoder)\.(down|up)\.(\d+)\.block\.(\d+)\."),
     lambda m: f"{m[1]}.{m[2]}_blocks.{m[3]}.resnets.{m[4]}."),
    (re.compile(r"^(encoder|decoder)\.(down|up)\.(\d+)\.(downsample|upsample)\."),
     lambda m: f"{m[1]}.{m[2]}_blocks.{m[3]}.{m[4]}rs.0."),
    (re.compile(r"^(encoder|decoder)\.mid\.block_([12])\."), lambda m: f"{m[1]}.mid_block.resnets.{int(m[2]) - 1}."),
    (re.compile(r"^(encoder|decoder)\.mid\.attn_1\.(q|k|v)\."), lambda m: f"{m[1]}.mid_block.attentions.0.to_{m[2]}."),
    (re.compile(r"^(encoder|decoder)\.mid\.attn_1\."), lambda m: f"{m[1]}.mid_block.attentions.0."),
]


def _convert_hy15_original(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    out = {}
    for k, v in sd.items():
        for rx, fn in _HY15_RENAMES:
            if m := rx.match(k):
                k = fn(m) + k[m.end():]
                break
        out[k] = v
    return out


def _is_hy15(sd) -> bool:
    """Causal-conv wrappers (`.conv.weight`, 5-D) with RMS norms (`.gamma`): HunyuanVideo 1.5 (Wan has `.gamma` with
    plain conv names; HunyuanVideo 1 and LTX-2 have no `.gamma`)."""
    w = sd.get("decoder.conv_in.conv.weight")
    return w is not None and w.ndim == 5 and any(k.startswith("decoder.") and k.endswith(".gamma") for k in sd)


def _is_ltx2(sd) -> bool:
    """LTX-2: causal convs with parameter-free norms (no norm weights in its resnets, unlike HunyuanVideo's
    GroupNorms), or the original's `res_blocks` names."""
    w = sd.get("decoder.conv_in.conv.weight")
    if w is None or w.ndim != 5:
        return False
    if any(".res_blocks." in k for k in sd if k.startswith("decoder.")):
        return True
    return ("decoder.mid_block.resnets.0.conv1.conv.weight" in sd
            and not any(k.startswith("decoder.mid_block.resnets.0.norm") for k in sd))


def _analyse_video_families(sd: dict[str, Tensor], suffix: str, notes: list[str], label: str) -> _Analysis | None:
    """HunyuanVideo 1.5 and LTX-2 (diffusers or original keys) -> their analysis; None for every other layout."""
    if _is_hy15(sd):
        original = any(re.match(r"^decoder\.(mid\.block_1|up\.\d+\.block)\.", k) for k in sd)
        if original:
            sd = _convert_hy15_original(sd)
        keep = {k: v for k, v in sd.items() if k.startswith(("encoder.", "decoder."))}
        if len(keep) != len(sd):
            notes.append(f"ignored {len(sd) - len(keep)} non-VAE tensors, e.g. {_few(k for k in sd if k not in keep)}")
        return _infer_hy15(keep, ("hunyuanvideo15-original" if original else "diffusers") + suffix, notes, label)
    if _is_ltx2(sd):
        original = any(".res_blocks." in k for k in sd)
        if original:
            from diffusers.loaders.single_file_utils import convert_ltx2_vae_to_diffusers

            sd = convert_ltx2_vae_to_diffusers(dict(sd))  # (it pops from the dict it is given)
            # LTX-2.3's fourth up block (scripts/convert_ltx2_to_diffusers.py LTX_2_3_VIDEO_VAE_RENAME_DICT), which
            # the 2.0 renaming leaves alone
            sd = {re.sub(r"^decoder\.up_blocks\.7\.", "decoder.up_blocks.3.upsamplers.0.",
                         re.sub(r"^decoder\.up_blocks\.8\.", "decoder.up_blocks.3.", k)): v for k, v in sd.items()}
        keep = {k: v for k, v in sd.items() if k.startswith(("encoder.", "decoder.", "latents_"))}
        if len(keep) != len(sd):
            notes.append(f"ignored {len(sd) - len(keep)} non-VAE tensors, e.g. {_few(k for k in sd if k not in keep)}")
        return _infer_ltx2(keep, ("ltx2-original" if original else "diffusers") + suffix, notes, label)
    return None


def _infer_hy15(sd, layout, notes, label) -> _Analysis:
    ups = _idx(sd, r"^decoder\.up_blocks\.(\d+)\.")
    if not ups or ups != list(range(len(ups))):
        raise _unrecognised(label, sd, " (HunyuanVideo 1.5 decoder up blocks missing or not numbered 0..n-1)")
    widths = [int(_shape(sd, f"decoder.up_blocks.{i}.resnets.0.conv2.conv.weight", label)[0]) for i in ups]
    n_res = len(_idx(sd, r"^decoder\.up_blocks\.0\.resnets\.(\d+)\."))
    latent = int(_shape(sd, "decoder.conv_in.conv.weight", label)[1])
    out_ch = int(_shape(sd, "decoder.conv_out.conv.weight", label)[0])
    enc = sd.get("encoder.conv_in.conv.weight")
    has_encoder = any(k.startswith("encoder.") for k in sd)
    inferred = {"in_channels": int(enc.shape[1]) if enc is not None else out_ch, "out_channels": out_ch,
                "latent_channels": latent, "block_out_channels": list(reversed(widths)),
                "layers_per_block": max(n_res - 1, 1)}
    return _Analysis("AutoencoderKLHunyuanVideo15", layout, sd, inferred, latent, has_encoder, notes, [])


# LTX-2 decoders by their number of up blocks (scripts/convert_ltx2_to_diffusers.py get_ltx2_video_vae_config): 2.0's
# three, each upsampling by 2 in space and time with a residual; 2.3's (and 2.5's) four, with mixed factors
_LTX_UP = {
    3: {"upsample_type": ["spatiotemporal"] * 3, "upsample_residual": [True] * 3, "upsample_factor": [2, 2, 2],
        "decoder_spatio_temporal_scaling": [True] * 3, "decoder_inject_noise": [False] * 4},
    4: {"upsample_type": ["spatiotemporal", "spatiotemporal", "temporal", "spatial"],
        "upsample_residual": [False] * 4, "upsample_factor": [2, 2, 1, 2],
        "decoder_spatio_temporal_scaling": [True] * 4, "decoder_inject_noise": [False] * 5},
}
# the padding is not in the weights: each release's, where no config says otherwise
_LTX_PADDING = {3: "reflect", 4: "zeros"}


def _infer_ltx2(sd, layout, notes, label) -> _Analysis:
    """LTX-2's decoder shape from its weights: the number of up blocks tells LTX-2.0 from LTX-2.3 (their upsampler
    kinds and factors), the shapes then give the widths and depths."""
    latent = int(_shape(sd, "decoder.conv_in.conv.weight", label)[1])
    out_ch = int(_shape(sd, "decoder.conv_out.conv.weight", label)[0])
    has_encoder = any(k.startswith("encoder.") for k in sd)
    ups = _idx(sd, r"^decoder\.up_blocks\.(\d+)\.")
    inferred: dict = {"latent_channels": latent}
    extra: dict = {}
    patch = int(round((out_ch / 3) ** 0.5))
    if patch * patch * 3 == out_ch:
        inferred["patch_size"] = patch
    if all(f"decoder.up_blocks.{i}.upsamplers.0.conv.conv.weight" in sd for i in ups) and len(ups) in _LTX_UP:
        shape = _LTX_UP[len(ups)]
        rev = [int(_shape(sd, f"decoder.up_blocks.{i}.resnets.0.conv2.conv.weight", label)[0]) * f
               for i, f in zip(ups, reversed(shape["upsample_factor"]))]
        n_mid = len(_idx(sd, r"^decoder\.mid_block\.resnets\.(\d+)\."))
        n_up = [len(_idx(sd, rf"^decoder\.up_blocks\.{i}\.resnets\.(\d+)\.")) for i in ups]
        inferred.update(shape)
        extra = {"ltx_padding": _LTX_PADDING[len(ups)]}
        inferred["decoder_block_out_channels"] = list(reversed(rev))
        inferred["decoder_layers_per_block"] = list(reversed([n_mid] + n_up))
    a = _Analysis("AutoencoderKLLTX2Video", layout, sd, inferred, latent, has_encoder, notes, [])
    a.extra.update(extra)
    return a


# diffusers classes whose decoders vaeopt runs as another class's (module for module the same): the config of the
# first is read as the second's, and the family is remembered
_NEW_CLASS_ALIASES = {"AutoencoderKLQwenImage": ("AutoencoderKLWan", "qwenimage"),
                      "AutoencoderKLFlux2": ("AutoencoderKL", "flux2")}


def _alias_new_class(cfg: dict | None, where: str, notes: list[str]) -> dict | None:
    """A Qwen-Image config (AutoencoderKLQwenImage) read as AutoencoderKLWan's (its decoder is Wan 2.1's;
    input_channels is Wan's in/out_channels), a FLUX.2 config (AutoencoderKLFlux2) as AutoencoderKL's (its
    encoder/decoder are AutoencoderKL's; batch_norm_eps kept for the latent normalization)."""
    if not isinstance(cfg, dict) or cfg.get("_class_name") not in _NEW_CLASS_ALIASES:
        return cfg
    orig = cfg["_class_name"]
    cls, fam = _NEW_CLASS_ALIASES[orig]
    cfg = dict(cfg)
    if orig == "AutoencoderKLQwenImage" and "input_channels" in cfg:
        cfg["in_channels"] = cfg["out_channels"] = cfg.pop("input_channels")
    if orig == "AutoencoderKLFlux2":
        if "batch_norm_eps" in cfg:
            cfg["_bn_eps"] = cfg.pop("batch_norm_eps")
        if cfg.get("decoder_block_out_channels") is None:
            cfg.pop("decoder_block_out_channels", None)
    cfg["_class_name"], cfg["_family"] = cls, fam
    notes.append(f"{where} is for {orig} ({get_family(fam).title}): its decoder is diffusers' {cls}'s, module for "
                 f"module, so it runs as one")
    return cfg


def _choose_new_family(a: _Analysis, explicit, meta_cfg, metadata, names, notes) -> FamilySpec | None:
    """FLUX.2 (an AutoencoderKL with 32 latent channels: no other AutoencoderKL family has them) and Qwen-Image (Wan
    2.1's shapes, named by its config class, the file's metadata or its name); None: the other families' rules."""
    if a.cls_name in ("AutoencoderKLHunyuanVideo15", "AutoencoderKLLTX2Video"):  # one family per class
        name = _DEFAULTS[a.cls_name]
        notes.append(f"family {name} from the weights ({a.cls_name})")
        return get_family(name)
    if a.cls_name == "AutoencoderKL" and a.latent == 32:
        why = "BatchNorm latent statistics" if a.extra.get("bn") else "no BatchNorm statistics in the weights"
        notes.append(f"family flux2 from the weights (32 latent channels, {why})")
        return get_family("flux2")
    if a.cls_name != "AutoencoderKLWan" or a.is_residual or a.latent != 16:
        return None
    for cfg, where in ((explicit, "the given config"), (meta_cfg, "the checkpoint's config")):
        if isinstance(cfg, dict) and cfg.get("_family") == "qwenimage":
            notes.append(f"family qwenimage from {where} (AutoencoderKLQwenImage)")
            return get_family("qwenimage")
    texts = [str(v) for k, v in (metadata or {}).items() if k != "config" and isinstance(v, str)]
    if isinstance(meta_cfg, dict) and meta_cfg.get("_name_or_path"):
        texts.append(str(meta_cfg["_name_or_path"]))
    for t, where in [(t, f"the file's metadata ('{t[:60]}')") for t in texts] + [(n, f"file name '{n}'") for n in names
                                                                                   if n]:
        if _name_hint(t) == "qwenimage":
            notes.append(f"family qwenimage from {where}")
            return get_family("qwenimage")
    return None


def _finish_new_family_spec(spec: FamilySpec, a: _Analysis, explicit, meta_cfg, notes: list[str], label: str
                            ) -> None:
    """The checkpoint's own latent statistics into its family config: FLUX.2's BatchNorm running mean/var (and eps,
    from the config where it says one), LTX-2's latents_mean/std. An LTX decoder with timestep conditioning is
    refused: its pipeline decodes with a timestep and noise (decode_timestep / decode_noise_scale) that the plain
    decode does not pass, and diffusers' decode without them fails."""
    if spec.name == "ltx2" and spec.config.get("timestep_conditioning"):
        raise CheckpointError(f"{label}: an LTX VAE with timestep conditioning (its decoder takes the pipeline's "
                              "decode_timestep and noise): vaeopt decodes LTX-2 VAEs without it only")
    if spec.name == "flux2":
        bn = a.extra.get("bn", {})
        eps = next((c["_bn_eps"] for c in (explicit, meta_cfg) if isinstance(c, dict) and "_bn_eps" in c),
                   spec.config["_bn"].get("eps", 1e-4))
        stats = {"eps": float(eps), "patch_size": [2, 2],
                 "mean": bn["running_mean"].tolist() if "running_mean" in bn else None,
                 "var": bn["running_var"].tolist() if "running_var" in bn else None}
        want = 4 * spec.latent_channels
        for k in ("mean", "var"):
            if stats[k] is not None and len(stats[k]) != want:
                raise CheckpointError(f"{label}: FLUX.2 BatchNorm running_{k} has {len(stats[k])} channels, the "
                                      f"2x2-patchified latents {want}")
        if stats["mean"] is None or stats["var"] is None:
            notes.append("no BatchNorm statistics (bn.running_mean/var) in the weights: pipeline (scaled) latents are "
                         "read with mean 0 and variance 1; pass raw latents (--latent-space raw) for an exact decode")
        spec.config["_bn"] = stats
    elif spec.name == "ltx2":
        if "latents_mean" in a.extra:
            spec.config["latents_mean"] = a.extra["latents_mean"].tolist()
            spec.config["latents_std"] = a.extra["latents_std"].tolist()
        key = "decoder_spatial_padding_mode"
        if "ltx_padding" in a.extra and not any(isinstance(c, dict) and key in c for c in (explicit, meta_cfg)):
            spec.config[key] = a.extra["ltx_padding"]


# ----------------------------------------------------------------------------------------------------------------------
# Public: detect / load
# ----------------------------------------------------------------------------------------------------------------------


def _detect(
    state_dict, *, filename="", metadata=None, family=None, config=None, other_keys=None, names=None, is_dir=False
) -> tuple[FamilySpec, _Analysis, list[str]]:
    label = filename or "checkpoint"
    notes: list[str] = []
    if not state_dict:
        raise CheckpointError(f"{label}: not a checkpoint: it holds no tensors")
    a = _analyse(state_dict, label, notes, len(other_keys or ()))
    if is_dir:
        a.layout = "diffusers-dir" if a.layout == "diffusers" else f"{a.layout} (directory)"
    explicit = _alias_new_class(_alias_config(_load_config_arg(config), "the given config", notes), "the given config",
                                notes)
    meta_cfg = _alias_new_class(_alias_config(_meta_config(metadata, notes), "the checkpoint's config", notes),
                                "the checkpoint's config", notes)
    _precheck_config(explicit, "the given config", label)
    _precheck_config(meta_cfg, "the checkpoint's config", label)
    if names is None:
        names = [Path(filename).name] if filename else []
    spec = _choose_family(a, family, explicit, meta_cfg, metadata, other_keys or list(state_dict), names, notes, label)
    spec = _build_spec(a, spec, meta_cfg, explicit, notes, label)
    _finish_new_family_spec(spec, a, explicit, meta_cfg, notes, label)
    if a.cls_name == "AutoencoderTiny" and spec.latent_channels != 4:
        _tiny_raw_latents(spec, names + [label], notes)
    return spec, a, notes


def _tiny_raw_latents(spec: FamilySpec, names: list[str], notes: list[str]) -> None:
    """Which big VAE's raw latents a 16-channel tiny decoder's input is scaled from (TAESD3: SD3's, TAEF1: FLUX's),
    as ComfyUI does: (raw - shift_factor) * scaling_factor. Only the file name tells the two apart; without a hint
    raw latents are refused for it (latents.to_raw), pipeline ("scaled") latents need no factor."""
    base = None
    for n in names:  # the file's own name first, then the folders around it
        text = Path(n).name.lower() if n else ""
        base = "sd3" if re.search(r"taesd[-_]?3|sd[-_ ]?3", text) else "flux" if re.search(r"taef1|flux", text) else None
        if base:
            break
    if base is None or spec.latent_channels != 16:
        spec.config["_raw_latents"] = None
        return
    spec.config["_raw_latents"] = {"vae": base}
    notes.append(f"raw latents (e.g. ComfyUI .latent) are scaled as {get_family(base).title}'s (file name) before this "
                 "tiny decoder")


def detect(
    state_dict: dict[str, Tensor],
    *,
    filename: str = "",
    metadata: dict | None = None,
    family: str | None = None,
    config: dict | str | Path | None = None,
) -> tuple[FamilySpec, str, list[str]]:
    """Family (its config adjusted to the checkpoint's real widths), layout name and human notes for a state dict."""
    spec, a, notes = _detect(state_dict, filename=filename, metadata=metadata, family=family, config=config)
    return spec, a.layout, notes


def _dtype_on_disk(tensors: dict[str, Tensor], notes: list[str]) -> torch.dtype | None:
    count: dict[torch.dtype, int] = {}
    for v in tensors.values():
        if v.is_floating_point():
            count[v.dtype] = count.get(v.dtype, 0) + v.numel()
    if not count:
        return None
    main = max(count, key=count.get)
    if len(count) > 1:
        notes.append("mixed dtypes on disk: " + ", ".join(str(d).replace("torch.", "") for d in count))
    return main


def _few(keys, n: int = 3) -> str:
    keys = list(keys)
    return ", ".join(keys[:n]) + (f" (+{len(keys) - n} more)" if len(keys) > n else "")


def _instantiate(spec: FamilySpec, label: str, meta: bool = False):
    params = _init_params(spec.cls_name)
    kwargs = {k: v for k, v in spec.config.items() if k in params}
    cls = model_class(spec.cls_name)
    try:
        if meta:  # no memory, no init: every tensor is assigned from the checkpoint afterwards
            with torch.device("meta"):
                return cls(**kwargs)
        return cls(**kwargs)
    except Exception as e:
        raise CheckpointError(f"{label}: cannot build {spec.cls_name} from the detected config ({_short(e)})") from None


def _load_into_model(spec: FamilySpec, a: _Analysis, label: str, notes: list[str], dtype) -> torch.nn.Module:
    model = _instantiate(spec, label, meta=True)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    sd = a.sd
    # (LTX-2's latents_mean/std buffers go with the decoder: the latent statistics its pipeline decodes with)
    is_dec = lambda k: k.startswith(("decoder.", "post_quant_conv.", "latents_"))  # noqa: E731

    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    mism = [k for k in sd if k in expected and tuple(sd[k].shape) != expected[k]]
    problems = []
    dec_missing = [k for k in missing if is_dec(k)]
    dec_unexpected = [k for k in unexpected if is_dec(k)] + list(a.unused_decoder)
    if dec_missing:
        problems.append(f"missing {len(dec_missing)} decoder tensors: {_few(dec_missing)}")
    if dec_unexpected:
        problems.append(f"unexpected decoder tensors: {_few(dec_unexpected)}")
    dec_mism = [k for k in mism if is_dec(k)]
    if dec_mism:
        problems.append(
            "shape mismatch: "
            + "; ".join(f"{k} {list(sd[k].shape)} vs expected {list(expected[k])}" for k in dec_mism[:3])
            + (f" (+{len(dec_mism) - 3} more)" if len(dec_mism) > 3 else "")
        )
    if problems:
        raise CheckpointError(
            f"{label}: decoder weights do not fit {spec.cls_name} ({spec.name}, layout {a.layout}): "
            + "; ".join(problems)
            + " — wrong family/config, or a damaged file"
        )

    enc_missing = [k for k in missing if not is_dec(k)]
    enc_bad = [k for k in unexpected if not is_dec(k)] + [k for k in mism if not is_dec(k)]
    if enc_bad:
        notes.append(f"encoder weights do not fit ({_few(enc_bad)}): encoder left at init, decode only")
        enc_missing = [k for k in expected if not is_dec(k)]
    elif enc_missing and not a.has_encoder:
        notes.append("encoder weights absent: decode only")
    elif enc_missing:
        notes.append(
            f"encoder incomplete ({len(enc_missing)} tensors missing, e.g. {_few(enc_missing, 2)}): decode only"
        )
    skip = set(enc_missing)
    load = {k: v.to(dtype=dtype).contiguous() for k, v in sd.items() if k in expected and k not in skip}
    if enc_missing:  # take those from a normally initialised model
        fresh = _instantiate(spec, label).state_dict()
        load.update({k: fresh[k].to(dtype) for k in enc_missing})
    model.load_state_dict(load, strict=True, assign=True)
    return model


def _to(model: torch.nn.Module, device, dtype) -> torch.nn.Module:
    # torch's own .to: diffusers' ModelMixin.to logs a warning about fp32 modules whenever a dtype is passed.
    return torch.nn.Module.to(model, device=device, dtype=dtype).eval().requires_grad_(False)


def load_vae(
    path: str | Path | None = None,
    *,
    family: str | None = None,
    config: str | Path | dict | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> LoadedVAE:
    """Load a VAE checkpoint (file or diffusers directory) into an eval-mode diffusers model on `device` in `dtype`
    (a torch.dtype, or "fp32" / "bf16" / "fp16" as Options takes). With path=None, builds the family's model with
    random weights (for benchmarks)."""
    from vaeopt.hw import resolve_device, resolve_dtype

    # all checked before the checkpoint is read: torch's own errors (an int8 load_state_dict, device 'tpu', CUDA on a
    # CPU build) would come after seconds of reading, as tracebacks
    if not isinstance(dtype, (torch.dtype, str)) or (isinstance(dtype, str) and dtype.lower() == "auto"):
        raise VaeoptError(f"load_vae: dtype must be a torch.dtype or one of fp32, bf16, fp16, got {dtype!r}")
    dtype = resolve_dtype(dtype, torch.device("cpu"))  # torch.float32 / bfloat16 / float16 only
    if device is not None:  # (None: left where it is built, the CPU)
        if not isinstance(device, (str, torch.device)):
            raise VaeoptError(f"load_vae: device must be 'cpu', 'cuda', 'cuda:N' or a torch.device, got {device!r}")
        device = resolve_device(str(device))
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise VaeoptError(f"load_vae: path must be a checkpoint file or diffusers folder (a str or Path), got "
                          f"{type(path).__name__} {path!r:.60}")
    if path is None:
        if not family:
            raise CheckpointError("no checkpoint given: pass a path, or a family for a randomly initialised model")
        spec = get_family(family)
        explicit = _load_config_arg(config)
        if explicit:
            spec = spec.with_config({k: v for k, v in explicit.items() if k in _init_params(spec.cls_name)})
            _check_config_values(spec.cls_name, spec.config, lambda k: "the given config", spec.name)
        model = _instantiate(spec, spec.name)
        model = _to(model, device, dtype)
        return LoadedVAE(model, spec, "random-init", None, ["no checkpoint: random weights"], None)

    path = Path(path)
    sibling = path.parent / "config.json"
    if (config is None and path.is_file() and path.name.startswith("diffusion_pytorch_model")
            and sibling.is_file()):
        # the weights file of a diffusers folder (an HF download's vae/): its settings are in the config beside it,
        # not in the file (scaling_factor, norm groups), so read them there, as loading the folder would
        config = sibling
        sibling_note = f"settings from {sibling} (the diffusers folder this weights file is in)"
    else:
        sibling_note = None
    src = _read(path, select_vae=True)
    label = str(src.path)
    spec, a, notes = _detect(
        src.tensors,
        filename=label,
        metadata=src.metadata,
        family=family,
        config=config,
        other_keys=src.all_keys,
        names=src.hint_names,
        is_dir=src.is_dir,
    )
    if sibling_note:
        notes.insert(0, sibling_note)
    disk = _dtype_on_disk(a.sd, notes)
    bad = [k for k, v in a.sd.items() if k.startswith(("decoder.", "post_quant_conv.")) and v.is_floating_point()
           and not torch.isfinite(v if v.element_size() > 1 else v.float()).all()]
    if bad:  # the decode would be NaN and blamed on fp16 or the latents
        raise CheckpointError(f"{label}: {len(bad)} decoder weight tensor(s) hold NaN/Inf (e.g. {bad[0]}): a broken "
                              "checkpoint (a diverged training run, or a bad conversion)")
    model = _load_into_model(spec, a, label, notes, dtype)
    model = _to(model, device, dtype)
    if disk is not None:
        name = lambda d: str(d).replace("torch.", "")  # noqa: E731
        notes.append(f"weights on disk: {name(disk)}, loaded as {name(dtype)}")
    return LoadedVAE(model, spec, a.layout, src.path, notes, disk)


def load_vae_from_state_dict(
    state_dict: dict[str, Tensor],
    *,
    family: str | None = None,
    metadata: dict | None = None,
    config: dict | None = None,
    label: str = "state dict",
    dtype: torch.dtype | None = None,
) -> LoadedVAE:
    """A LoadedVAE built from tensors already in memory (another program's loaded VAE, e.g. ComfyUI's
    `first_stage_model.state_dict()`), in any layout load_vae reads (LDM, original Wan 2.1 / 2.2, diffusers...).

    The model is built on the meta device and the tensors are assigned, not copied: where a tensor already has the
    wanted dtype and is contiguous, the model's parameter shares its memory (and device) with the caller's, so a VAE
    on the GPU is not held twice. dtype=None keeps the tensors' own dtype. family and config (e.g. the
    norm_num_groups that the weights cannot show) as load_vae takes them. Nothing is moved; no NaN scan (the
    caller's weights already decode in its own program)."""
    if not isinstance(state_dict, dict) or not all(isinstance(v, Tensor) for v in state_dict.values()):
        raise VaeoptError(f"{label}: expected a dict of name -> tensor, got {type(state_dict).__name__}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise VaeoptError(f"{label}: dtype must be a torch.dtype or None (keep the tensors' own), got {dtype!r}")
    spec, a, notes = _detect(state_dict, filename=label, metadata=metadata, family=family, config=config, names=[])
    disk = _dtype_on_disk(a.sd, notes)
    model = _load_into_model(spec, a, label, notes, dtype or disk or torch.float32)
    model.eval().requires_grad_(False)
    return LoadedVAE(model, spec, f"{a.layout} (state dict)", None, notes, disk)
