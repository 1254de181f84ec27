"""Upsampler convs as four 2x2 phase convs (vaeopt/kernels/upconv.py, stages/upsample_conv.py).

The rewrite is the same linear map: in fp64 it equals conv3x3(upsample2x(x)) to rounding; the interleave kernel
(Triton interpreter on CPU) equals the torch copies bitwise. In the decoders: the image decoder (after fused_norms +
fused_epilogues: the up-blocks' last resnets then write low-resolution outputs), the tiled image decode, and Wan's
chunk decoder (fused and torch paths, chunk sizes 1-3) decode what the stock model decodes (fp32, 1e-4).
"""

import contextlib
import importlib

import pytest
import torch
import torch.nn.functional as F

from vaeopt import video
from vaeopt.families import build_model, get_family
from vaeopt.kernels import triton_available
from vaeopt.kernels.upconv import interleave_phases, phase_weights, upconv2x
from vaeopt.pipeline import Options
from vaeopt.stage_table import DeviceInfo, decide_stages
from vaeopt.stages import Hint, fused_epilogues, fused_norms, upsample_conv
from vaeopt.engine.wan_ops import phase_ok

from kernel_refs import upconv2x_reference  # noqa: E402
from test_video_fused import decode as _decode_stats  # noqa: E402 (decode_video + its chunk decoder's stats)
from test_video_tiling import _wan21 as _tiny_wan21  # noqa: E402 (the trained tiny Wan 2.1, fp32)

CPU = torch.device("cpu")


def _need_triton():
    ok, why = triton_available("cpu")
    if not ok:
        pytest.skip(why)


@pytest.mark.parametrize("shape", [(2, 5, 7, 9), (1, 3, 1, 1), (1, 8, 4, 1)])
@pytest.mark.parametrize("layout", ["cf", "cl"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_phase_conv_is_upsample_then_conv(shape, layout, with_bias):
    g = torch.Generator().manual_seed(0)
    n, ci, h, w = shape
    co = 6
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    wt = torch.randn(co, ci, 3, 3, generator=g, dtype=torch.float64)
    b = torch.randn(co, generator=g, dtype=torch.float64) if with_bias else None
    if layout == "cl":
        x = x.contiguous(memory_format=torch.channels_last)
    y = upconv2x(x, phase_weights(wt), b)
    ref = upconv2x_reference(x, wt, b)
    assert y.shape == (n, co, 2 * h, 2 * w)
    assert (y - ref).abs().max().item() < 1e-12
    if h * w > 1:  # (a 1x1 input is both layouts at once)
        assert y.is_contiguous(memory_format=torch.channels_last) == (layout == "cl")


def test_phase_weights_layout_and_errors():
    wt = torch.arange(9.0).view(1, 1, 3, 3)  # rows [0 1 2], [3 4 5], [6 7 8]
    w4 = phase_weights(wt)
    assert w4.shape == (4, 1, 2, 2)
    # phase (a=0, b=0): rows [w0, w1 + w2] x cols [w0, w1 + w2]
    assert w4[0, 0].tolist() == [[0.0, 1 + 2], [3 + 6, 4 + 5 + 7 + 8]]
    # phase (a=1, b=1): rows [w0 + w1, w2] x cols [w0 + w1, w2]
    assert w4[3, 0].tolist() == [[0 + 1 + 3 + 4, 2 + 5], [6 + 7, 8.0]]
    assert w4.sum().item() == 4 * wt.sum().item()  # every tap lands in each phase once
    bf = phase_weights(torch.randn(4, 3, 3, 3).bfloat16())
    assert bf.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="3, 3"):
        phase_weights(torch.randn(2, 2, 5, 5))
    with pytest.raises(ValueError):
        upconv2x(torch.randn(1, 2, 3, 3), torch.randn(3, 2, 2, 2))  # 3 is not 4 * Cout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interleave_kernel_equals_torch_copies(dtype):
    _need_triton()
    g = torch.Generator().manual_seed(1)
    p = torch.randn(2, 4 * 6, 4, 5, generator=g).to(dtype).contiguous(memory_format=torch.channels_last)
    b = torch.randn(6, generator=g).to(dtype)
    for bias in (None, b):
        y = interleave_phases(p, bias)  # NHWC: the Triton kernel (interpreted)
        ref = interleave_phases(p.contiguous(), bias)  # NCHW: the torch copies
        assert y.is_contiguous(memory_format=torch.channels_last) and y.shape == (2, 6, 6, 8)
        if bias is None or dtype == torch.float32:
            assert torch.equal(y, ref)
        else:  # the interpreter's fp32 -> bf16 cast may round the other way (1 ulp); the GPU rounds to nearest even
            torch.testing.assert_close(y, ref, atol=0, rtol=2 ** -7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interleave_takes_the_next_norms_statistics(dtype, monkeypatch):
    """stats_groups: the same output as the plain interleave kernel, and the noted partials are the output's moments
    per (sample, group) with max/min bounds that hold (several chunks per sample, a ragged last one)."""
    _need_triton()
    gn = importlib.import_module("vaeopt.kernels.group_norm_silu")
    monkeypatch.setattr(gn, "_stats_cl_defaults", lambda C, dev: (4 * 8, 4, 3, 2))
    g = torch.Generator().manual_seed(2)
    p = (torch.randn(2, 4 * 8, 4, 6, generator=g) * 2 + 3).to(dtype).contiguous(memory_format=torch.channels_last)
    b = torch.randn(8, generator=g).to(dtype)
    y = interleave_phases(p, b, stats_groups=4)
    assert torch.equal(y, interleave_phases(p, b))
    part = gn.noted_partials(y, 4)
    assert part is not None and part.shape == (5, 8, part.shape[2]) and part.shape[2] > 1
    n, mean, m2 = gn.merge_partials(part[:3])
    ref = y.double().reshape(2, 4, -1)
    assert torch.equal(n, torch.full((8,), float(ref.shape[-1]), dtype=torch.float64))
    torch.testing.assert_close(mean, ref.mean(-1).reshape(-1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(m2, (ref.var(-1, unbiased=False) * ref.shape[-1]).reshape(-1), rtol=1e-5, atol=1e-5)
    assert (part[3].amax(1).double() >= ref.amax(-1).reshape(-1) - 1e-6).all()
    assert (part[4].amin(1).double() <= ref.amin(-1).reshape(-1) + 1e-6).all()
    assert gn.noted_partials(interleave_phases(p.contiguous(), b, stats_groups=4), 4) is None  # torch copies: none


# ---- the image decoder ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_kl():
    torch.manual_seed(0)
    return build_model(get_family("sdxl"), block_out_channels=[32, 32, 64, 64], norm_num_groups=8).eval()


def _spy(monkeypatch, mod, name, record):
    real = getattr(mod, name)

    def wrapped(*a, **k):
        record(*a, **k)
        return real(*a, **k)

    monkeypatch.setattr(mod, name, wrapped)


@contextlib.contextmanager
def _stages(model):
    """fused_norms + fused_epilogues applied for the body of the with-block (upsample_conv as the body applies it);
    everything reverted after."""
    try:
        fused_norms.apply(model)
        assert fused_epilogues.apply(model).status == "applied"
        yield model
    finally:
        upsample_conv.revert(model)
        fused_epilogues.revert(model)
        fused_norms.revert(model)


def test_image_decoder_phase_convs(small_kl, monkeypatch):
    _need_triton()
    model = small_kl
    z = torch.randn(1, 4, 6, 5, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model.decode(z).sample
    assert upsample_conv.apply(model, device=CPU, force=True).status == "skipped"  # needs fused_epilogues
    with _stages(model):
        # auto on the CPU (the stage table's rule): the stock upsampler stays
        auto = {r.name: r for r in decide_stages(Options(triton="on"), get_family("sd15"), torch.float32,
                                                 DeviceInfo("cpu", triton=(True, "")))}["upsample_conv"]
        assert auto.status == "skipped" and "CPU" in auto.detail
        # an image VAE needs the fused path for it, so the hint names the interpreter and triton on too (a new
        # user followed the bare '--upsample-conv on forces it' and got 'needs fused_epilogues')
        assert "TRITON_INTERPRET=1" in auto.detail
        assert auto.hints == ((Hint("triton", "on"), Hint("upsample_conv", "on")),)
        r = upsample_conv.apply(model, device=CPU, force=True)
        assert r.status == "applied" and r.data == {"layers": 3, "shapes": ["32->32", "64->64"]}
        assert "4/9 of their FLOPs" in r.detail
        epi = importlib.import_module("vaeopt.kernels.epilogue")
        ups, k2 = [], []
        _spy(monkeypatch, epi, "bias_residual", lambda *a, **k: ups.append(bool(k.get("upsample2x"))))
        _spy(monkeypatch, F, "conv2d", lambda x, w, *a, **k: k2.append(tuple(w.shape[-2:]) == (2, 2)))
        _spy(monkeypatch, F, "interpolate", lambda *a, **k: pytest.fail("no interpolate on the phase path"))
        with torch.no_grad():
            out = model.decode(z).sample
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        assert sum(k2) == 3, "each upsampler ran one 2x2 phase conv"
        assert not any(ups), "no resnet wrote an upsampled output"
        upsample_conv.revert(model)
        ups.clear(), k2.clear()
        with torch.no_grad():
            out = model.decode(z).sample
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        assert sum(k2) == 0 and sum(ups) == 3, "reverted: the epilogues write the upsample again"


def test_tiled_image_decode_phase_convs(small_kl):
    _need_triton()
    from vaeopt.tiling import tiled_decode

    model = small_kl
    z = torch.randn(1, 4, 9, 7, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model.decode(z).sample
        with _stages(model):
            upsample_conv.apply(model, device=CPU, force=True)
            out, info = tiled_decode(model, z, tile=(4, 7), kernels=True, return_info=True)
    assert info["upsample_phase"] == 3 * info["tiles"] // info["passes"]  # every tile of the 3 upsampler passes
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


# ---- Wan ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "fused"])
def test_wan_chunk_decoder_phase_convs(samples_dir, fused):
    if fused:
        _need_triton()
    vae = _tiny_wan21(samples_dir)
    z = torch.load(samples_dir / "tiny_wan_video_latents.pt")["coffee_zoom"].float()[:, :, :, 10:12, 20:22].contiguous()
    with torch.no_grad():
        ref = vae.decode(z).sample
    r = upsample_conv.apply(vae, device=CPU, force=True)
    n_rs = sum(type(m).__name__ == "WanResample" and m.mode.startswith("upsample") for m in vae.decoder.modules())
    assert r.status == "applied" and r.data["layers"] == n_rs == 3
    if fused:
        fused_norms.apply(vae)
        fused_epilogues.apply(vae)
    for chunk in (1, 2, 3):
        out, st = _decode_stats(vae, z, chunk)
        steps = len(video.chunk_schedule(z.shape[2], chunk))
        assert (out - ref).abs().max().item() <= 1e-4, chunk
        assert st["upsample_phase"] == n_rs * steps
        assert "upsample_fused" not in st and "interleave_upsample" not in st
    upsample_conv.revert(vae)
    out, st = _decode_stats(vae, z, 2)
    assert "upsample_phase" not in st and (out - ref).abs().max().item() <= 1e-4


def test_no_candidates_and_wrong_dtype_fall_back(samples_dir):
    """A decoder without nearest-2x + 3x3 upsamplers is skipped with the reason; a call whose activations are not in
    the weights' dtype takes the plain composition."""
    tiny = build_model(get_family("taesd"))  # AutoencoderTiny: its upsamplers are not Upsample2D / WanResample
    r = upsample_conv.apply(tiny, device=CPU, force=True)
    assert r.status == "skipped"
    vae = _tiny_wan21(samples_dir)
    upsample_conv.apply(vae, device=CPU, force=True)
    conv = next(m.resample[1] for m in vae.decoder.modules() if type(m).__name__ == "WanResample"
                and m.mode.startswith("upsample"))
    x = torch.randn(2, conv.in_channels, 3, 4)
    assert phase_ok(conv, None, x) and not phase_ok(conv, None, x.double())
    assert not phase_ok(conv, torch.nn.Upsample(scale_factor=3.0), x)


@pytest.mark.gpu
def test_gpu_phase_conv_bf16_and_interleave():
    """On the GPU: the interleave kernel equals the torch copies bitwise (bf16, with bias), and the bf16 phase conv's
    error vs an fp32 reference stays within 1.5x of the plain bf16 composition's."""
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 64, 40, 52, generator=g).to(dev, torch.bfloat16).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(32, 64, 3, 3, generator=g) / 24).to(dev, torch.bfloat16)
    b = torch.randn(32, generator=g).to(dev, torch.bfloat16)
    p = F.conv2d(x, phase_weights(w), None, padding=1)
    assert torch.equal(interleave_phases(p, b), interleave_phases(p.contiguous(), b))
    prev = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        ref = upconv2x_reference(x.float(), w.float(), b.float())
        err_phase = (upconv2x(x, phase_weights(w), b).float() - ref).norm() / ref.norm()
        err_plain = (upconv2x_reference(x, w, b).float() - ref).norm() / ref.norm()
    finally:
        torch.backends.cudnn.allow_tf32 = prev
    assert err_phase <= 1.5 * err_plain, (err_phase, err_plain)


# ---- e4m3 phase convs on the TMA kernel (FP8 level 3's upsamplers) --------------------------------------------------

def _need_tma():
    _need_triton()
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no host-side tensor descriptors")


def _e4m3_case(n=2, ci=32, co=48, h=5, w=7, seed=0, dev="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, ci, h, w, generator=g) * torch.linspace(0.5, 4.0, n).view(n, 1, 1, 1)
    wt = torch.randn(co, ci, 3, 3, generator=g) / (9 * ci) ** 0.5
    b = torch.randn(co, generator=g) * 0.1
    return (x.to(dev).contiguous(memory_format=torch.channels_last), wt.to(dev), b.to(dev))


def _dequantized_reference(x8, s, pw4, b):
    """The same phase convs in fp32 on the dequantized operands, interleaved."""
    wq = (pw4.w.float() * pw4.scale[:, None]).reshape(pw4.cout, 2, 2, -1).permute(0, 3, 1, 2)
    xd = x8.float() * s.view(-1, 1, 1, 1)
    return interleave_phases(F.conv2d(xd, wq.to(xd.device), None, padding=1), b.float())


@pytest.mark.parametrize("cfg_args", [(2, 4, 16, 32, 16, 4, 1, 0), (4, 4, 16, 16, 0, 4, 1, 0),
                                      (1, 8, 16, 16, 0, 4, 1, 16)])
def test_e4m3_phase_convs_store_each_phase_in_place(cfg_args):
    """Interpreter: the four phases, each a 2x2 conv with its own top/left padding, stored into the strided places
    of the upsampled output in one launch: equal to the dequantized operands' conv, and close to
    upsample + conv3x3 in fp32. Tiles overhang the 5x7 input; one config splits Cin 32 as 16 + 16."""
    _need_tma()
    from vaeopt.kernels.act_quant import quantize_e4m3_per_sample
    from vaeopt.kernels.tma_conv import TmaConfig
    from vaeopt.kernels.upconv import phase_weights_8bit, upconv2x_8bit

    x, w, b = _e4m3_case()
    x8, s = quantize_e4m3_per_sample(x)
    pw4 = phase_weights_8bit(w)
    assert pw4.kmajor and pw4.kernel == (1, 2, 2) and pw4.cout == 4 * 48 and pw4.scale.shape == (4 * 48,)
    y = upconv2x_8bit(x8, s, pw4, b, out_dtype=torch.float32, config=TmaConfig(*cfg_args))
    assert y.shape == (2, 48, 10, 14) and y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y, _dequantized_reference(x8, s, pw4, b), rtol=1e-5, atol=1e-5)
    ref = upconv2x_reference(x, w, b)
    assert ((y - ref).norm() / ref.norm()) < 0.06  # e4m3 operands: ~3.6% here
    yb = upconv2x_8bit(x8, s, pw4, None, out_dtype=torch.bfloat16, config=TmaConfig(*cfg_args))
    torch.testing.assert_close(yb.float(), y - b.view(1, -1, 1, 1), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("cfg_args", [(2, 4, 16, 32, 16, 4, 1, 0), (1, 8, 16, 16, 0, 4, 1, 16)])
def test_int8_phase_convs_match_dequantized_reference(cfg_args):
    """Symmetric int8 (x = 0 is q = 0, so TMA's zero fill is the conv's padding; no zero-point term): the phases on
    int8 operands equal the dequantized operands' conv, closer to fp32 than e4m3 on the same input."""
    _need_tma()
    from vaeopt.kernels.act_quant import quantize_e4m3_per_sample, quantize_int8_per_sample
    from vaeopt.kernels.tma_conv import TmaConfig
    from vaeopt.kernels.upconv import phase_weights_8bit, upconv2x_8bit

    x, w, b = _e4m3_case()
    q, s = quantize_int8_per_sample(x)
    pw4 = phase_weights_8bit(w, torch.int8)
    assert pw4.w.dtype == torch.int8 and pw4.kernel == (1, 2, 2) and pw4.tapsum is None
    y = upconv2x_8bit(q, s, pw4, b, out_dtype=torch.float32, config=TmaConfig(*cfg_args))
    torch.testing.assert_close(y, _dequantized_reference(q, s, pw4, b), rtol=1e-5, atol=1e-5)
    ref = upconv2x_reference(x, w, b)
    x8, s8 = quantize_e4m3_per_sample(x)
    y8 = upconv2x_8bit(x8, s8, phase_weights_8bit(w), b, out_dtype=torch.float32, config=TmaConfig(*cfg_args))
    assert (y - ref).norm() < 0.5 * (y8 - ref).norm()
    with pytest.raises(ValueError, match="int8 K-major 2x2 phase kernels"):  # formats must pair
        upconv2x_8bit(q, s, phase_weights_8bit(w), b, config=TmaConfig(*cfg_args))


def test_e4m3_phase_convs_refuse_bad_arguments():
    _need_tma()
    from vaeopt.kernels.act_quant import quantize_e4m3_per_sample
    from vaeopt.kernels.upconv import phase_weights_8bit, upconv2x_8bit

    x, w, b = _e4m3_case(ci=16, co=16)
    x8, s = quantize_e4m3_per_sample(x)
    pw4 = phase_weights_8bit(w)
    with pytest.raises(ValueError, match="e4m3"):
        upconv2x_8bit(x, s, pw4, b)
    with pytest.raises(ValueError, match="phase kernels"):
        upconv2x_8bit(x8, s, phase_weights_8bit(w[:, :8]), b)
    from vaeopt.kernels.tma_conv import TmaConfig
    with pytest.raises(ValueError, match="column tile"):  # a store box would reach into the other column phase
        upconv2x_8bit(x8, s, pw4, b, config=TmaConfig(2, 4, 16, 32, 0, 4, 1))
    with pytest.raises(ValueError, match="x_scale"):
        upconv2x_8bit(x8, 0.5, pw4, b)
    with pytest.raises(ValueError, match="no TMA tile"):  # 16 channels: no measured tile
        upconv2x_8bit(x8, s, pw4, b)


def test_fp8_upsampler_runs_only_where_marked_and_whole_image(small_kl, monkeypatch):
    """upsample_conv.run takes the e4m3 path only for a conv that FP8 level 3 marked, only from the whole-image
    Upsample2D forward (fp8=True: the tiler keeps bf16) and only where the TMA kernel has a tile."""
    _need_tma()
    from vaeopt.kernels import tma_conv, upconv
    from vaeopt.kernels.tma_conv import TmaConfig

    model = small_kl
    z = torch.randn(1, 4, 6, 5, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model.decode(z).sample
    with _stages(model):
        upsample_conv.apply(model, device=CPU, force=True)
        convs = upsample_conv._image_candidates(model)
        calls = []
        real = upconv.upconv2x_8bit
        monkeypatch.setattr(upconv, "upconv2x_8bit", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
        with torch.no_grad():
            out = model.decode(z).sample
        assert calls == [] and torch.allclose(out, ref, atol=1e-4)  # not marked: bf16 phase convs
        for c in convs:
            c._vaeopt_fp8conv = True
        with torch.no_grad():
            model.decode(z)
        assert calls == [], "no TMA here (CPU): marked convs stay on the plain phase convs"
        monkeypatch.setattr(tma_conv, "available", lambda d: True)
        monkeypatch.setattr(tma_conv, "tuned_upconv_config", lambda ci, co, w=None: TmaConfig(8, 8, 32, co, 0, 4, 1))
        x = torch.randn(1, convs[0].in_channels, 4, 4).contiguous(memory_format=torch.channels_last)
        upsample_conv.run(convs[0], x)  # default fp8=False: what the tiler calls
        assert calls == []
        with torch.no_grad():
            out8 = model.decode(z).sample
        assert len(calls) == len(convs)
        from vaeopt.fidelity import psnr
        assert 25 < psnr(out8, ref) < 80, psnr(out8, ref)  # random weights; lossy but the same image


@pytest.mark.gpu
def test_gpu_e4m3_phase_convs_on_the_measured_tile():
    """sm_90: the tuned tile (256 ch) equals the dequantized operands' conv, and stays near upsample + conv3x3."""
    from vaeopt.kernels import tma_conv
    from vaeopt.kernels.act_quant import quantize_e4m3_per_sample
    from vaeopt.kernels.upconv import phase_weights_8bit, upconv2x_8bit

    if not tma_conv.available(torch.device("cuda")):
        pytest.skip("the TMA conv kernel's tiles were measured on sm_90 only")
    x, w, b = _e4m3_case(n=2, ci=256, co=256, h=48, w=40, dev="cuda")
    x = x.to(torch.bfloat16)
    x8, s = quantize_e4m3_per_sample(x)
    pw4 = phase_weights_8bit(w)
    y = upconv2x_8bit(x8, s, pw4, b)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 256, 96, 80)
    assert y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y.float(), _dequantized_reference(x8, s, pw4, b), rtol=2e-2, atol=2e-2)
    prev = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        ref = upconv2x_reference(x.float(), w, b)
    finally:
        torch.backends.cudnn.allow_tf32 = prev
    assert (y.float() - ref).norm() / ref.norm() < 0.06
