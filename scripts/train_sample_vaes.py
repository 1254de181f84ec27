#!/usr/bin/env python3
"""Train the two bundled sample VAEs (samples/tiny_kl_image.safetensors, samples/tiny_wan_video.safetensors) and
rebuild their held-out latents, so that `vaeopt decode` on the samples shows what a trained VAE gives: the photo,
with its colours.

Training data are the photos that ship inside installed packages (scikit-image's data folder, scikit-learn's two
sample images, matplotlib's portrait), so the script needs no download. scikit-image's astronaut and coffee are
held out: they are the sample latents, and the references the decodes are measured against. Video clips are
synthesized from the same photos (pans and zooms), and the held-out clips are pans/zooms over the held-out photos.

    python3 scripts/train_sample_vaes.py --which image --minutes 5 --out out/
    python3 scripts/train_sample_vaes.py --which video --minutes 10 --out out/
    python3 scripts/train_sample_vaes.py --which frames --out out/   # only the held-out clips' frames (CPU)
    python3 scripts/train_sample_vaes.py --which pack --out .train_data/  # the photos in one file, for a machine
                                                                          # without scikit-image (then --data FILE)

The two models are small: run the image and video trainings side by side on one GPU. Video clips are as long as the
held-out ones (17 frames): trained on 9-frame clips, the causal decoder drifted in colour after the third latent
frame of a 17-frame clip (frames 9-16 lost 5-7 dB and up to 38/255 of red). `--init` resumes from saved weights.

The video VAE trains on whole clips in one call per module: a causal conv over the whole clip with causal zero
padding is the function diffusers' frame-by-frame cached loop computes, and the temporal resamplers are run over
the whole clip the way that loop runs them chunk by chunk (`whole_clip`; tests/test_train_whole_clip.py checks the
training forward against `vae.encode`/`vae.decode`). The loop calls every module once per latent frame (the
encoder once per 4-frame chunk), mostly on small tensors; the whole clip calls each module once. Its decoder is wider than its encoder (`decoder_base_dim`): the decoder is what turns the shipped
latents into frames; the encoder only makes them. The last `--decoder-only` fraction of the run freezes the encoder
and trains the decoder on the latents it will ship (the encoder's mode, rounded to fp16, as the latents file holds).
`--compile` compiles the whole-clip encoder and decoder (once per crop; eager if the compile fails), and
`--small-crop` trains the first `--small-frac` of the run on smaller crops: at these widths the step is bound by the
memory traffic of norms, activations and pads around small convs, which compiling fuses and small crops cut.

Each run writes (into --out): the fp16 weights in diffusers key layout with the config in the safetensors metadata
under "config" (how vaeopt reads the samples), the latents file, for video the held-out frames as lossless MP4s,
and a JSON of the final measurements (PSNR and per-channel mean error of each held-out decode vs its reference).

Losses: L1 + MSE in RGB, an L1 on 8x8 block means (a colour cast over a region costs as much as it shows), a
per-channel mean term, and a small KL. Seeds are fixed; cuDNN's autotuned kernels can still make two GPU runs differ
in the last bits.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

HELD_OUT = ("astronaut", "coffee")
# scikit-image data files that are not photographs (test patterns, masks, renders) or too small to crop
NOT_PHOTOS = {"chessboard_GRAY", "chessboard_RGB", "horse", "phantom", "color", "logo", "microaneurysms"}

IMAGE_CONFIG = {
    "in_channels": 3, "out_channels": 3, "latent_channels": 4,
    "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [32, 64, 128, 128], "layers_per_block": 2, "norm_num_groups": 16, "sample_size": 256,
    "scaling_factor": 1.0,  # replaced by 1/std of the training latents before saving
}
VIDEO_CONFIG = {
    "base_dim": 16, "decoder_base_dim": 22, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
    "temperal_downsample": [False, True, True], "dropout": 0.0,
}
VIDEO_FILE_LIMIT = 12_000_000  # bytes of the fp16 weights file
CLIP_FRAMES = 17
CLIP_SIZE = (256, 384)  # (height, width) of the held-out clips: 32x48 latents


def log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------------------------------------- data
def _rgb(a: np.ndarray) -> np.ndarray | None:
    if a.ndim == 2:
        a = np.stack([a] * 3, -1)
    if a.ndim != 3 or a.shape[-1] not in (3, 4):
        return None
    a = a[..., :3]
    if a.dtype != np.uint8:
        a = np.clip(a.astype(np.float64) * (255.0 if a.max() <= 1.0 else 1.0), 0, 255).astype(np.uint8)
    return a


# the photos packed into one file by `--which pack` (read with --data): a machine without scikit-image trains on the
# same photos. Training photos keep their files' bytes (JPEG/PNG, a quarter of the pixels' size); the held-out ones
# are stored as pixels, so the held-out clips are bit-identical to the ones made from scikit-image.
PACK: dict[str, np.ndarray] | None = None


def held_out_photo(name: str) -> np.ndarray:
    if PACK is not None:
        return PACK[f"held:{name}"]
    import skimage.data

    return _rgb(getattr(skimage.data, name)())


def photo_files() -> list[str]:
    """Paths of the photos shipped in the installed packages, less the held-out ones and the non-photos."""
    paths = []
    try:
        import skimage.data

        paths += sorted(glob.glob(os.path.join(os.path.dirname(skimage.data.__file__), "*.png")))
        paths += sorted(glob.glob(os.path.join(os.path.dirname(skimage.data.__file__), "*.jpg")))
    except ImportError:
        pass
    try:
        import sklearn.datasets

        paths += sorted(glob.glob(os.path.join(os.path.dirname(sklearn.datasets.__file__), "images", "*.jpg")))
    except ImportError:
        pass
    try:
        import matplotlib

        paths += [os.path.join(matplotlib.get_data_path(), "sample_data", "grace_hopper.jpg")]
    except ImportError:
        pass
    return [p for p in paths if Path(p).stem not in HELD_OUT and Path(p).stem not in NOT_PHOTOS and os.path.isfile(p)]


def training_photos(min_side: int = 128) -> list[tuple[str, np.ndarray]]:
    """(name, HxWx3 uint8) of every training photo: from the pack (--data) or the installed packages."""
    import io

    from PIL import Image

    if PACK is not None:
        files = [(k[len("train:"):], io.BytesIO(v.tobytes())) for k, v in PACK.items() if k.startswith("train:")]
    else:
        files = [(Path(p).stem, p) for p in photo_files()]
    photos = []
    for name, f in files:
        a = _rgb(np.array(Image.open(f)))
        if a is not None and min(a.shape[:2]) >= min_side:
            photos.append((name, a))
    if not photos:
        sys.exit("no training photos found: install scikit-image (its data module ships the photos)")
    return photos


class PhotoSampler:
    """Random crops of random photos at random scales, with flips and mild colour jitter, made on the device.
    Colour photos are drawn three times as often as grey ones; grey ones stay grey (they teach neutral tones)."""

    def __init__(self, photos, device, seed: int):
        self.names = [n for n, _ in photos]
        self.photos = [torch.from_numpy(np.ascontiguousarray(a)).to(device).permute(2, 0, 1).float().div(255) for _, a in photos]
        grey = [bool((a[..., 0] == a[..., 1]).all() and (a[..., 1] == a[..., 2]).all()) for _, a in photos]
        w = np.array([1.0 if g else 3.0 for g in grey])
        self.p = w / w.sum()
        self.grey = grey
        self.rng = np.random.default_rng(seed)
        self.device = device

    def _scaled(self, i: int, min_h: int, min_w: int, lo: float, hi: float) -> torch.Tensor:
        img = self.photos[i]
        h, w = img.shape[1:]
        need = max(min_h / h, min_w / w)
        s = max(need, math.exp(self.rng.uniform(math.log(lo), math.log(hi))))
        if abs(s - 1) < 1e-3:
            return img
        size = (max(min_h, round(h * s)), max(min_w, round(w * s)))
        return F.interpolate(img[None], size=size, mode="bilinear", antialias=True, align_corners=False)[0]

    def jitter(self, x: torch.Tensor, grey: bool) -> torch.Tensor:
        """x: (3, ...) in [0, 1]. Saturation, contrast, brightness and (rarely) a channel permutation."""
        r = self.rng
        m = x.mean(0, keepdim=True)
        if not grey:
            x = m + (x - m) * (1 + r.uniform(-0.15, 0.15))
            if r.random() < 0.2:
                x = x[torch.as_tensor(r.permutation(3), device=x.device)]
        mu = x.mean()
        x = (x - mu) * (1 + r.uniform(-0.1, 0.1)) + mu + r.uniform(-0.06, 0.06)
        return x.clamp(0, 1)

    def images(self, batch: int, size: int) -> torch.Tensor:
        out = []
        for _ in range(batch):
            i = int(self.rng.choice(len(self.photos), p=self.p))
            img = self._scaled(i, size, size, 0.35, 1.2)
            h, w = img.shape[1:]
            y, x = self.rng.integers(0, h - size + 1), self.rng.integers(0, w - size + 1)
            c = img[:, y:y + size, x:x + size]
            if self.rng.random() < 0.5:
                c = c.flip(-1)
            out.append(self.jitter(c, self.grey[i]))
        return torch.stack(out) * 2 - 1

    def clips(self, batch: int, frames: int, size: int) -> torch.Tensor:
        """(B, 3, T, size, size) in [-1, 1]: pans and zooms over a photo, some still."""
        out = []
        for _ in range(batch):
            i = int(self.rng.choice(len(self.photos), p=self.p))
            img = self._scaled(i, int(size * 1.5), int(size * 1.5), 0.4, 1.1)
            h, w = img.shape[1:]
            r = self.rng
            kind = r.random()  # still, pan (whole-pixel moves at this scale), or pan + zoom
            side0 = side1 = float(size)
            if kind >= 0.55:
                side0 = size * math.exp(r.uniform(0, 0.3))
                side1 = side0 * math.exp(r.uniform(-0.25, 0.25))
            side0, side1 = min(side0, min(h, w)), min(side1, min(h, w))
            # pixels per frame, up to the held-out pan's 11.3 (8 down and 8 right): a pan faster than any seen in
            # training smeared (the held-out pan lost 4 dB against the zoom)
            v = 0.0 if kind < 0.15 else r.uniform(0, 12)
            ang = r.uniform(0, 2 * math.pi)
            cy0, cx0 = r.uniform(side0 / 2, h - side0 / 2), r.uniform(side0 / 2, w - side0 / 2)
            cy1 = min(max(cy0 + v * (frames - 1) * math.sin(ang), side1 / 2), h - side1 / 2)
            cx1 = min(max(cx0 + v * (frames - 1) * math.cos(ang), side1 / 2), w - side1 / 2)
            fr = render_path(img, frames, (size, size), (cy0, cx0, side0, side0), (cy1, cx1, side1, side1))
            if r.random() < 0.5:
                fr = fr.flip(-1)
            if r.random() < 0.5:
                fr = fr.flip(1)  # time reversed
            out.append(self.jitter(fr, self.grey[i]))
        return torch.stack(out) * 2 - 1


def render_path(img: torch.Tensor, frames: int, size: tuple[int, int], box0, box1) -> torch.Tensor:
    """(3, T, H, W) in [0, 1]: each frame the box (cy, cx, box_h, box_w) interpolated from box0 to box1, cut at whole
    pixels and resized (antialiased) to size; a box of the output's size is a plain crop (a pan moves whole pixels)."""
    h, w = img.shape[1:]
    out = []
    for t in range(frames):
        a = t / max(1, frames - 1)
        cy, cx, bh, bw = (p0 + (p1 - p0) * a for p0, p1 in zip(box0, box1))
        bh, bw = min(h, round(bh)), min(w, round(bw))
        y0 = min(max(0, round(cy - bh / 2)), h - bh)
        x0 = min(max(0, round(cx - bw / 2)), w - bw)
        c = img[:, y0:y0 + bh, x0:x0 + bw]
        if (bh, bw) != tuple(size):
            c = F.interpolate(c[None], size=size, mode="bilinear", antialias=True, align_corners=False)[0]
        out.append(c)
    return torch.stack(out, 1)


def write_pack(path: Path) -> Path:
    """All training photos (their files' bytes) and the held-out photos (pixels) in one compressed .npz."""
    arrays = {f"train:{Path(p).stem}": np.frombuffer(Path(p).read_bytes(), np.uint8) for p in photo_files()}
    arrays.update({f"held:{n}": held_out_photo(n) for n in HELD_OUT})
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, path)
    return path


def read_pack(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def held_out_clips() -> dict[str, np.ndarray]:
    """The two held-out clips, (T, H, W, 3) uint8, made on the CPU from the held-out photos: a diagonal pan over the
    astronaut at full resolution (whole-pixel moves) and a slow zoom into the coffee cup."""
    H, W = CLIP_SIZE
    a = torch.from_numpy(held_out_photo("astronaut")).permute(2, 0, 1).float() / 255  # 512x512
    c = torch.from_numpy(held_out_photo("coffee")).permute(2, 0, 1).float() / 255  # 400x600
    T = CLIP_FRAMES
    pan = render_path(a, T, (H, W), (H / 2 + 16, W / 2, H, W), (H / 2 + 16 + 8 * (T - 1), W / 2 + 8 * (T - 1), H, W))
    zoom = render_path(c, T, (H, W), (200, 300, 400, 600), (190, 290, 280, 420))
    to8 = lambda x: (x.permute(1, 2, 3, 0).clamp(0, 1) * 255).round().to(torch.uint8).numpy()  # noqa: E731
    return {"astronaut_pan": to8(pan), "coffee_zoom": to8(zoom)}


# ---------------------------------------------------------------------------------------------------------- losses
def recon_loss(rec: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rec, x: (N, 3, H, W) in [-1, 1]. Returns the loss and the batch PSNR (dB, on [0, 255]; a tensor, read only
    when logged, so that a step does not wait for the device)."""
    rec = rec.float()
    d = rec - x
    mse = d.pow(2).mean()
    loss = d.abs().mean() + mse
    if min(x.shape[-2:]) >= 8:
        loss = loss + 0.5 * (F.avg_pool2d(rec, 8) - F.avg_pool2d(x, 8)).abs().mean()
    loss = loss + 0.5 * (rec.mean((2, 3)) - x.mean((2, 3))).abs().mean()
    psnr = 10 * torch.log10(4.0 / mse.detach().clamp_min(1e-12))
    return loss, psnr


def kl_per_element(post) -> torch.Tensor:
    return 0.5 * (post.mean.float().pow(2) + post.var.float() - 1.0 - post.logvar.float()).mean()


# -------------------------------------------------------------------------------------------------------- models
def wan_decode_unclamped(vae, z: torch.Tensor) -> torch.Tensor:
    """AutoencoderKLWan.decode without its final clamp to [-1, 1]: a clamp passes no gradient, so a pixel decoded
    above 1 where the photo is 0.9 would never be pulled back. Same frame-by-frame causal loop as diffusers."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    n = sum(isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())
    cache = [None] * n
    x = vae.post_quant_conv(z)
    outs = []
    for i in range(z.shape[2]):
        outs.append(vae.decoder(x[:, :, i:i + 1], feat_cache=cache, feat_idx=[0], first_chunk=(i == 0)))
    return torch.cat(outs, 2)


def _resample_forward(self, x: torch.Tensor, feat_cache=None, feat_idx=None) -> torch.Tensor:
    """WanResample.forward that also runs a whole clip, (B, C, T, H, W), when given no feature cache, computing what
    diffusers' cached loop computes chunk by chunk: upsample3d leaves the first frame as it is (the loop's first chunk
    skips the time conv) and turns each later frame into two, by a causal time conv over frames 1.. with zero
    history; downsample3d keeps the first frame and adds the stride-2 time conv over the whole clip (its windows
    [0,1,2], [2,3,4], ... are the loop's, which prepends the last frame of the previous chunk). With a cache (diffusers'
    own encode/decode), the stock forward runs."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanResample

    if feat_cache is not None:
        return WanResample.forward(self, x, feat_cache, feat_idx)
    b, c, t, h, w = x.shape
    if self.mode == "upsample3d" and t > 1:
        y = self.time_conv(x[:, :, 1:])  # (B, 2C, T-1, H, W): the two output frames of each input frame
        y = y.unflatten(1, (2, c)).permute(0, 2, 3, 1, 4, 5).reshape(b, c, 2 * (t - 1), h, w)
        x = torch.cat([x[:, :, :1], y], 2)
    t = x.shape[2]
    x = self.resample(x.transpose(1, 2).flatten(0, 1))  # frame by frame, as one batch
    x = x.unflatten(0, (b, t)).transpose(1, 2)
    if self.mode == "downsample3d" and t > 1:
        x = torch.cat([x[:, :, :1], self.time_conv(x)], 2)
    return x


def whole_clip(vae):
    """Give the Wan VAE's resamplers the whole-clip forward (an instance attribute; diffusers' encode/decode, which
    pass a feature cache, still run the stock one). Every other Wan module already runs a whole clip when given no
    cache: its causal convs pad the clip's start with zeros, as the cached loop's first chunk does. Returns the VAE."""
    import types

    from diffusers.models.autoencoders.autoencoder_kl_wan import WanResample

    for m in vae.modules():
        if isinstance(m, WanResample):
            m.forward = types.MethodType(_resample_forward, m)
    return vae


def wan_encode_whole(vae, x: torch.Tensor):
    """The posterior of AutoencoderKLWan.encode(x), x (B, 3, 1+4k, H, W), in one pass over the whole clip."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    return DiagonalGaussianDistribution(vae.quant_conv(vae.encoder(x)))


def wan_decode_whole(vae, z: torch.Tensor) -> torch.Tensor:
    """AutoencoderKLWan.decode(z) in one pass over the whole clip, unclamped (see wan_decode_unclamped)."""
    return vae.decoder(vae.post_quant_conv(z))


def video_config(base_dim: int | None = None, decoder_base_dim: int | None = None) -> dict:
    cfg = dict(VIDEO_CONFIG)
    if base_dim:
        cfg["base_dim"] = base_dim
    if decoder_base_dim:
        cfg["decoder_base_dim"] = decoder_base_dim
    if cfg.get("decoder_base_dim") == cfg["base_dim"]:
        del cfg["decoder_base_dim"]  # the plain Wan 2.1 layout: one width
    return cfg


def build(which: str, init: str | None, cfg: dict):
    from diffusers import AutoencoderKL, AutoencoderKLWan

    vae = AutoencoderKL(**cfg) if which == "image" else whole_clip(AutoencoderKLWan(**cfg))
    n = sum(p.numel() for p in vae.parameters())
    log(f"[{which}] {n / 1e6:.2f}M parameters ({2 * n / 1e6:.1f} MB in fp16)")
    if which == "video" and 2 * n > VIDEO_FILE_LIMIT:
        sys.exit(f"the video VAE would be {2 * n / 1e6:.1f} MB in fp16, over {VIDEO_FILE_LIMIT / 1e6:.0f} MB")
    if init:
        from safetensors.torch import load_file

        vae.load_state_dict({k: v.float() for k, v in load_file(init).items()})
        log(f"init from {init}")
    return vae


def lr_at(step: int, frac: float, base: float, warmup: int) -> float:
    w = min(1.0, (step + 1) / warmup)
    return base * w * (0.03 + 0.97 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


class VideoForward:
    """The video training forward: the whole-clip encoder and decoder (or diffusers' cached loop), optionally compiled.

    The encoder and decoder are compiled apart, once per crop. The graphs are the same in both phases of the run, so
    the decoder-only phase costs no recompile: the encoder still runs with gradient enabled there, its output
    detached (the encoder gets no gradient, which is what freezing it did, and compiled code guarded on
    requires_grad stays valid). A compile that fails falls back to eager, with one line in the log."""

    def __init__(self, vae, loop: str = "whole", compile_mode: str = "off", backend: str = "inductor"):
        self.vae, self.loop, self.compile_mode = vae, loop, compile_mode
        self.encoder, self.decoder = vae.encoder, vae.decoder
        if compile_mode != "off" and loop == "whole":
            # static shapes: one graph each per (batch, crop), two with a crop curriculum (traced with dynamic
            # shapes, the Wan encoder and decoder broke into 7 graphs, not 2)
            kw = {"backend": backend, "dynamic": False}
            if backend == "inductor" and compile_mode != "default":
                kw["mode"] = compile_mode
            self.encoder, self.decoder = torch.compile(vae.encoder, **kw), torch.compile(vae.decoder, **kw)
        else:
            self.compile_mode = "off"

    def eager(self, why: BaseException) -> None:
        """Drop the compiled modules (the run goes on eager)."""
        first = (str(why).splitlines() or [""])[0][:160]
        log(f"[video] torch.compile failed ({type(why).__name__}: {first}); training eager")
        torch._dynamo.reset()
        self.encoder, self.decoder, self.compile_mode = self.vae.encoder, self.vae.decoder, "off"

    def encode(self, x: torch.Tensor):
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        if self.loop == "cached":
            return self.vae.encode(x).latent_dist
        return DiagonalGaussianDistribution(self.vae.quant_conv(self.encoder(x)))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        if self.loop == "cached":
            return wan_decode_unclamped(self.vae, z)
        return self.decoder(self.vae.post_quant_conv(z))

    def __call__(self, x: torch.Tensor, decoder_only: bool):
        """(posterior, unclamped reconstruction). decoder_only: the encoder's output is detached and the decoder gets
        the shipped latents (the mode, rounded to fp16)."""
        post = self.encode(x)
        if decoder_only:
            from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

            post = DiagonalGaussianDistribution(post.parameters.detach())
            # requires_grad as in the full phase: the compiled decoder's guards hold, its input gradient is one conv
            z = post.mode().half().to(post.mean.dtype).requires_grad_()
            return post, self.decode(z)
        return post, self.decode(post.sample())


def video_loss(fwd: VideoForward, x: torch.Tensor, kl_weight: float, decoder_only: bool, amp):
    """x (B, 3, T, H, W) in [-1, 1] -> (total loss, recon loss, batch PSNR, KL)."""
    with amp:
        post, rec = fwd(x, decoder_only)
    flat = lambda v: v.transpose(1, 2).flatten(0, 1)  # noqa: E731  (B,3,T,H,W) -> (B*T,3,H,W)
    loss, psnr = recon_loss(flat(rec), flat(x))
    kl = kl_per_element(post)
    return loss + (0.0 if decoder_only else kl_weight) * kl, loss, psnr, kl


def crop_at(frac: float, args) -> tuple[int, int]:
    """(batch, crop) at this point of the run: small crops (--small-batch of them) for the first --small-frac of it
    (the same model and losses on a third of the pixels per clip at 96 against 160: ~2.8x the steps), then the full
    crop."""
    if args.small_crop and frac < args.small_frac:
        return args.small_batch or args.batch, args.small_crop
    return args.batch, args.crop


def train(which: str, args) -> torch.nn.Module:
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    dev = torch.device(args.device)
    vae = build(which, args.init, args.cfg).to(dev).train()
    if args.channels_last:
        # the Wan VAE mixes 3D convs with 2D ones (its spatial resamplers): each weight takes its rank's layout
        for p in vae.parameters():
            if p.dim() in (4, 5):
                p.data = p.data.contiguous(memory_format=torch.channels_last if p.dim() == 4 else
                                           torch.channels_last_3d)
    photos = training_photos()
    log(f"[{which}] {len(photos)} training photos: {', '.join(n for n, _ in photos)}")
    sampler = PhotoSampler(photos, dev, args.seed + (0 if which == "image" else 1))
    # fused: one kernel for the whole update on CUDA, where the small model's ~200 tensors are many launches
    opt = torch.optim.AdamW(vae.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=1e-4,
                            fused=dev.type == "cuda")
    amp_dtype = {"bf16": torch.bfloat16, "off": None}.get(args.amp, torch.bfloat16 if dev.type == "cuda" else None)
    amp = torch.autocast(dev.type, dtype=amp_dtype, enabled=amp_dtype is not None)
    fwd = VideoForward(vae, args.loop, args.compile, args.compile_backend) if which == "video" else None
    budget = args.minutes * 60
    t0 = last = time.time()
    step, hist, skipped, frozen, shape, ahead = 0, [], 0, False, None, None
    while True:
        # the run's progress in [0, 1]: time, or steps, whichever is further along
        frac = max((time.time() - t0) / budget if budget > 0 else 0.0,
                   step / args.max_steps if args.max_steps else 0.0)
        if frac >= 1:
            break
        decoder_only = which == "video" and frac >= 1 - args.decoder_only
        if decoder_only and not frozen:
            frozen = True  # the encoder gets no gradient from here on (VideoForward detaches its output)
            log(f"[{which}] step {step} {time.time() - t0:.0f}s: encoder frozen, decoder trained on its fp16 latents")
        for g in opt.param_groups:
            g["lr"] = lr_at(step, frac, args.lr, args.warmup)
        if which == "image":
            x = sampler.images(args.batch, args.crop)
            with amp:
                post = vae.encode(x).latent_dist
                rec = vae.decode(post.sample()).sample
            loss, psnr = recon_loss(rec, x)
            kl = kl_per_element(post)
            total = loss + args.kl * kl
        else:
            batch, crop = crop_at(frac, args)
            if (batch, crop) != shape:
                shape = (batch, crop)
                log(f"[{which}] step {step} {time.time() - t0:.0f}s: batch {batch} of {args.frames}x{crop}x{crop} "
                    f"clips{' (compiling)' if fwd.compile_mode != 'off' else ''}")
            clips = lambda: sampler.clips(batch, args.frames, crop).contiguous(  # noqa: E731
                memory_format=torch.channels_last_3d if args.channels_last else torch.contiguous_format)
            x = ahead if ahead is not None and ahead.shape[0] == batch and ahead.shape[-1] == crop else clips()
            try:
                total, loss, psnr, kl = video_loss(fwd, x, args.kl, decoder_only, amp)
            except Exception as e:  # noqa: BLE001  (a compiler error must not cost the run: go on eager)
                if fwd.compile_mode == "off":
                    raise
                fwd.eager(e)
                total, loss, psnr, kl = video_loss(fwd, x, args.kl, decoder_only, amp)
            # the next batch is cut while the device runs this forward (the finiteness check below waits for it)
            ahead = clips()
        opt.zero_grad(set_to_none=True)
        if not torch.isfinite(total):  # a rare bf16 blow-up: skip the batch rather than poison the weights
            skipped += 1
            if skipped > max(100, step):  # not rare: the run has diverged, and a --max-steps run would never end
                raise SystemExit(f"[{which}] {skipped} non-finite batches in {step} steps: the run diverged "
                                 "(try a lower --lr or --amp off)")
            continue
        try:
            total.backward()
        except Exception as e:  # noqa: BLE001  (the compiled backward is built on its first call)
            if fwd is None or fwd.compile_mode == "off":
                raise
            fwd.eager(e)
            opt.zero_grad(set_to_none=True)
            continue
        torch.nn.utils.clip_grad_norm_([p for p in vae.parameters() if p.grad is not None], 1.0)
        opt.step()
        hist = hist[-49:] + [psnr]
        step += 1
        if time.time() - last > args.log_every or step == 1:
            last = time.time()
            log(f"[{which}] step {step} {time.time() - t0:.0f}s loss {loss.item():.4f} kl {kl.item():.2f} "
                f"train psnr(avg last 50) {torch.stack(hist).mean().item():.2f} dB lr {opt.param_groups[0]['lr']:.2e} "
                f"{step / (time.time() - t0):.2f} it/s")
    log(f"[{which}] trained {step} steps in {time.time() - t0:.0f}s ({skipped} non-finite batches skipped)")
    vae.eval()
    vae.train_steps = step
    return vae


# ------------------------------------------------------------------------------------------------- save + measure
def measure(dec: np.ndarray, ref: np.ndarray) -> dict:
    """dec, ref: uint8 (..., 3). PSNR in dB and each channel's mean error in 1/255 units."""
    d = dec.astype(np.float64) - ref.astype(np.float64)
    mse = (d ** 2).mean()
    ch = d.reshape(-1, 3).mean(0)
    return {"psnr_db": round(10 * math.log10(255 ** 2 / mse), 2), "channel_mean_err": [round(float(v), 2) for v in ch],
            "worst_channel_mean_err": round(float(np.abs(ch).max()), 2)}


def to_uint8(x: torch.Tensor) -> np.ndarray:
    """(3, ...) in [-1, 1] -> (..., 3) uint8, as vaeopt writes images."""
    x = ((x.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return x.movedim(0, -1).cpu().numpy()


def save_weights(vae, cfg: dict, path: Path):
    from safetensors.torch import save_file

    sd = {k: v.detach().to("cpu", torch.float16).contiguous() for k, v in vae.state_dict().items()}
    save_file(sd, str(path), metadata={"config": json.dumps(cfg)})
    return sd


def write_lossless_mp4(frames: np.ndarray, path: Path, fps: int = 8) -> Path:
    """RGB frames, bit-exact (H.264 in its lossless RGB mode), about a tenth of the size of compressed arrays; falls
    back to a compressed .npz when the encoder is missing."""
    try:
        import av

        with av.open(str(path), "w") as c:
            s = c.add_stream("libx264rgb", rate=fps)
            s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], "rgb24"
            s.options = {"crf": "0", "preset": "veryslow"}
            for f in frames:
                for p in s.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")):
                    c.mux(p)
            for p in s.encode():
                c.mux(p)
        with av.open(str(path)) as c:
            back = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
        if back.shape == frames.shape and (back == frames).all():
            return path
        log(f"{path.name}: the MP4 did not read back bit-exact; writing .npz")
    except Exception as e:  # noqa: BLE001  (no PyAV / no libx264rgb: the frames still ship)
        log(f"{path.name}: lossless MP4 failed ({type(e).__name__}: {e}); writing .npz")
    npz = path.with_suffix(".npz")
    np.savez_compressed(npz, frames=frames)
    return npz


@torch.no_grad()
def finish_image(vae, args, out: Path) -> dict:
    from diffusers import AutoencoderKL

    dev = torch.device(args.device)
    # the shipped weights are fp16: measure those, in fp32 compute
    sd = save_weights(vae, args.cfg, out / "tiny_kl_image.safetensors")
    m = AutoencoderKL(**IMAGE_CONFIG).to(dev).eval()
    m.load_state_dict({k: v.float() for k, v in sd.items()})
    # scaling_factor = 1/std of the latents (encoder mode) over training crops, as Stable Diffusion's was chosen
    sampler = PhotoSampler(training_photos(), dev, args.seed + 7)
    zs = [m.encode(sampler.images(8, min(256, args.crop * 2))).latent_dist.mode().float().cpu()
          for _ in range(args.sf_batches)]
    sf = round(1.0 / torch.cat(zs).std().item(), 5)
    cfg = dict(IMAGE_CONFIG, scaling_factor=sf)
    save_weights(m, cfg, out / "tiny_kl_image.safetensors")
    log(f"[image] scaling_factor {sf} (latent std {1 / sf:.4f})")
    res, lat = {"scaling_factor": sf, "train_steps": getattr(vae, "train_steps", 0)}, {}
    for name in HELD_OUT:
        ref = held_out_photo(name)
        x = torch.from_numpy(ref).to(dev).permute(2, 0, 1)[None].float() / 127.5 - 1
        z = (m.encode(x).latent_dist.mode() * sf).half()
        lat[name] = z.cpu()
        dec = m.decode(z.float() / sf).sample[0]
        res[name] = measure(to_uint8(dec), ref)
        log(f"[image] {name} {tuple(z.shape)}: {res[name]}")
    torch.save(lat, out / "tiny_kl_image_latents.pt")
    return res


@torch.no_grad()
def finish_video(vae, args, out: Path) -> dict:
    from diffusers import AutoencoderKLWan

    dev = torch.device(args.device)
    path = out / "tiny_wan_video.safetensors"
    sd = save_weights(vae, args.cfg, path)
    # measured as shipped: fp16 weights in fp32 compute, through diffusers' own frame-by-frame encode and decode
    m = AutoencoderKLWan(**args.cfg).to(dev).eval()
    m.load_state_dict({k: v.float() for k, v in sd.items()})
    res = {"train_steps": getattr(vae, "train_steps", 0), "config": args.cfg, "file_bytes": path.stat().st_size}
    lat = {}
    for name, frames in held_out_clips().items():
        if not args.skip_frames:
            res[name + "_file"] = write_lossless_mp4(frames, out / f"{name}_frames.mp4").name
        x = torch.from_numpy(frames).to(dev).permute(3, 0, 1, 2)[None].float() / 127.5 - 1
        z = m.encode(x).latent_dist.mode().half()  # raw latents: Wan's latents_mean/std are not applied
        lat[name] = z.cpu()
        dec = to_uint8(m.decode(z.float()).sample[0])
        res[name] = measure(dec, frames)
        res[name]["frame_psnr_db"] = [measure(dec[i], frames[i])["psnr_db"] for i in range(len(frames))]
        log(f"[video] {name} {tuple(z.shape)}: {res[name]}")
    torch.save(lat, out / "tiny_wan_video_latents.pt")
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--which", choices=["image", "video", "frames", "pack"], required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--data", type=Path, default=None, help="the photos packed by --which pack (else the installed "
                                                             "packages' photos)")
    ap.add_argument("--minutes", type=float, default=5.0, help="wall-clock training budget (0 with --max-steps: "
                                                               "steps only)")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: time only)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--crop", type=int, default=None, help="training crop side (pixels)")
    ap.add_argument("--frames", type=int, default=CLIP_FRAMES, help="frames per training clip (video): 1 + 4k")
    ap.add_argument("--base-dim", type=int, default=None, help=f"video encoder width (default "
                                                                f"{VIDEO_CONFIG['base_dim']})")
    ap.add_argument("--decoder-base-dim", type=int, default=None, help=f"video decoder width (default "
                                                                        f"{VIDEO_CONFIG['decoder_base_dim']})")
    ap.add_argument("--loop", choices=["whole", "cached"], default="whole",
                    help="video training forward: whole clips per call, or diffusers' frame-by-frame cached loop")
    ap.add_argument("--decoder-only", type=float, default=0.25,
                    help="video: the last fraction of the run trains the decoder alone on the fp16 latents")
    ap.add_argument("--amp", choices=["auto", "bf16", "off"], default="auto", help="autocast (auto: bf16 on CUDA)")
    ap.add_argument("--channels-last", action="store_true", help="channels-last activations and weights")
    ap.add_argument("--compile", choices=["off", "default", "max-autotune-no-cudagraphs"], default="off",
                    help="video: torch.compile the whole-clip encoder and decoder (falls back to eager on failure)")
    ap.add_argument("--compile-backend", default="inductor", help=argparse.SUPPRESS)  # aot_eager in the CPU tests
    ap.add_argument("--small-crop", type=int, default=0, help="video: crop side for the first --small-frac of "
                                                              "the run (0: full crops throughout)")
    ap.add_argument("--small-batch", type=int, default=0, help="video: batch at --small-crop (0: --batch)")
    ap.add_argument("--small-frac", type=float, default=0.5, help="video: fraction of the run at --small-crop")
    ap.add_argument("--skip-frames", action="store_true", help="video: do not write the held-out frames")
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--kl", type=float, default=1e-6, help="weight of the per-element KL")
    ap.add_argument("--sf-batches", type=int, default=32, help="batches of 8 crops for the scaling factor")
    ap.add_argument("--init", default=None, help="fp16 safetensors to start from (resuming)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=float, default=15.0, help="seconds between progress lines")
    args = ap.parse_args(argv)
    if args.batch is None:
        args.batch = 24 if args.which == "image" else 6
    if args.crop is None:
        args.crop = 256 if args.which == "image" else 160
    if args.minutes <= 0 and not args.max_steps:
        ap.error("--minutes 0 needs --max-steps")
    if args.small_crop and (args.small_crop % 8 or args.crop % 8):
        ap.error(f"--small-crop {args.small_crop} / --crop {args.crop}: crops are multiples of 8 (the latent grid)")
    if args.small_crop and args.small_frac + args.decoder_only > 1:
        ap.error("--small-frac + --decoder-only > 1: the decoder-only phase trains on full crops")
    if args.which == "pack":
        args.out.mkdir(parents=True, exist_ok=True)
        path = write_pack(args.out / "photos.npz")
        log(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")
        return
    global PACK
    if args.data is not None:
        if not args.data.is_file():
            ap.error(f"--data {args.data}: no such file (make it with --which pack)")
        PACK = read_pack(args.data)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.which == "frames":
        for name, frames in held_out_clips().items():
            log(f"wrote {write_lossless_mp4(frames, args.out / f'{name}_frames.mp4')}")
        return
    args.cfg = IMAGE_CONFIG if args.which == "image" else video_config(args.base_dim, args.decoder_base_dim)
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 measurements stay fp32
    if args.device.startswith("cuda"):
        log(f"[{args.which}] {torch.cuda.get_device_name()} torch {torch.__version__}")
    vae = train(args.which, args)
    res = finish_image(vae, args, args.out) if args.which == "image" else finish_video(vae, args, args.out)
    (args.out / f"{args.which}_results.json").write_text(json.dumps(res, indent=1))
    log(f"[{args.which}] results: {json.dumps(res)}")


if __name__ == "__main__":
    main()
