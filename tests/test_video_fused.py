"""vaeopt.video's fused kernel path (conv biases folded into the next kernel, one-pass residual epilogues, norms
writing into the conv input buffers, kernel 2x upsampling fused with the epilogue / time_conv interleave) against
stock diffusers, under the Triton interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1).

Trained tiny Wan 2.1 (real latents, 2x2 latent-pixel crops: the interpreter is slow) with the fused_norms stage
applied, NCDHW and channels_last_3d; Wan 2.2 topology (residual up blocks with DupUp3D, patch 2, batch 2), random
small weights. Chunk sizes 1, 2, 3 on 5 latent frames: schedules [1,1,1,1,1], [1,2,2], [2,3]. The counts in
`ChunkDecoder.stats` are checked against spies on the real kernel launchers and conv calls.
"""

import json

import pytest
import torch
import torch.nn.functional as F

from vaeopt import video, video_tiling
from vaeopt.errors import VaeoptError
from vaeopt.families import build_model, get_family
from vaeopt.kernels import triton_available
from vaeopt.stages import fused_epilogues, fused_norms
from vaeopt.engine.wan import ChunkDecoder
from vaeopt.engine import wan_ops
from vaeopt.engine.wan_ops import wan_module



@pytest.fixture(autouse=True)
def _backend(request):
    dev = "cuda" if "gpu" in request.keywords else "cpu"
    ok, why = triton_available(dev)
    if not ok:
        pytest.skip(why)

CROP = (slice(10, 12), slice(20, 22))  # coffee_zoom, 2x2 latent pixels -> 16x16 output frames


def _cl_weights(vae):
    for m in vae.modules():
        if isinstance(m, torch.nn.Conv3d):
            m.weight.data = m.weight.data.contiguous(memory_format=torch.channels_last_3d)
    return vae


def _tiny_wan21(samples_dir, fused=True, channels_last=False, device="cpu"):
    from diffusers import AutoencoderKLWan
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = str(samples_dir / "tiny_wan_video.safetensors")
    with safe_open(path, "pt") as f:
        cfg = json.loads(f.metadata()["config"])
    vae = AutoencoderKLWan(**cfg).eval().requires_grad_(False)
    vae.load_state_dict({k: v.float() for k, v in load_file(path).items()})
    vae.to(device)
    if fused:
        r = fused_norms.apply(vae)
        if r.status != "applied":
            pytest.skip(r.line())
        assert fused_epilogues.apply(vae).status == "applied"  # switches the fused chunk decoder on
    return _cl_weights(vae) if channels_last else vae


@pytest.fixture(scope="module")
def stock21(samples_dir):
    return _tiny_wan21(samples_dir, fused=False)


@pytest.fixture(scope="module")
def fused21(samples_dir):
    return {"cf": _tiny_wan21(samples_dir), "cl": _tiny_wan21(samples_dir, channels_last=True)}


@pytest.fixture(scope="module")
def z21(samples_dir):
    lat = torch.load(samples_dir / "tiny_wan_video_latents.pt")
    return lat["coffee_zoom"].float()[:, :, :, CROP[0], CROP[1]].contiguous()


@pytest.fixture(scope="module")
def ref21(stock21, z21):
    with torch.no_grad():
        return stock21.decode(z21).sample


def decode(vae, z, chunk, **kw):
    """decode_video, also returning the stats of the ChunkDecoder it used."""
    made = []

    class Recording(ChunkDecoder):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    orig = video_tiling.ChunkDecoder
    video_tiling.ChunkDecoder = Recording
    try:
        out = video.decode_video(vae, z, chunk, **kw)
    finally:
        video_tiling.ChunkDecoder = orig
    return out, dict(made[-1].stats)  # (the decoder that ran: made last)


def _structure(vae):
    wan = wan_module()
    dec = vae.decoder
    blocks = [m for m in dec.modules() if isinstance(m, wan.WanResidualBlock)]
    shortcuts = sum(not isinstance(b.conv_shortcut, torch.nn.Identity) for b in blocks)
    rs = [m for m in dec.modules() if isinstance(m, wan.WanResample)]
    return len(blocks), shortcuts, sum(r.mode == "upsample3d" for r in rs), sum(r.mode == "upsample2d" for r in rs)


def _deferred(vae):
    """Residual-block outputs per call that the next norm forms itself (channels-last): each block followed by
    another block of its up block, and the last up block's last one when the head's norm reads it."""
    ubs = vae.decoder.up_blocks
    last = ubs[-1]
    head = getattr(last, "upsampler", None) is None and getattr(last, "upsamplers", None) is None \
        and getattr(last, "avg_shortcut", None) is None
    return sum(len(ub.resnets) - 1 for ub in ubs) + head


@pytest.mark.parametrize("layout", ["cf", "cl"])
def test_wan21_fused_equals_diffusers(fused21, z21, ref21, layout):
    vae = fused21[layout]
    n_blocks, n_sc, n_up3, n_up2 = _structure(vae)
    for chunk in (1, 2, 3):
        out, st = decode(vae, z21, chunk)
        assert out.shape == ref21.shape
        err = (out - ref21).abs().max().item()
        assert err <= 1e-4, (layout, chunk, err)
        steps = len(video.chunk_schedule(z21.shape[2], chunk))
        # every block took the fused path, its output formed once: by its epilogue or, on channels-last, by the next
        # norm (the head's only where conv outputs are channels-last: CPU's conv3d returns channels-first ones)
        deferred = (_deferred(vae) - 1) * steps if layout == "cl" else 0
        assert st.get("residual_in_norm", 0) == deferred
        assert st["fused_blocks"] == st["epilogue"] + deferred == n_blocks * steps
        assert st["norm_kernel"] == (2 * n_blocks + 1) * steps  # + the head's norm_out
        assert st["upsample_fused"] == n_up2 * steps  # upsample2d: the last block's epilogue writes 2x
        # upsample3d: time_conv + its bias + interleave + 2x in one kernel whenever time_conv runs; the first
        # chunk's frame 0 is upsampled alone
        first = video.chunk_schedule(z21.shape[2], chunk)[0]
        assert st["upsample_kernel"] == n_up3
        assert st["interleave_upsample"] == n_up3 * (steps - (first == 1))
        assert "bias_materialized" not in st
        # the mid-block attention: chunked GEMM attention + one epilogue, on channels-last activations
        n_attn = sum(a is not None for a in vae.decoder.mid_block.attentions)
        assert n_attn and st.get("attention_chunked", 0) == (n_attn * steps if layout == "cl" else 0)
        # conv_in + conv1/conv2 of every block + shortcuts + 2D upsample convs, and time_conv where it runs
        assert st["bias_folded"] == (1 + 2 * n_blocks + n_sc + n_up3 + n_up2) * steps + st["interleave_upsample"]
    # fused off: the torch path, no kernel
    out, st = decode(vae, z21, 2, fused=False)
    assert st == {} and (out - ref21).abs().max().item() <= 1e-4


def test_counts_are_real(fused21, z21, ref21, monkeypatch):
    """Spies on the launchers and convs: what the stats claim is what ran (and no aten upsample, no conv bias
    left on the folded convs)."""
    import importlib

    epi = importlib.import_module("vaeopt.kernels.epilogue")
    rms = importlib.import_module("vaeopt.kernels.rms_norm_silu")  # (the package re-exports a function of that name)

    tap = importlib.import_module("vaeopt.kernels.tapconv")

    calls = {"br": 0, "br_up": 0, "rms": 0, "rms_out": 0, "conv3d_nobias": 0, "conv3d_bias": 0,
             "conv2d_nobias": 0, "conv2d_bias": 0, "interp": 0, "rms_taps": 0, "tap_sum": 0}

    def spy(name, fn, count):
        def wrapped(*a, **k):
            count(*a, **k)
            return fn(*a, **k)
        monkeypatch.setattr(*name, wrapped)

    def c_br(*a, **k):
        calls["br"] += 1
        calls["br_up"] += bool(k.get("upsample2x") or (len(a) > 4 and a[4]))

    def c_rms(*a, **k):
        calls["rms"] += 1
        calls["rms_out"] += k.get("out") is not None

    def c_conv(kind):
        def f(x, w, b=None, *a, **k):
            calls[f"{kind}_{'nobias' if b is None else 'bias'}"] += 1
        return f

    conv3d = F.conv3d

    def conv3d_cl(x, *a, **k):  # as cuDNN does (CPU's conv3d returns channels-first): channels-last in and out,
        y = conv3d(x, *a, **k)  # so the next norm forms each block output in its one pass (no bias_residual call)
        cl = x.dim() == 5 and x.permute(0, 2, 3, 4, 1).is_contiguous()
        return y.contiguous(memory_format=torch.channels_last_3d) if cl else y

    monkeypatch.setattr(F, "conv3d", conv3d_cl)

    spy((epi, "bias_residual"), epi.bias_residual, c_br)
    spy((rms, "rms_norm_silu"), rms.rms_norm_silu, c_rms)
    spy((F, "conv3d"), F.conv3d, c_conv("conv3d"))
    spy((F, "conv2d"), F.conv2d, c_conv("conv2d"))
    spy((F, "interpolate"), F.interpolate, lambda *a, **k: calls.__setitem__("interp", calls["interp"] + 1))
    spy((tap, "rms_norm_taps"), tap.rms_norm_taps, lambda *a, **k: calls.__setitem__("rms_taps", calls["rms_taps"] + 1))
    spy((tap, "tap_sum"), tap.tap_sum, lambda *a, **k: calls.__setitem__("tap_sum", calls["tap_sum"] + 1))
    vae = fused21["cl"]
    out, st = decode(vae, z21, 2)
    assert (out - ref21).abs().max().item() <= 1e-4
    steps = 3
    n_attn = sum(type(m).__name__ == "WanAttentionBlock" for m in vae.decoder.modules())
    # the head's norm_out + conv_out: one norm+GEMM kernel and one tap sum per call
    assert st["conv_taps"] == calls["rms_taps"] == calls["tap_sum"] == steps
    # the attention norm runs its own (silu=False) kernel
    assert calls["rms"] == st["norm_kernel"] - st["conv_taps"] + n_attn * steps
    assert calls["rms_out"] == st["norm_kernel"] - st["conv_taps"]  # every residual-block norm wrote into its conv buffer
    # + one epilogue (proj's bias + residual) per chunked attention
    assert st["attention_chunked"] == n_attn * steps
    assert calls["br"] == st["epilogue"] + st["interleave_upsample"] + st["upsample_kernel"] + st["attention_chunked"]
    # every block's output formed once: by its epilogue, or in the next norm's pass (also the head's)
    assert st["residual_in_norm"] == _deferred(vae) * steps and st["fused_blocks"] == st["epilogue"] + _deferred(vae) * steps
    assert calls["br_up"] == st["upsample_fused"] + st["interleave_upsample"] + st["upsample_kernel"]
    assert calls["conv3d_nobias"] + calls["conv2d_nobias"] == st["bias_folded"]
    assert calls["conv3d_bias"] == steps  # post_quant_conv keeps its bias (conv_out's is added by the tap sum)
    # attention's 1x1 convs run as GEMMs (to_qkv with its bias, proj's in the epilogue); the resample convs run
    # without their biases
    assert calls["conv2d_bias"] == 0
    assert calls["interp"] == 0


def test_wan22_fused_batch2_channels_last():
    torch.manual_seed(0)
    stock = build_model(get_family("wan22"), base_dim=8, decoder_base_dim=8)
    z = torch.randn(2, 48, 5, 2, 2, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = stock.decode(z).sample
    assert (ref.abs() < 0.99).float().mean() > 0.5
    vae = build_model(get_family("wan22"), base_dim=8, decoder_base_dim=8)
    vae.load_state_dict(stock.state_dict())
    fused_norms.apply(vae)
    fused_epilogues.apply(vae)
    _cl_weights(vae)
    n_blocks, n_sc, n_up3, n_up2 = _structure(vae)
    for chunk in (1, 2, 3):
        out, st = decode(vae, z, chunk)
        err = (out - ref).abs().max().item()
        assert err <= 1e-4, (chunk, err)
        steps = len(video.chunk_schedule(5, chunk))
        assert st["fused_blocks"] == n_blocks * steps
        # + one (x + conv bias) + DupUp3D epilogue per upsampling residual up block
        assert st["epilogue"] + st["residual_in_norm"] == (n_blocks + n_up3 + n_up2) * steps
        assert st["residual_in_norm"] == _deferred(vae) * steps  # (its 12-channel head stages through the norm)
        assert st["upsample_fused"] == n_up2 * steps


def test_frame_group_fallbacks_exact(fused21, z21, ref21, monkeypatch):
    """Upsampled tensors over the limit take _resample's frame-grouped path on a materialized block output (with
    the upsample kernel); Conv3d over temporal windows without bias; both exact."""
    monkeypatch.setattr(wan_ops, "SPLIT_ELEMS", 2000)
    monkeypatch.setattr(wan_ops, "INT32_ELEMS", 20000)
    for layout in ("cf", "cl"):
        out, st = decode(fused21[layout], z21, None)
        assert (out - ref21).abs().max().item() <= 1e-4
        assert "upsample_fused" not in st and "interleave_upsample" not in st and st["upsample_kernel"] > 0
        assert st["fused_blocks"] == _structure(fused21[layout])[0]


def test_fallbacks(stock21, fused21, z21, ref21, monkeypatch):
    # stock modules under the interpreter: auto mode keeps the torch path (bit-identical to fused=False)
    out, st = decode(stock21, z21, 2)
    assert st == {} and torch.equal(out, video.decode_video(stock21, z21, 2, fused=False))
    # ... fused=True runs stock WanRMS_norm + SiLU blocks on the kernels as well
    out, st = decode(stock21, z21, 2, fused=True)
    assert st["fused_blocks"] == 3 * _structure(stock21)[0] and (out - ref21).abs().max().item() <= 1e-4
    vae = fused21["cl"]
    # $VAEOPT_VIDEO_FUSED=0 switches it off; an explicit argument wins
    monkeypatch.setenv(wan_ops.FUSED_ENV, "0")
    assert decode(vae, z21, 3)[1] == {}
    assert decode(vae, z21, 3, fused=True)[1]["fused_blocks"] > 0
    monkeypatch.delenv(wan_ops.FUSED_ENV)
    # a hook on one block's norm: that block takes the torch path (its hook sees its call), the others stay fused
    blk = vae.decoder.up_blocks[1].resnets[0]
    seen = []
    h = blk.norm1.register_forward_hook(lambda m, i, o: seen.append(1))
    try:
        out, st = decode(vae, z21, 3)
    finally:
        h.remove()
    assert len(seen) == 2 and st["fused_blocks"] == 2 * (_structure(vae)[0] - 1)
    assert st["bias_materialized"] == 2  # the upsample conv's bias it cannot fold, added before it
    assert (out - ref21).abs().max().item() <= 1e-4
    # no kernel backend (CPU without the interpreter): auto falls back to torch ops, fused=True says why
    import vaeopt.kernels.common

    monkeypatch.setattr(vaeopt.kernels.common, "interpreting", lambda: False)
    out, st = decode(vae, z21, 3)
    assert st == {} and (out - ref21).abs().max().item() <= 1e-4
    with pytest.raises(VaeoptError, match="cannot run"):
        video.decode_video(vae, z21, 3, fused=True)


@pytest.fixture
def rne_bf16(monkeypatch):
    """Triton's interpreter casts fp32 -> bf16 by truncation (toward zero); compiled kernels round to nearest even.
    Along the residual stream every block's epilogue rounds once more, so truncation drifts (~5x diffusers' bf16
    error on the tiny model) where rounding does not: emulate the GPU's rounding for the bf16 checks."""
    import numpy as np
    import triton.language as tl

    try:
        from triton.runtime import interpreter
        builder, handle = interpreter.InterpreterBuilder, interpreter.TensorHandle
        orig = builder.cast_impl
    except (ImportError, AttributeError):
        pytest.skip("this triton's interpreter cannot be patched to round bf16 casts")

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            t = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return handle(t.view(torch.int16).numpy().view(np.uint16), dst_type.scalar)
        return orig(self, src, dst_type)

    monkeypatch.setattr(builder, "cast_impl", cast_impl)


def test_bf16_fidelity(stock21, samples_dir, z21, rne_bf16):
    """bf16: the fused path (fp32 sums inside the kernels, one rounding) is as close to the fp32 decode as
    diffusers' bf16 decode is."""
    z = z21[:, :, :3]
    with torch.no_grad():
        ref32 = stock21.decode(z).sample
        s16 = _tiny_wan21(samples_dir, fused=False).to(torch.bfloat16)
        ref16 = s16.decode(z.bfloat16()).sample.float()
    v16 = _tiny_wan21(samples_dir, channels_last=True).to(torch.bfloat16)
    out16, st = decode(v16, z.bfloat16(), 2)
    assert st["fused_blocks"] > 0
    e_torch = (ref16 - ref32).abs().max().item()
    e_ours = (out16.float() - ref32).abs().max().item()
    assert e_ours <= 2 * e_torch + 1e-2, (e_ours, e_torch)
    assert (out16.float() - ref16).abs().mean().item() < 1e-2


def test_estimate_fused(fused21):
    """The dry run also covers the fused path (results' storage only); at wan21-480p K=4 it needs less memory than
    the torch path (no norm temporaries, no separate upsample / interleave tensors)."""
    small = video.estimate_chunk_bytes(fused21["cf"], (1, 16, 9, 6, 8), 2, torch.float32, fused=True)
    assert small > 0
    with torch.device("meta"):
        full = build_model(get_family("wan21"))
    shape = (1, 16, 21, 60, 104)
    torch_path = video.estimate_chunk_bytes(full, shape, 4, torch.bfloat16, channels_last=True)
    fused_path = video.estimate_chunk_bytes(full, shape, 4, torch.bfloat16, channels_last=True, fused=True)
    assert 0.8 * torch_path < fused_path <= torch_path, (fused_path / 2**30, torch_path / 2**30)


def test_estimate_fused_holds_when_frames_keep_their_arguments():
    """The fused path lets its large temporaries go itself rather than by unbinding names: the same peak when every
    frame's arguments stay alive until it returns (as under a profiler, or torch's frame hook for the rest of a
    process in which a torch.compile failed)."""
    import sys

    from vaeopt.engine import memory

    with torch.device("meta"):
        full = build_model(get_family("wan21"))

    def peak():
        memory.estimate_peak.cache_clear()
        return video.estimate_chunk_bytes(full, (1, 16, 9, 60, 104), 4, torch.bfloat16, channels_last=True,
                                          fused=True)

    plain = peak()
    sys.setprofile(lambda frame, event, arg: frame.f_locals if event == "call" else None)
    try:
        held = peak()
    finally:
        sys.setprofile(None)
        memory.estimate_peak.cache_clear()
    assert held == plain


# --- epilogue kernel: out= and groups= (what the fused path uses) ------------------------------------------------


def _cl(x):
    return x.movedim(1, -1).contiguous().movedim(-1, 1)


def _ref(h, b, r, rb, up, groups):
    sh = (1, -1) + (1,) * (h.dim() - 2)
    y = h.double() + (0 if b is None else b.double().reshape(sh))
    if r is not None:
        y = (r.double() + (0 if rb is None else rb.double().reshape(sh))) + y
    if up:
        y = F.interpolate(y, scale_factor=2.0, mode="nearest")
    return y.reshape(y.shape[0] * groups, y.shape[1] // groups, *y.shape[2:])


@pytest.mark.parametrize("layout", ["cf", "cl"])
@pytest.mark.parametrize("up", [False, True], ids=["plain", "up2x"])
@pytest.mark.parametrize("groups", [1, 2])
def test_epilogue_out_and_groups(layout, up, groups):
    from vaeopt.kernels.epilogue import bias_residual

    g = torch.Generator().manual_seed(groups + 2 * up)
    h, r = torch.randn(3, 6, 5, 7, generator=g), torch.randn(3, 6, 5, 7, generator=g)
    b, rb = torch.randn(6, generator=g), torch.randn(6, generator=g)
    if layout == "cl":
        h = _cl(h)
    ref = _ref(h, b, r, rb, up, groups)
    y = bias_residual(h, b, r, upsample2x=up, residual_bias=rb, groups=groups, tile=64)
    assert y.shape == ref.shape and (y - ref).abs().max().item() < 1e-5
    assert y.is_contiguous() if layout == "cf" else y.is_contiguous(memory_format=torch.channels_last)
    # into the middle of a larger buffer (other sample stride): neighbours untouched
    big = torch.full((ref.shape[0] + 2, *ref.shape[1:]), 7.0)
    big = _cl(big) if layout == "cl" else big
    ret = bias_residual(h, b, r, upsample2x=up, residual_bias=rb, groups=groups, out=big[1:-1], tile=64)
    assert ret.data_ptr() == big[1:-1].data_ptr()
    assert (big[1:-1] - ref).abs().max().item() < 1e-5 and (big[0] == 7).all() and (big[-1] == 7).all()
    # an out in the other layout kind: filled through a copy, same values
    other = torch.empty(ref.shape)
    other = other if layout == "cl" else _cl(other)
    assert torch.equal(bias_residual(h, b, r, upsample2x=up, residual_bias=rb, groups=groups, out=other), y)


def test_epilogue_out_5d_buffer_and_errors():
    """A causal conv input buffer (N, C, 2 + T, H, W): the epilogue writes frames 2.. (channels-first: the channel
    stride spans all frames)."""
    from vaeopt.kernels.epilogue import bias_residual

    g = torch.Generator().manual_seed(3)
    for fmt in (torch.contiguous_format, torch.channels_last_3d):
        h = torch.randn(2, 4, 3, 5, 6, generator=g).contiguous(memory_format=fmt)
        r, b = torch.randn(2, 4, 3, 5, 6, generator=g), torch.randn(4, generator=g)
        buf = torch.zeros(2, 4, 5, 5, 6).contiguous(memory_format=fmt)
        bias_residual(h, b, r, out=buf[:, :, 2:], tile=64)
        assert (buf[:, :, 2:] - _ref(h, b, r, None, False, 1)).abs().max().item() < 1e-5
        assert (buf[:, :, :2] == 0).all()
    with pytest.raises(ValueError, match="groups"):
        bias_residual(h, b, r, groups=3)
    with pytest.raises(ValueError, match="out has shape"):
        bias_residual(h, b, r, out=torch.empty(2, 4, 4, 5, 6))


@pytest.mark.gpu
def test_gpu_tiny_wan21_fused(samples_dir):
    """Compiled kernels: fp32 (TF32 off) fused == diffusers for chunks 1, 2, 3 on the full real latents; bf16 as
    close to the fp32 decode as diffusers' bf16 decode."""
    lat = torch.load(samples_dir / "tiny_wan_video_latents.pt")
    z = lat["coffee_zoom"].float().cuda()
    stock = _tiny_wan21(samples_dir, fused=False, device="cuda")
    vae = _tiny_wan21(samples_dir, channels_last=True, device="cuda")
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            ref = stock.decode(z).sample
        for chunk in (1, 2, 3):
            out, st = decode(vae, z, chunk)
            assert st["fused_blocks"] == 14 * len(video.chunk_schedule(5, chunk))
            assert (out - ref).abs().max().item() <= 1e-4, chunk
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    with torch.no_grad():
        ref16 = stock.to(torch.bfloat16).decode(z.bfloat16()).sample.float()
    out16, st = decode(vae.to(torch.bfloat16), z.bfloat16(), 4)
    e_torch = (ref16 - ref).abs().max().item()
    e_ours = (out16.float() - ref).abs().max().item()
    assert st["fused_blocks"] > 0 and e_ours <= 2 * e_torch + 1e-2, (e_ours, e_torch)
