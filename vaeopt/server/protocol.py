"""The wire protocol of diffusers' remote VAE client (`diffusers.utils.remote_utils.remote_decode`), both ways
(docs/serve.md, "Protocol"): a POST of the latents' raw bytes with every parameter in the query string; answers as
the client parses them (an image file, tensor bytes with `shape` / `dtype` headers, an MP4); errors as non-2xx
answers with a JSON body {"error": "...", "status": N}.

Everything here is pure (no sockets, no state; prepare() runs on whatever device holds its tensor): the HTTP
layer and the worker call it, and tests can too.
"""

from __future__ import annotations

import io
import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from vaeopt import outputs
from vaeopt.families import FamilySpec
from vaeopt.latents import LatentEntry, validate
from vaeopt.server import png

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
OUTPUT_TYPES = ("pil", "pt", "mp4")
IMAGE_FORMATS = ("jpg", "png")
_KNOWN = {"shape", "dtype", "output_type", "image_format", "partial_postprocess", "scaling_factor", "shift_factor",
          "do_scaling", "height", "width", "fps"}
MAX_DIM = 1 << 20  # no latent dimension comes near it; larger ones are refused before any arithmetic on them


class ProtocolError(Exception):
    """A request the server refuses: its HTTP status and a message meant for the client's user."""

    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


@dataclass
class Limits:
    max_body_bytes: int = 256 * 2**20  # the latents of a 720p, 81-frame Wan clip are 19 MB in float32
    max_output_pixels: int = 128 * 2**20  # per request, all frames of all images (1.5 GB as float32 RGB)


@dataclass
class DecodeRequest:
    shape: tuple[int, ...]  # as sent
    dtype: torch.dtype
    output_type: str
    image_format: str
    partial_postprocess: bool
    tensor_reply: bool  # output_type=pil with Accept: tensor/binary (a processor on the client side)
    scaling_factor: float | None
    shift_factor: float | None
    model_scaling: bool  # do_scaling without factors: the model's own latent scaling
    height: int | None
    width: int | None
    fps: float

    @property
    def body_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _flag(name: str, v: str) -> bool:
    s = v.strip().lower()
    if s in ("true", "1", "yes"):
        return True
    if s in ("false", "0", "no", "none", ""):
        return False
    raise ProtocolError(400, f"{name}={v!r}: expected True or False")


def _number(name: str, v: str, kind=float):
    try:
        x = kind(v)
    except ValueError:
        raise ProtocolError(400, f"{name}={v!r}: expected a {'whole ' if kind is int else ''}number") from None
    if kind is float and not math.isfinite(x):
        raise ProtocolError(400, f"{name}={v!r}: must be finite")
    return x


def parse_request(params: list[tuple[str, str]], accept: str, content_type: str, family: FamilySpec,
                  limits: Limits) -> DecodeRequest:
    """The query string and headers -> a checked DecodeRequest, before any of the body is read: a declared shape
    that is absurd, too large for the limits, or not this model's latents is refused without allocating for it."""
    one: dict[str, str] = {}
    shape_s: list[str] = []
    for k, v in params:
        if k == "shape":
            shape_s.append(v)
        elif k in one:
            raise ProtocolError(400, f"query parameter {k!r} given twice")
        else:
            one[k] = v
    unknown = sorted(set(one) - _KNOWN)
    if unknown:
        raise ProtocolError(400, f"unknown query parameter(s) {', '.join(unknown)} (known: {', '.join(sorted(_KNOWN))})")
    ct = content_type.split(";")[0].strip().lower()
    if ct not in ("tensor/binary", "application/octet-stream"):
        raise ProtocolError(415, f"Content-Type {content_type or '(none)'!r}: send the latents' raw bytes as "
                                 "tensor/binary (as diffusers' remote_decode does)")
    if len(shape_s) == 1 and shape_s[0].startswith("["):  # shape=[1,4,128,128] from a hand-written client
        try:
            shape_s = [str(x) for x in json.loads(shape_s[0])]
        except ValueError:
            raise ProtocolError(400, f"shape={shape_s[0]!r}: expected integers") from None
    if not shape_s:
        raise ProtocolError(400, "no shape: give one shape= parameter per dimension (shape=1&shape=4&shape=128&...)")
    if not 2 <= len(shape_s) <= 5:
        raise ProtocolError(422, f"shape {shape_s}: latents have 3 (packed), 4 (image) or 5 (video) dimensions")
    shape = tuple(_number("shape", s, int) for s in shape_s)
    if any(d < 1 or d > MAX_DIM for d in shape):
        raise ProtocolError(422, f"shape {list(shape)}: every dimension must be between 1 and {MAX_DIM}")
    for k, default, allowed, want in (("dtype", "float32", DTYPES, "send float16, bfloat16 or float32 latents"),
                                      ("output_type", "pil", OUTPUT_TYPES, "expected pil, pt or mp4"),
                                      ("image_format", "jpg", IMAGE_FORMATS, "expected jpg or png")):
        if one.setdefault(k, default) not in allowed:
            raise ProtocolError(422, f"{k} {one[k]!r}: {want}")
    dname, output_type, image_format = one["dtype"], one["output_type"], one["image_format"]
    dtype = DTYPES[dname]
    partial = _flag("partial_postprocess", one.get("partial_postprocess", "False"))
    scaling = _number("scaling_factor", one["scaling_factor"]) if "scaling_factor" in one else None
    if scaling is not None and scaling == 0:
        raise ProtocolError(422, "scaling_factor=0: latents are divided by it")
    shift = _number("shift_factor", one["shift_factor"]) if "shift_factor" in one else None
    model_scaling = scaling is None and shift is None and _flag("do_scaling", one.get("do_scaling", "False"))
    height = _number("height", one["height"], int) if "height" in one else None
    width = _number("width", one["width"], int) if "width" in one else None
    if (height is None) != (width is None):
        raise ProtocolError(422, "give both height and width (the image size of packed latents), or neither")
    if height is not None and not (1 <= height <= MAX_DIM and 1 <= width <= MAX_DIM):
        raise ProtocolError(422, f"height {height}, width {width}: out of range")
    fps = _number("fps", one.get("fps", "16"))
    if not 0 < fps <= 240:
        raise ProtocolError(422, f"fps {fps:g}: expected a frame rate between 0 and 240")
    acc = accept.lower()
    tensor_reply = output_type == "pil" and "image/" not in acc and ("tensor/binary" in acc)
    req = DecodeRequest(shape, dtype, output_type, image_format, partial, tensor_reply, scaling, shift,
                        model_scaling, height, width, fps)
    if req.body_bytes > limits.max_body_bytes:
        raise ProtocolError(413, f"shape {list(shape)} {dname}: {req.body_bytes / 2**20:.1f} MiB of latents, more than "
                                 f"this server takes ({limits.max_body_bytes / 2**20:.0f} MiB per request)")
    _check_geometry(req, family, limits)
    return req


def _check_geometry(req: DecodeRequest, family: FamilySpec, limits: Limits) -> None:
    """What the declared shape would decode to, checked against the model and the limits (no tensor yet)."""
    shape, f = req.shape, family.spatial_factor
    cin = family.latent_channels
    if len(shape) == 3 and req.height is not None:
        n, h, w, frames = shape[0], req.height // f, req.width // f, 1
        if shape[2] != 4 * cin:
            raise ProtocolError(422, f"packed latents {list(shape)}: the last dimension must be {4 * cin} (2x2 patches "
                                     f"of {family.title}'s {cin} channels)")
    elif len(shape) == 3:
        raise ProtocolError(422, f"shape {list(shape)}: 3-D latents are packed (FLUX: batch, sequence, channels); give "
                                 "height and width, the image size, to unpack them; or send (N, C, H, W)")
    elif len(shape) == 2:
        raise ProtocolError(422, f"shape {list(shape)}: latents have 4 (image) or 5 (video) dimensions")
    else:
        n, h, w = shape[0], shape[-2], shape[-1]
        frames = family.output_frames(shape[2]) if (family.is_video and len(shape) == 5) else 1
    pixels = n * frames * h * f * w * f
    if pixels > limits.max_output_pixels:
        raise ProtocolError(413, f"shape {list(shape)} decodes to {pixels / 1e6:.0f} M pixels, more than this server "
                                 f"decodes per request ({limits.max_output_pixels / 1e6:.0f} M); split it")
    video = family.is_video
    if req.output_type == "mp4" and not video:
        raise ProtocolError(422, f"output_type=mp4: {family.title} is an image VAE; ask for pil or pt")
    if req.output_type == "mp4" and n != 1:
        raise ProtocolError(422, f"output_type=mp4: one clip per request, got a batch of {n}")
    if req.output_type == "pil" and not req.tensor_reply and video:
        raise ProtocolError(422, f"output_type=pil from {family.title}, a video VAE, comes back as frames: pass "
                                 "processor=VideoProcessor() to remote_decode, or ask for mp4 or pt")
    if req.output_type == "pil" and not req.tensor_reply and n != 1:
        raise ProtocolError(422, f"output_type=pil returns one image file; the batch is {n}: send one latent per "
                                 "request, or ask for pt")


def latents_from_body(body: bytes | bytearray, req: DecodeRequest, family: FamilySpec) -> torch.Tensor:
    """The body as the declared tensor -> raw decoder latents (float32, CPU), unpacked and unscaled, and checked
    (channels, finite values) by vaeopt's own latent validation."""
    if len(body) != req.body_bytes:
        raise ProtocolError(400, f"body is {len(body)} bytes, but shape {list(req.shape)} "
                                 f"{str(req.dtype).replace('torch.', '')} needs {req.body_bytes}")
    t = torch.frombuffer(bytearray(body) if isinstance(body, bytes) else body, dtype=req.dtype).reshape(req.shape)
    if t.ndim == 3:
        t = unpack(t, req.height, req.width, family.spatial_factor)
    try:
        t = validate(LatentEntry("", t), family, Path("request"))
    except Exception as e:  # LatentError and its NotALatent: the model cannot decode these
        raise ProtocolError(422, str(e)) from None
    if req.scaling_factor is not None or req.shift_factor is not None:
        x = t.float()  # diffusers' pipelines: latents / scaling_factor + shift_factor
        if req.scaling_factor is not None:
            x = x / float(req.scaling_factor)
        if req.shift_factor is not None:
            x = x + float(req.shift_factor)
        return x
    if req.model_scaling:
        return family.unscale(t)
    return t.float()


def unpack(t: torch.Tensor, height: int, width: int, factor: int) -> torch.Tensor:
    """Packed latents (B, (H/2f)*(W/2f), 4C) -> (B, C, H/f, W/f), as FluxPipeline unpacks them before vae.decode."""
    b, seq, c4 = t.shape
    h, w = 2 * (height // (factor * 2)), 2 * (width // (factor * 2))
    if h == 0 or w == 0 or seq != (h // 2) * (w // 2):
        raise ProtocolError(422, f"packed latents of {seq} patches do not fit a {height}x{width} image "
                                 f"({max(h // 2, 0)}x{max(w // 2, 0)} patches of 2x2 latent pixels)")
    t = t.view(b, h // 2, w // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return t.reshape(b, c4 // 4, h, w)


@dataclass
class Reply:
    body: bytes
    media_type: str
    headers: dict


def _tensor_reply(x: torch.Tensor) -> Reply:
    x = x.contiguous()
    name = str(x.dtype).replace("torch.", "")
    return Reply(x.view(torch.uint8).numpy().tobytes() if x.dtype == torch.bfloat16 else x.numpy().tobytes(),
                 "tensor/binary", {"shape": json.dumps(list(x.shape)), "dtype": name})


def prepare(decoded: torch.Tensor, req: DecodeRequest) -> torch.Tensor:
    """The decoder's output (float32 in [-1, 1], on the device that decoded it) -> the tensor this request's answer
    is made of, computed there: uint8 channels-last for image files, MP4 and partial_postprocess (a quarter of the
    float32 bytes to copy to the host), the latents' dtype for pt, [0, 1] frames for a client-side processor.
    Elementwise float32 arithmetic is correctly rounded on every device, so these are the bytes that the same
    steps on the CPU give: what `vaeopt decode` writes (outputs.to_uint8_images, on the same device)."""
    video = decoded.ndim == 5
    if req.output_type == "pt" and not req.partial_postprocess:
        return decoded.to(req.dtype)
    if req.output_type == "pil" and req.tensor_reply:  # [0, 1] frames for the client's processor
        x = (decoded / 2 + 0.5).clamp(0, 1)
        if video:
            x = x.permute(0, 2, 1, 3, 4).reshape(-1, *x.shape[1:2], *x.shape[3:])  # (N*T, 3, H, W)
        return x.to(req.dtype)
    u8 = outputs.to_uint8_images(decoded, on_device=True)
    if req.output_type == "pt":  # uint8 channels-last, the images (or one clip's frames) the client makes PIL of
        return u8[0] if video and u8.shape[0] == 1 else u8
    return u8


def encode(payload: torch.Tensor, req: DecodeRequest, jpeg_quality: int = 95, png_level: int = 1) -> Reply:
    """prepare()'s tensor, on the host -> the bytes and headers the client expects for this request."""
    if req.output_type == "pt" or req.tensor_reply:
        return _tensor_reply(payload)
    if req.output_type == "mp4":
        with tempfile.TemporaryDirectory(prefix="vaeopt-serve-") as d:  # the encoder seeks: a file, then its bytes
            path = Path(d) / "clip.mp4"
            outputs.write_mp4(path, [payload[0]], fps=req.fps)
            return Reply(path.read_bytes(), "video/mp4", {})
    if req.image_format == "png":
        return Reply(png.encode(payload[0].numpy(), level=png_level), "image/png", {})
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(payload[0].numpy()).save(buf, format="JPEG", quality=jpeg_quality, subsampling=0)
    return Reply(buf.getvalue(), "image/jpeg", {})

