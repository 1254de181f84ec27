"""Reading latent files and turning them into the raw latents a VAE decoder consumes.

Formats: .pt/.pth (a tensor, a dict of tensors, or a list; saved on CUDA or CPU; loaded with weights_only=True),
.safetensors, ComfyUI .latent, .npy, .npz (numpy.savez; never unpickled).

Latent space: pipelines hand out *scaled* latents (diffusers ``output_type="latent"``); ComfyUI ``.latent`` files hold
*raw* VAE latents. Defaults per format are below; ``latent_space="scaled"|"raw"`` overrides.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import lzma
import math
import pickle
import warnings
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vaeopt.errors import LatentError
from vaeopt.families import FamilySpec, get_family
from vaeopt.loading import (allow_numpy_scalars, magic_name, parse_json, refused_global, safetensors_header_problem,
                            sniff)
from vaeopt.outputs import atomic_path

LATENT_SUFFIXES = (".pt", ".pth", ".safetensors", ".latent", ".npy", ".npz")
MANIFEST = "vaeopt.json"
# Bounds on the work one input file may ask for, checked before anything is decoded (vaeopt decode --max-outputs,
# --max-output-gb): a 40 KB .pt can hold one tensor referenced 20,000 times, or a batch dimension of 20,000. The
# outputs (images, clips; the tensors a file holds) and the decoded size, counted as 8-bit RGB pixels (what the
# decode computes and a PNG/MP4 holds before compression; a .safetensors output is 4x that).
DEFAULT_MAX_OUTPUTS = 1000
DEFAULT_MAX_OUTPUT_GB = 64.0
# Refuse decodes whose output alone would exceed this many pixels per frame (64k x 64k would need >16 GiB per frame).
MAX_OUTPUT_PIXELS = 16384 * 16384
# .npy/.npz headers are checked before their data is read: a latent frame too large to decode within MAX_OUTPUT_PIXELS
# even at a 4x downscale (LDM's kl-f4, the smallest in use; SD, FLUX and Wan use 8 or 16) is refused unread.
_MIN_SPATIAL_FACTOR = 4
# A zip (.npz, .pt) may unpack to at most this much more than its own size: deflate packs zeros ~1000:1, so a 1 MB file
# can declare a 1 GiB tensor, all of it allocated before any check of its shape. numpy.savez_compressed latents (float
# noise) shrink by 10% or so, so real files are far from it; torch.save stores its members uncompressed.
MAX_INFLATION = 256 * 1024**2
# ComfyUI files without a version marker stored latents multiplied by SD1's 0.18215 (ComfyUI's LoadLatent divides).
_COMFY_LEGACY_SCALE = 0.18215


@dataclass
class LatentEntry:
    name: str  # key inside the file ("" for a bare tensor)
    tensor: torch.Tensor
    # (height, width) in pixels of the image packed latents were made for: FLUX.2's and Qwen-Image's token sequences
    # do not say it (--height/--width, the file's "height"/"width" metadata, or vaeopt.json's)
    size: tuple[int, int] | None = None


@dataclass
class LatentFile:
    path: Path
    format: str  # "pt", "comfyui-dict", "safetensors", "comfyui-latent", "npy", "npz"
    entries: list[LatentEntry]
    default_space: str  # "scaled" or "raw"
    notes: list[str] = field(default_factory=list)
    manifest: dict = field(default_factory=dict)  # per-file hints from a vaeopt.json beside the file
    # with --key: every tensor of the file, the chosen one among them (outputs keep its name where it was one of
    # several latents, as without --key)
    all_entries: list[LatentEntry] | None = None


def read_manifest(path: Path) -> dict:
    """Hints from a ``vaeopt.json`` beside the latents: {"files": {name: {"model": ..., "latent_space": ...}}}, and
    optionally the model's "family" (for a checkpoint whose family its shapes cannot tell, e.g. SD 1.x vs SDXL); a
    top-level "model" / "family" / "latent_space" applies to every file of the folder that does not name its own (the
    top-level latent_space, as "folder_latent_space", only where the file's format or metadata does not say)."""
    mpath = path.parent / MANIFEST
    if not mpath.is_file():
        return {}
    try:
        data = parse_json(mpath.read_text())
    except (OSError, ValueError) as e:
        raise LatentError(f"{mpath}: unreadable manifest ({str(e)[:160]})") from e
    files = data.get("files", {}) if isinstance(data, dict) else None
    if isinstance(data, dict):
        _known_keys(mpath, data, ("files", "model", "family", "latent_space"), "at the top level")
    if isinstance(files, dict):
        for name, entry in files.items():
            if isinstance(entry, dict):
                # (height, width: the image size of packed FLUX.2 / Qwen-Image latents)
                _known_keys(mpath, entry, ("model", "family", "latent_space", "height", "width"), f"for {name}")
    hint = files.get(path.name, {}) if isinstance(files, dict) else None
    if isinstance(hint, dict):  # top-level "model" / "latent_space": defaults for every file of the folder
        if not isinstance(data.get("model", ""), str):
            raise LatentError(f"{mpath}: the top-level \"model\" must be a path, got {json.dumps(data['model'])[:40]}")
        hint = {**({"model": data["model"]} if data.get("model") and "model" not in hint else {}), **hint}
        if data.get("family") and "family" not in hint:  # the family of the folder's model
            hint["family"] = data["family"]
        if "latent_space" in data and "latent_space" not in hint:  # weaker than the file's own format / metadata
            hint["folder_latent_space"] = data["latent_space"]
    if not isinstance(hint, dict) or not isinstance(hint.get("model", ""), str):
        raise LatentError(f"{mpath}: manifest must look like {{\"files\": {{\"{path.name}\": {{\"model\": \"vae.safetensors\", "
                          f"\"latent_space\": \"scaled\"}}}}}}")
    hint = dict(hint)
    if not isinstance(hint.get("family", ""), str):
        raise LatentError(f"{mpath}: \"family\" must be a family name such as \"sd15\", got "
                          f"{json.dumps(hint['family'])[:40]}")
    for k in ("latent_space", "folder_latent_space"):
        if hint.get(k, "scaled") not in ("scaled", "raw"):
            raise LatentError(f"{mpath}: latent_space {'for ' + path.name + ' ' if k == 'latent_space' else ''}"
                              f"must be \"scaled\" or \"raw\", got {json.dumps(hint[k])[:40]}")
    if not hint.get("model"):
        hint.pop("model", None)  # "": no model named, not the manifest's folder
        if isinstance(files, dict) and files and path.name not in files:
            # found, but nothing in it for this file: said where the model lookup fails ("LAT.npy", "*.npy")
            hint.update(unlisted_in=str(mpath), listed=sorted(files)[:4])
    else:
        try:
            hint["model"] = str((mpath.parent / hint["model"]).resolve())
        except (OSError, RuntimeError, ValueError) as e:  # a symlink loop, a NUL byte in the name
            raise LatentError(f"{mpath}: \"model\" {json.dumps(hint['model'])[:60]} is not a usable path "
                              f"({getattr(e, 'strerror', None) or e})") from None
    return hint


def _known_keys(mpath: Path, d: dict, known: tuple[str, ...], where: str) -> None:
    """A manifest key vaeopt does not know is an error, not ignored: `"latent-space": "raw"` (the flag's spelling)
    silently decoded in the other latent space. Keys starting with "_" are comments."""
    for k in d:
        if k not in known and not k.startswith("_"):  # "_doc", "_comment": notes for people
            near = difflib.get_close_matches(k.replace("-", "_"), known, n=1, cutoff=0.6)
            raise LatentError(f"{mpath}: unknown key \"{k}\" {where}" + (f" (did you mean \"{near[0]}\"?)" if near
                              else f" (it takes {', '.join(map(json.dumps, known))})"))


MAX_NESTING = 16  # dicts/lists inside each other in a .pt; real files nest 1-3 deep


def _collect(obj, prefix: str, out: list[LatentEntry], where: str = "") -> None:
    """The tensors of a loaded .pt in file order, named by their path of keys. Iterative, with a depth limit and a
    cycle check: a 40-byte file can be a list inside itself, or 1500 nested dicts. A container met again elsewhere
    (pickle shares equal tuples such as two (1024, 1024) sizes) holds no new tensors and is skipped."""
    stack = [(obj, prefix, 0, ())]
    seen: set[int] = set()
    while stack:
        o, name, depth, ancestors = stack.pop()
        if isinstance(o, torch.Tensor):
            out.append(LatentEntry(name, o))
            continue
        if not isinstance(o, (dict, list, tuple)):
            continue
        if id(o) in ancestors:
            raise LatentError(f"{where}: {name or 'the top level'} holds itself (a container inside itself): not a "
                              "file of latents")
        if id(o) in seen:
            continue
        if depth >= MAX_NESTING:
            raise LatentError(f"{where}: nested more than {MAX_NESTING} levels deep at {name or 'the top level'}")
        seen.add(id(o))
        items = o.items() if isinstance(o, dict) else enumerate(o)
        inner = ancestors + (id(o),)
        stack.extend(reversed([(v, f"{name}.{k}" if name else str(k), depth + 1, inner) for k, v in items]))


def as_float(t: torch.Tensor, where: str) -> torch.Tensor:
    """t as float32 (float8 latents, float64...); a dtype torch cannot convert (float4's packed pairs) is an input
    error naming the file, not a crash."""
    try:
        return t.float()
    except (RuntimeError, NotImplementedError, TypeError) as e:
        why = (str(e).splitlines() or [type(e).__name__])[0][:80]
        raise LatentError(f"{where}: latents of dtype {str(t.dtype).replace('torch.', '')} cannot be decoded (torch "
                          f"does not convert them to float32: {why}); save them as float32, bfloat16 or float16"
                          ) from None


def _text_file(head: bytes) -> str | None:
    """What to call a file whose first bytes are printable UTF-8 text ("a text file, ..."), else None."""
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as e:  # a character cut by the 32 bytes read is still text
        if e.start < len(head) - 3:
            return None
        text = head[:e.start].decode("utf-8")
    if not text.strip() or not all(c.isprintable() or c in "\t\r\n" for c in text):
        return None
    return f"a text file, not a tensor file (it starts {text.split(chr(10))[0][:24]!r})"


def _what_file(path: Path) -> str | None:
    """What a file's first bytes say it is ("a PNG image", "a text file, ..."), or None."""
    with open(path, "rb") as fh:
        head = fh.read(32)
    what = magic_name(head)
    return _text_file(head) if what == "unrecognised file header" else what


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f}".removesuffix(".0") + f" {unit}"
    return f"{n} bytes"


def _check_zip_inflation(path: Path, infos: list, torch_file: bool) -> None:
    """Refuse a zip whose members would unpack to far more than the file holds (MAX_INFLATION), from its directory,
    before anything is unpacked. torch_file: a torch.save zip, whose tensor data (<archive>/data/<n>) torch.save
    always stores uncompressed: compressed tensor data is refused at any size."""
    packed = [i for i in infos if i.compress_type != zipfile.ZIP_STORED]
    data = [i for i in packed if i.filename.split("/")[-2:-1] == ["data"]] if torch_file else []
    if data:
        i = max(data, key=lambda i: i.file_size)
        raise LatentError(f"{path}: its tensor data is stored compressed ({i.filename}: {_size(i.file_size)} packed "
                          f"into {_size(i.compress_size)}), which torch.save never writes: refused before unpacking "
                          "(a zip bomb?); save the latents again with torch.save or safetensors")
    total = sum(i.file_size for i in infos)
    held = path.stat().st_size
    if total - held > MAX_INFLATION:
        raise LatentError(f"{path}: its members unpack to {_size(total)} from a {_size(held)} file, more than vaeopt "
                          f"unpacks from a latent file ({_size(MAX_INFLATION)} beyond its size): refused before "
                          "unpacking (a zip bomb?)")


def _unreadable_npy(where: str, e: BaseException) -> LatentError:
    return LatentError(f"{where}: not a readable .npy file ({(str(e).splitlines() or [type(e).__name__])[0][:120]})")


def _read_npy(fh, where: str, size: int) -> torch.Tensor | str:
    """One .npy array from the open binary stream fh (a file, or a member of an .npz) of `size` bytes, as a tensor
    (float16/32/64 kept, other floats as float32, native byte order). Never unpickles. A non-float array returns
    the message that says so (an .npz may hold a seed beside its latents); unreadable ones raise LatentError."""
    import numpy as np

    try:
        version = np.lib.format.read_magic(fh)
        shape, _, dtype = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)(fh)
    except (zlib.error, lzma.LZMAError):
        raise  # a damaged .npz stream: the member loop names it
    except Exception as e:  # noqa: BLE001  numpy parses the header as Python text (tokenize: TokenError, SyntaxError)
        if isinstance(e, MemoryError):
            raise
        raise _unreadable_npy(where, e) from e
    if dtype.hasobject:
        raise LatentError(f"{where}: refusing a pickled .npy of Python objects (allow_pickle=False)")
    if dtype.kind != "f":
        return f"{where}: latents must be real floating point, got numpy dtype {dtype}"
    if math.prod(shape) * dtype.itemsize > size:
        raise LatentError(f"{where}: header declares {tuple(shape)} {dtype}, more than the file holds: truncated or "
                          "corrupt")
    f = _MIN_SPATIAL_FACTOR
    if len(shape) >= 4 and shape[-2] * shape[-1] * f * f > MAX_OUTPUT_PIXELS:  # (3-D: packed FLUX is (B, seq, 64))
        h, w = shape[-2:]
        raise LatentError(f"{where}: header declares {tuple(shape)} {dtype}: latent {h}x{w} would decode to at least "
                          f"{h * f}x{w * f} pixels per frame — beyond what vaeopt decodes "
                          f"({int(math.sqrt(MAX_OUTPUT_PIXELS))}² max); refused before reading its data")
    try:
        fh.seek(0)
        arr = np.lib.format.read_array(fh, allow_pickle=False)
    except (zlib.error, lzma.LZMAError):
        raise
    except (ValueError, OSError, EOFError, TypeError) as e:
        raise _unreadable_npy(where, e) from e
    native = arr.dtype.newbyteorder("=")  # big-endian files: torch takes native byte order only
    keep = native in (np.dtype("float16"), np.dtype("float32"), np.dtype("float64"))  # shown as stored
    return torch.from_numpy(np.ascontiguousarray(arr.astype(native if keep else "float32", copy=False)))


def read_latents(path: str | Path, key: str | None = None, manifest_needed: bool = True,
                 max_tensors: int | None = DEFAULT_MAX_OUTPUTS) -> LatentFile:
    """manifest_needed=False: the caller has the model and latent space from elsewhere (both given on the command
    line), so a vaeopt.json beside the file is not read at all (a broken one cannot stop the run).
    max_tensors: the most tensors the file may hold (each reference counted: a list of one tensor 20,000 times is
    20,000 decodes); None for no bound. Without --key only: with it, one tensor is decoded."""
    path = Path(path)
    if not path.exists():
        raise LatentError(f"{path}: " + ("a broken or looping symlink" if path.is_symlink() else "no such file"))
    if path.is_dir():
        raise LatentError(f"{path}: is a directory, expected a latent file ({', '.join(LATENT_SUFFIXES)})")
    if not path.is_file():  # a FIFO, a device
        raise LatentError(f"{path}: not a regular file")
    if path.stat().st_size == 0:
        raise LatentError(f"{path}: file is empty")
    suffix = path.suffix.lower()
    notes: list[str] = []
    if suffix in (".pt", ".pth", ".ckpt", ".bin", ".safetensors", ".latent"):
        with contextlib.suppress(Exception):  # whatever the bytes are, the reader of the suffix says it below
            kind = sniff(path)
            if kind == "safetensors" and suffix not in (".safetensors", ".latent"):
                notes.append(f"a safetensors file despite its '{path.suffix}' suffix: read as safetensors")
                suffix = ".safetensors"
            elif kind == "torch-zip" and suffix in (".safetensors", ".latent"):
                notes.append(f"a torch.save file despite its '{suffix}' suffix: read as one (weights_only)")
                suffix = ".pt"
    entries: list[LatentEntry] = []
    default_space = "scaled"
    space_meta = False  # the file's own metadata names its latent space
    file_meta: dict = {}
    if suffix in (".pt", ".pth", ".ckpt", ".bin"):
        fmt = "pt"
        infos = []
        with open(path, "rb") as fh:
            is_zip = fh.read(4) == b"PK\x03\x04"  # as torch.load tells its zip format from the legacy one
        if is_zip:
            with contextlib.suppress(zipfile.BadZipFile, OSError, ValueError), zipfile.ZipFile(path) as zf:
                infos = zf.infolist()  # (a broken zip: torch.load says so below)
        _check_zip_inflation(path, infos, torch_file=True)  # torch.load would unpack it all first
        try:  # numpy scalars (e.g. a saved seed) are data: allowed, as in checkpoints
            with warnings.catch_warnings(), allow_numpy_scalars():
                warnings.simplefilter("ignore")  # torch's pickle-protocol warning would print before our error
                with open(path, "rb") as fh:  # a file object: torch 2.13 routes a *.safetensors path elsewhere
                    obj = torch.load(fh, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            msg = str(e)
            code = any(k in msg for k in ("GLOBAL", "Unsupported global", "Unsupported class"))
            with open(path, "rb") as fh:
                raw_pickle = fh.read(1) == b"\x80"  # a bare pickle stream, not torch's zip container
            if not code and not raw_pickle:  # garbage, not code: say what the bytes are, not torch's boilerplate
                raise LatentError(f"{path}: not a readable torch file ({_what_file(path) or 'corrupt or truncated?'})"
                                  ) from e
            name = refused_global(e)
            if name is None:
                line = next((ln.strip() for ln in msg.splitlines() if "GLOBAL" in ln or "nsupported" in ln), "")
                what = line.split(". ")[0] or "objects other than tensors"
            else:
                what = f"it refers to {name}"
            if name and name.startswith("diffusers."):  # e.g. a pipeline's StableDiffusionPipelineOutput
                advice = ("a diffusers output object: save the tensor itself, e.g. torch.save(out.images, path) for a "
                          "pipeline called with output_type=\"latent\" (out.frames for video pipelines)")
            elif raw_pickle and name is None:  # a bare pickle stream: pickle.dump, not torch.save
                raise LatentError(
                    f"{path}: a plain pickle stream (pickle.dump), not a torch.save file: vaeopt does not unpickle "
                    "(even tensors come through pickle's code paths there); where you trust the file, load it and "
                    "save the tensors with torch.save or safetensors") from e
            else:
                advice = "save the latents as a tensor or a dict of tensors"
            raise LatentError(
                f"{path}: refusing to unpickle arbitrary objects (loaded with weights_only=True): {what}, which is "
                f"not a tensor; {advice}"
            ) from e
        except MemoryError:
            raise
        except Exception as e:  # noqa: BLE001  (torch's legacy reader raises KeyError on text, and more)
            what = _what_file(path)
            first = (str(e).splitlines()[0].split(". ")[0][:160] if str(e) else type(e).__name__)  # one sentence
            if isinstance(e, (KeyError, IndexError)):  # "101", "pop from empty list": torch's internals, no reason
                first = ""
            raise LatentError(f"{path}: not a readable torch file: " + (
                what or ("corrupt or truncated?" + (f" ({first})" if first else "")))) from e
        _collect(obj, "", entries, str(path))
        if isinstance(obj, dict) and isinstance(obj.get("samples"), torch.Tensor) and obj["samples"].ndim >= 4:
            # a ComfyUI LATENT dict saved with torch.save: {"samples": raw VAE latents, "noise_mask", "batch_index"}
            fmt = "comfyui-dict"
            default_space = "raw"
            others = [e.name for e in entries if e.name != "samples"]
            if key is None:
                entries = [e for e in entries if e.name == "samples"]
            notes.append("a ComfyUI LATENT dict ('samples'): raw VAE latents, as ComfyUI keeps them (--latent-space "
                         "scaled if these were scaled)" + (f"; not decoded: {', '.join(others)}"
                                                         if others and key is None else ""))
    elif suffix in (".safetensors", ".latent"):
        from safetensors import SafetensorError, safe_open

        with open(path, "rb") as fh:
            head = fh.read(32)
        problem = safetensors_header_problem(path, head, path.stat().st_size) if head[8:9] == b"{" else (
            f"corrupt or truncated safetensors file (no safetensors header: {magic_name(head)})")
        if problem:  # in the words the checkpoint reader uses for the same fault
            raise LatentError(f"{path}: {problem}")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise LatentError(f"{path}: corrupt or truncated safetensors file ({str(e)[:160]})") from e
        if "latent_tensor" in tensors:  # ComfyUI SaveLatent format
            fmt = "comfyui-latent"
            default_space = "raw"
            t = tensors["latent_tensor"]
            if "latent_format_version_0" not in tensors:
                t = as_float(t, str(path)) / _COMFY_LEGACY_SCALE
                notes.append("legacy ComfyUI latent (no version marker): divided by 0.18215 as ComfyUI does")
            entries.append(LatentEntry("latent_tensor", t))
        else:
            fmt = "safetensors"
            file_meta = meta
            space_meta = meta.get("latent_space") in ("raw", "scaled")
            if space_meta:
                default_space = meta["latent_space"]
            entries = [LatentEntry(k, v) for k, v in tensors.items()]  # (an empty one is said, as in a .pt dict)
    elif suffix == ".npy":
        fmt = "npy"
        with open(path, "rb") as fh:
            t = _read_npy(fh, str(path), path.stat().st_size)
        if isinstance(t, str):
            raise LatentError(t)
        entries.append(LatentEntry("", t))
    elif suffix == ".npz":  # numpy.savez(_compressed): a zip of .npy members, read one by one without pickles
        fmt = "npz"
        try:
            zf = zipfile.ZipFile(path)
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            raise LatentError(f"{path}: not a readable .npz file (corrupt or truncated? {str(e)[:120]})") from e
        skipped = []
        with zf:
            _check_zip_inflation(path, zf.infolist(), torch_file=False)
            for info in zf.infolist():
                name = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
                try:
                    with zf.open(info) as fh:
                        t = _read_npy(fh, f"{path} [{name}]", info.file_size)
                except (zipfile.BadZipFile, OSError, EOFError, ValueError, zlib.error, lzma.LZMAError) as e:
                    raise LatentError(f"{path} [{name}]: corrupt member of the .npz file ({str(e)[:120]})") from e
                except NotImplementedError:  # a compression method zipfile does not know
                    raise LatentError(f"{path} [{name}]: stored with a compression method (#{info.compress_type}) "
                                      "that numpy.savez never uses and Python cannot unpack") from None
                except RuntimeError as e:  # zipfile: "File ... is encrypted, password required for extraction"
                    if "encrypted" not in str(e):
                        raise
                    raise LatentError(f"{path} [{name}]: an encrypted member of the .npz file; vaeopt reads "
                                      "numpy.savez files, which are never encrypted") from None
                if isinstance(t, str):  # not floating point (e.g. a saved seed or index array)
                    skipped.append((name, t))
                else:
                    entries.append(LatentEntry(name, t))
        if skipped and not entries:
            raise LatentError(skipped[0][1])
        if skipped:
            notes.append("skipped non-float arrays: " + ", ".join(n for n, _ in skipped[:4])
                         + (", ..." if len(skipped) > 4 else ""))
    else:
        raise LatentError(f"{path}: unknown latent format '{suffix}' (expected {', '.join(LATENT_SUFFIXES)})")

    if not entries:
        raise LatentError(f"{path}: contains no tensors")
    if key is None and max_tensors is not None and len(entries) > max_tensors:
        distinct = len({id(e.tensor) for e in entries})
        raise LatentError(f"{path}: holds {len(entries)} tensors" + (f" ({distinct} distinct, the others repeats of "
                          "them)" if distinct < len(entries) else "") + f", more than the {max_tensors} one input file "
                          "may hold (--max-outputs, a guard against files that ask for unbounded work): pass "
                          f"--max-outputs {len(entries)} to allow it, or --key NAME to decode one of them")
    for e in entries:  # latents saved as an nn.Parameter (or with requires_grad): data here, no autograd warnings
        if e.tensor.requires_grad or type(e.tensor) is not torch.Tensor:
            e.tensor = e.tensor.detach().as_subclass(torch.Tensor)
    params = [e.name for e in entries if e.name.rsplit(".", 1)[-1] in ("weight", "bias")]
    if key is None and len(params) >= 4 and 2 * len(params) >= len(entries):
        raise LatentError(f"{path}: holds model weights ({len(entries)} tensors such as {params[0]}, {params[1]}), "
                          "not latents: a VAE checkpoint goes to --model")
    small = [e for e in entries if e.tensor.ndim < 3]
    if key is None and small and len(small) < len(entries):
        # e.g. a saved ComfyUI LATENT dict ({"samples": ..., plus masks / indices}): decode what can be latents
        notes.append(f"skipped {len(small)} tensor(s) with fewer than 3 dims, which cannot be latents: "
                     + ", ".join(f"{e.name or '<tensor>'} {tuple(e.tensor.shape)}" for e in small[:4])
                     + (", ..." if len(small) > 4 else ""))
        entries = [e for e in entries if e.tensor.ndim >= 3]
    all_entries = None
    if key is not None:
        picked = [e for e in entries if e.name == key]
        if not picked and len(entries) == 1 and not entries[0].name:
            raise LatentError(f"{path}: holds one tensor with no name (not a dict of tensors), so --key {key} has "
                              "nothing to pick: leave --key out")
        if not picked:
            names = [e.name or "<tensor>" for e in entries]
            raise LatentError(f"{path}: no tensor named '{key}'; found: {', '.join(names[:8])}"
                              + (f", ... ({len(names)} in all)" if len(names) > 8 else ""))
        all_entries = entries
        entries = picked
    manifest = read_manifest(path) if manifest_needed else {}  # not needed: not read (nor able to fail the run)
    size = _packed_size(file_meta, manifest, path)
    if size is not None:
        for e in entries + (all_entries or []):
            e.size = size
    if manifest.get("latent_space") in ("raw", "scaled"):
        default_space = manifest["latent_space"]
    elif manifest.get("folder_latent_space") in ("raw", "scaled") and fmt in ("pt", "npy", "npz", "safetensors") \
            and not space_meta:  # the folder's default: not over a ComfyUI format's or the file's own metadata
        default_space = manifest["folder_latent_space"]
    if suffix == ".latent" and fmt == "safetensors":  # a .latent that is not ComfyUI's: say what was read instead
        used = ", ".join(f"'{e.name}'" for e in entries[:4]) + (", ..." if len(entries) > 4 else "")
        notes.append(f"no 'latent_tensor' key, which ComfyUI's .latent files hold: read as plain safetensors "
                     f"(key{'s' if len(entries) > 1 else ''} {used}), " + (
                         "whose latents default to scaled, not raw as ComfyUI's (--latent-space raw if these are raw)"
                         if default_space == "scaled" else "raw latents as its metadata or vaeopt.json says"))
    return LatentFile(path, fmt, entries, default_space, notes, manifest, all_entries)


class NotALatent(LatentError):
    """A tensor whose rank or channel count cannot be a latent for this VAE, with no hint of a fixable layout (e.g.
    prompt embeddings saved beside the latents). reason: the short why."""

    def __init__(self, msg: str, reason: str):
        super().__init__(msg)
        self.reason = reason


_SPARSE = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def validate(entry: LatentEntry, family: FamilySpec, source: Path, values: bool = True) -> torch.Tensor:
    """Shape/dtype/finite checks with one-line errors; returns the tensor as (N,C,H,W) or (N,C,T,H,W).
    values=False: dtype and shape only (is this tensor a latent for this VAE at all?)."""
    t = entry.tensor
    where = f"{source}" + (f" [{entry.name}]" if entry.name else "")
    if t.device.type == "meta":
        raise LatentError(f"{where}: a tensor on the meta device: it has a shape {tuple(t.shape)} but no values to "
                          "decode (saved from a model built with device='meta'?)")
    if t.layout != torch.strided:
        if t.layout not in _SPARSE:
            raise LatentError(f"{where}: latents must be a dense tensor, got layout {t.layout}")
        t = t.to_dense()  # sparse latents (rare, but a valid tensor): decode their values
    if not torch.is_floating_point(t):
        raise LatentError(f"{where}: latents must be floating point, got {t.dtype}")
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        t = as_float(t, where)  # e.g. float8 latents: upcast (and so isfinite works)
    want = 5 if family.is_video else 4
    kind = "(N,C,T,H,W) video" if family.is_video else "(N,C,H,W) image"
    cin = family.latent_channels
    unbatched = None
    packed = t.shape[-1:] == (4 * cin,) and (t.ndim == 2 or (t.ndim == 3 and (
        t.shape[0] != cin or t.shape[1] >= 16 * t.shape[2])))  # a batch of 16: no real (C, H, W) latent is 16:1
    if packed and (family.name in PACKED_FAMILIES or (family.name == "flux" and entry.size is not None)):
        t = unpack_tokens(t, family, entry.size, where)
        packed = False
    if family.name == "flux2" and t.ndim == 4 and t.shape[1] == 4 * cin:
        # FLUX.2's patchified (N, 128, H/16, W/16) latents, as its transformer and ComfyUI hold them: to_raw
        # unpatchifies them (after the BatchNorm de-normalization for pipeline latents)
        if t.numel() == 0:
            raise LatentError(f"{where}: empty latent tensor {tuple(t.shape)}")
        if values:
            _refuse_nonfinite(t, where, tuple(entry.tensor.shape))
        return t
    if family.name == "flux" and packed:
        # (B, (H/16)*(W/16), 64): 2x2 patches of the 16 channels. The sequence does not say H and W (a square count
        # can come from a non-square image: 1152x512 packs to 48*48), so unpacking without the size would be a guess
        raise LatentError(
            f"{where}: shape {tuple(t.shape)} looks like packed FLUX latents (batch, sequence, {4 * cin}), as "
            f"FluxPipeline(output_type=\"latent\") returns them; the image size is not stored in them: pass --height "
            f"and --width (the image's pixels), or unpack with pipe._unpack_latents(latents, height, width, "
            f"pipe.vae_scale_factor) and save that (B, {cin}, H/8, W/8) tensor"
        )
    if family.is_video and t.ndim == 4:
        # (C,T,H,W) one clip, or (N,C,H,W) single latent frames
        if t.shape[0] == t.shape[1] == cin:
            n = t.shape[0]
            raise LatentError(
                f"{where}: shape {tuple(t.shape)} reads two ways for {family.title}: one clip of {n} latent frames "
                f"(C,T,H,W), or {n} one-frame latents (N,C,H,W); save it 5-D, as (1, {cin}, {n}, H, W) or "
                f"({n}, {cin}, 1, H, W)")
        t = t.unsqueeze(0) if t.shape[0] == cin else t.unsqueeze(2)
    elif t.ndim == want - 1:
        unbatched = tuple(t.shape)  # (C,H,W): its first dim is counted as channels below
        t = t.unsqueeze(0)
    elif not family.is_video and t.ndim == 5 and t.shape[1] == cin and t.shape[2] == 1:
        t = t.squeeze(2)  # (N, C, 1, H, W): one frame, as video-style pipelines hand out image latents
    if t.ndim != want:
        if not family.is_video and t.ndim == 5 and t.shape[1] == cin:
            raise LatentError(f"{where}: shape {tuple(t.shape)} is {t.shape[2]} latent frames (N,C,T,H,W), but "
                              f"{family.title} is an image VAE: pass one frame, or a video VAE with --model")
        raise NotALatent(f"{where}: shape {tuple(t.shape)} does not fit {family.title}: expected {kind} latents",
                         f"{t.ndim} dims")
    c = t.shape[1]
    if c != cin:
        hint = ""
        if t.shape[-1] == cin and cin < min(t.shape[1:-1]):  # (N,H,W,C): C smaller than every other dim
            hint = " (channels look last: save latents channels-first)"
        elif family.is_video and t.shape[2] == cin:
            hint = " (looks like (N,T,C,H,W): save video latents as (N,C,T,H,W))"
        if unbatched and not hint and not 4 <= c <= 128:
            # e.g. prompt embeddings (1, 77, 768): not "1 channel", no latent shape at all (no VAE has fewer than 4
            # or more than 128 latent channels; a (16, H, W) FLUX latent for SDXL keeps the channel message)
            one = "(C,T,H,W)" if family.is_video else "(C,H,W)"
            raise NotALatent(f"{where}: shape {unbatched} does not fit {family.title}: expected {kind} latents, or "
                             f"one {one} latent with {cin} channels (read so, it would have {c})",
                             f"{len(unbatched)} dims, not a {cin}-channel {one} latent")
        msg = f"{where}: {c} latent channels, but the {family.title} VAE takes {cin}{hint}"
        raise LatentError(msg) if hint else NotALatent(msg, f"{c} channel{'s' if c != 1 else ''}, not {cin}")
    if t.numel() == 0 or min(t.shape) == 0:
        raise LatentError(f"{where}: empty latent tensor {tuple(t.shape)}")
    h, w = t.shape[-2:]
    f = family.spatial_factor
    if h * w * f * f > MAX_OUTPUT_PIXELS:
        raise LatentError(
            f"{where}: latent {h}x{w} would decode to {h * f}x{w * f} pixels per frame — beyond what vaeopt decodes "
            f"({int(math.sqrt(MAX_OUTPUT_PIXELS))}² max)"
        )
    if values:
        _refuse_nonfinite(t, where, tuple(entry.tensor.shape))
    return t


def _refuse_nonfinite(t: torch.Tensor, where: str, shape: tuple) -> None:
    """NaN/Inf in latents: how many, in the tensor as the file holds it (`shape`), so that the line is the same
    whether it comes before the VAE is known (check_values) or after (validate)."""
    bad = (~torch.isfinite(t)).sum().item()
    if bad:
        nans = torch.isnan(t).sum().item()
        raise LatentError(f"{where}: {bad} non-finite value{'s' if bad > 1 else ''} ({nans} NaN, {bad - nans} Inf) in "
                          f"{shape} latents")


def check_values(entry: LatentEntry, source: Path) -> None:
    """validate's NaN/Inf check on its own: it needs no VAE, so `vaeopt decode` makes it before the model loads
    (seconds); so are its refusals that need no VAE either (meta, integer, not dense, empty), in its words."""
    t = entry.tensor
    where = f"{source}" + (f" [{entry.name}]" if entry.name else "")
    if t.device.type == "meta":
        raise LatentError(f"{where}: a tensor on the meta device: it has a shape {tuple(t.shape)} but no values to "
                          "decode (saved from a model built with device='meta'?)")
    if t.layout not in (torch.strided, *_SPARSE):
        raise LatentError(f"{where}: latents must be a dense tensor, got layout {t.layout}")
    if not torch.is_floating_point(t):
        raise LatentError(f"{where}: latents must be floating point, got {t.dtype}")
    if t.numel() == 0:
        raise LatentError(f"{where}: empty latent tensor {tuple(t.shape)}")
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        t = as_float(t, where)
    _refuse_nonfinite(t, where, tuple(entry.tensor.shape))


def _tiny_from_raw(latents: torch.Tensor, family: FamilySpec) -> torch.Tensor:
    """A tiny decoder (TAESD) takes latents as the pipeline hands them to the UNet/transformer. Raw latents (a
    ComfyUI .latent, {"samples": ...}) are the big VAE's (config "_raw_latents": {"vae": family}): scale them as
    that VAE's pipeline would, as ComfyUI's TAESD does ((raw - shift_factor) * scaling_factor)."""
    base = family.config.get("_raw_latents")
    if not base:
        raise LatentError(
            f"raw latents for a {family.latent_channels}-channel tiny decoder: which VAE's latents they are (TAESD3: "
            "SD3's, TAEF1: FLUX's) decides their scaling, and nothing here tells; name the decoder file taesd3*/taef1*,"
            " or pass pipeline latents with --latent-space scaled")
    return get_family(base["vae"]).scale(latents)


def _spread(x: float) -> str:
    return f"{x:.2f}" if x < 1e4 else f"{x:.3g}"  # (1e+30, not 31 digits)


def space_hint(latents: torch.Tensor, family: FamilySpec, space: str) -> str | None:
    """A warning when the numbers look like the other latent space, else None. Pipeline ("scaled") latents have a
    standard deviation near 1; raw ones differ from that by the family's scaling (about 5.5 for SD 1.x). Read both
    ways, the one whose spread is nearer 1 is the likelier; nothing is said when the two readings are within 2x of
    each other (a family whose scaling is near 1) or for tiny decoders (their raw latents are another VAE's)."""
    if family.cls_name == "AutoencoderTiny" or latents.numel() < 64 or not latents.is_floating_point():
        return None
    try:
        as_scaled = float(latents.float().std())
        as_raw = float(family.scale(latents).std())  # their spread as pipeline latents if they are raw
    except (RuntimeError, ValueError):  # channels that do not fit the family: validation says so
        return None
    if not (math.isfinite(as_scaled) and math.isfinite(as_raw) and as_scaled > 0 and as_raw > 0):
        return None
    if 0.5 < as_scaled / as_raw < 2:
        return None
    nearer_raw = abs(math.log(as_raw)) < abs(math.log(as_scaled))
    neither = (f"their spread (std {_spread(as_scaled)}) fits neither of {family.title}'s latent spaces (pipeline "
               f"latents have std near 1, raw ones near {_spread(as_scaled / as_raw)}): check that these are "
               f"{family.title} latents, as they were saved")
    if space == "scaled" and nearer_raw and as_scaled > 2:
        if not 0.5 <= as_raw <= 2:
            return neither
        return (f"these latents look raw (std {_spread(as_scaled)}; pipeline latents have std near 1, raw {family.title} "
                "latents are scaled up by its factor): if they came from vae.encode or a non-pipeline tool, pass "
                "--latent-space raw")
    if space == "raw" and not nearer_raw and as_raw < 0.5:
        if not 0.5 <= as_scaled <= 2:
            return neither
        return (f"these latents look like pipeline (scaled) latents (std {_spread(as_scaled)}, near 1): if a diffusers "
                "pipeline saved them (output_type='latent'), pass --latent-space scaled")
    return None


def to_raw(latents: torch.Tensor, family: FamilySpec, space: str) -> torch.Tensor:
    """Latents in the given space -> raw decoder latents (float32)."""
    if space == "raw":
        if family.name == "flux2" and latents.ndim == 4 and latents.shape[1] == 4 * family.latent_channels:
            # 128-channel FLUX.2 latents are the normalized ones wherever they come from: BFL's AutoEncoder.decode
            # and ComfyUI (whose .latent files hold them) de-normalize them inside the VAE, as the pipeline does
            return family.unscale(latents)
        if family.cls_name == "AutoencoderTiny":  # TAESD decodes pipeline latents: raw = the big VAE's raw latents
            return _tiny_from_raw(latents, family)
        return latents.float()
    if space == "scaled":
        if family.name == "flux2" and latents.ndim == 4 and (latents.shape[-2] % 2 or latents.shape[-1] % 2) \
                and latents.shape[1] == family.latent_channels:
            raise LatentError(f"{tuple(latents.shape)}: FLUX.2 pipeline latents are normalized in 2x2 patches, so "
                              "their height and width are even; odd ones are raw latents (--latent-space raw)")
        return family.unscale(latents)
    raise LatentError(f"latent space must be 'scaled' or 'raw', got '{space}'")


def save_latents(path: str | Path, tensors: dict[str, torch.Tensor], latent_space: str) -> None:
    """Write latents as .safetensors with their latent space recorded in the metadata (atomically)."""
    from safetensors.torch import save_file

    with atomic_path(Path(path)) as tmp:
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata={"latent_space": latent_space})


# ----------------------------------------------------------------------------------------------------------------------
# Packed token sequences: FLUX.2 (N, (H/16)*(W/16), 128) and Qwen-Image (N, (H/16)*(W/16), 64), as their pipelines
# return them with output_type="latent" where they do not unpack them first
# ----------------------------------------------------------------------------------------------------------------------

PACKED_FAMILIES = ("flux2", "qwenimage")


def _packed_size(meta: dict, manifest: dict, path) -> tuple[int, int] | None:
    """(height, width) from the file's metadata or vaeopt.json ("height", "width": the image size in pixels)."""
    for src in (meta or {}), (manifest or {}):
        if "height" in src or "width" in src:
            try:
                h, w = int(src["height"]), int(src["width"])
            except (KeyError, TypeError, ValueError):
                raise LatentError(f"{path}: 'height' and 'width' must both be given, as whole numbers of pixels "
                                  f"(got {src.get('height')!r}, {src.get('width')!r})") from None
            if h <= 0 or w <= 0:
                raise LatentError(f"{path}: height and width must be positive, got {h}x{w}")
            return h, w
    return None


def unpack_tokens(t: torch.Tensor, family: FamilySpec, size: tuple[int, int] | None, where: str) -> torch.Tensor:
    """FLUX.2: (N, h*w, 128) -> (N, 128, h, w), the tokens in row-major order, as Flux2Pipeline's
    _unpack_latents_with_ids scatters them with the ids of _prepare_latent_ids; Qwen-Image: (N, h*w, 64) ->
    (N, 16, 1, 2h, 2w), as QwenImagePipeline._unpack_latents; FLUX.1: (N, h*w, 64) -> (N, 16, 2h, 2w), as
    FluxPipeline._unpack_latents (the same 2x2 patches, no frame axis). h, w = height // 16, width // 16."""
    if t.ndim == 2:
        t = t.unsqueeze(0)
    n, seq, d = t.shape
    if size is None:
        raise LatentError(
            f"{where}: shape {tuple(t.shape)} is packed {family.title} latents (batch, sequence, {d}), as its pipeline "
            "returns them; the image size is not stored in them: pass --height and --width (the image's pixels), "
            "or give the file \"height\"/\"width\" metadata")
    h, w = size[0] // 16, size[1] // 16
    if h * w != seq:
        raise LatentError(f"{where}: {seq} packed tokens do not fit a {size[0]}x{size[1]} image ({h}x{w} = {h * w} "
                          "tokens of 2x2 latent patches): check --height/--width")
    if family.name == "flux2":
        return t.reshape(n, h, w, d).permute(0, 3, 1, 2).contiguous()
    c = d // 4
    frames = () if family.name == "flux" else (1,)
    return t.reshape(n, h, w, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(n, c, *frames, 2 * h, 2 * w)
