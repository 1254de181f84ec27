"""The TMA implicit-GEMM conv (vaeopt/kernels/tma_conv.py) against torch's conv: under the interpreter on CPU (its
tensor-descriptor loads zero-fill out-of-bounds boxes, negative corners included, as the hardware does) and, marked
gpu, on an sm_90 GPU, including conv_igemm's dispatch of e4m3 layers to it."""

import pytest
import torch

# the same random layers and error measure as the pointer kernel's tests, and its backend fixture (autouse: the
# interpreter on CPU, the GPU for gpu tests)
from test_kernel_conv import _backend, _case, _rel  # noqa: F401

from kernel_refs import conv_reference  # noqa: E402

K = pytest.importorskip("vaeopt.kernels.conv")
TC = pytest.importorskip("vaeopt.kernels.tma_conv")
pytest.importorskip("triton.tools.tensor_descriptor", reason="this Triton has no host-side tensor descriptors")


@pytest.mark.parametrize("shape,cfg", [
    # causal Conv3d, Cout 48 as 32 + 16 accumulators, 2x4 tiles that overhang a 5x7 frame on two sides
    ((1, 32, 48, 2, 5, 7, 3), TC.TmaConfig(2, 4, 16, 32, 16, 4, 1)),
    # batch 2: each sample's history frames are skipped; Cin 48 as a 32- and a 16-channel box per tap
    ((2, 48, 48, 2, 5, 7, 3), TC.TmaConfig(2, 4, 32, 32, 16, 4, 1, bk1=16)),
    # Conv2d, batch = frames, three column tiles (Cout 48 / 16)
    ((3, 16, 48, 1, 6, 9, None), TC.TmaConfig(4, 4, 16, 16, 0, 4, 1)),
    # one row per tile, wider than the frame
    ((1, 16, 16, 3, 3, 5, 3), TC.TmaConfig(1, 8, 16, 16, 0, 4, 1)),
])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_torch_fp32(shape, cfg, bias):
    x, w, b = _case(*shape)
    b = b if bias else None
    y = TC.conv_tma(x, K.pack_weight(w, kmajor=True), b, (1, 1), config=cfg)
    ref = conv_reference(x, w, b, (1, 1))
    assert y.shape == ref.shape
    mf = torch.channels_last if x.ndim == 4 else torch.channels_last_3d
    assert y.is_contiguous(memory_format=mf)
    assert _rel(y, ref) < 1e-5


def test_fp8_matches_dequantized_reference_and_pointer_kernel():
    """e4m3 operands, per-output-channel weight scales and a per-sample activation scale tensor: the same numbers as
    the pointer kernel (both accumulate exact products of e4m3 values in fp32) and close to the fp32 conv of the
    dequantized input."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 32, 4, 6, generator=g).contiguous(memory_format=torch.channels_last)
    w = torch.randn(32, 32, 3, 3, generator=g) * 0.1
    b = torch.randn(32, generator=g)
    xq, _ = K.quantize_activation(x)
    s = torch.tensor([0.02, 0.5])
    pw = K.pack_weight(w, K.E4M3)
    assert pw.kmajor
    y = TC.conv_tma(xq, pw, b, (1, 1), x_scale=s, config=TC.TmaConfig(2, 4, 16, 16, 16, 4, 1, bk1=16))
    y_ptr = K.conv_igemm(xq, pw, b, (1, 1), x_scale=s)
    assert y.dtype == torch.bfloat16
    assert torch.allclose(y.float(), y_ptr.float(), rtol=1e-2, atol=1e-3)
    wq = (pw.w.float() * pw.scale[:, None]).reshape(32, 3, 3, 32).permute(0, 3, 1, 2)  # dequantized weights
    ref = conv_reference(xq.float() * s.view(2, 1, 1, 1), wq, b, (1, 1))
    assert _rel(y, ref) < 1e-2


def _int8_inputs(N, C, H, W, seed):
    """A SiLU-like activation quantized as group_norm_silu_int8 does (255 levels over [-0.27847, max] per sample):
    (q, scale, zq, the dequantized x)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.nn.functional.silu(torch.randn(N, C, H, W, generator=g) * 2)
    hi = x.flatten(1).amax(1)
    s = (hi + 0.27847) / 254
    zq = (hi - 0.27847) / 2 / s
    q = torch.round(x / s.view(-1, 1, 1, 1) - zq.view(-1, 1, 1, 1)).clamp(-127, 127).to(torch.int8)
    q = q.contiguous(memory_format=torch.channels_last)
    return q, s, zq, (q.float() + zq.view(-1, 1, 1, 1)) * s.view(-1, 1, 1, 1)


@pytest.mark.parametrize("shape,cfg", [
    ((2, 32, 32, 5, 37), TC.TmaConfig(1, 16, 32, 32, 0, 4, 1)),  # row tiles: the edge-column branch
    ((1, 32, 48, 1, 16), TC.TmaConfig(1, 16, 32, 32, 16, 4, 1)),  # one row: top and bottom at once
    ((1, 32, 32, 3, 3), TC.TmaConfig(2, 8, 16, 16, 16, 4, 1)),  # 2-row tiles: per-pixel terms, all four corners
    ((2, 16, 16, 1, 1), TC.TmaConfig(2, 4, 16, 16, 0, 4, 1)),  # a 1x1 image: only the centre tap is inside
])
def test_int8_with_zero_point_matches_dequantized_reference(shape, cfg):
    """int8 operands and an activation zero point (x ~= s * (q + zq)): the padding reads q = 0, which is x = 0 only
    without the zero point, so the epilogue adds zq times the weights of the in-image taps (conv.tap_sums). Equal to
    the fp32 conv of the dequantized operands at every pixel, borders and corners included."""
    N, C, CO, H, W = shape
    q, s, zq, xd = _int8_inputs(N, C, H, W, 7)
    w = torch.randn(CO, C, 3, 3, generator=torch.Generator().manual_seed(8)) * 0.1
    b = torch.randn(CO, generator=torch.Generator().manual_seed(9))
    pw = K.pack_weight(w, torch.int8)
    assert pw.w.dtype == torch.int8 and pw.kmajor and pw.tapsum.shape == (9, CO)
    a = K.check_args("test", q, pw, (1, 1), s, torch.float32, zq)
    y = TC.conv_tma_checked(q, pw, b, (1, 1), a, cfg)
    wd = (pw.w.float() * pw.scale[:, None]).reshape(CO, 3, 3, C).permute(0, 3, 1, 2)
    ref = conv_reference(xd, wd, b, (1, 1))
    assert (y - ref).abs().max().item() < 1e-4 * ref.abs().max().item()
    # conv_igemm sends int8 to this kernel on any device (its own tile), and the zero point matters
    y2 = K.conv_igemm(q, pw, b, (1, 1), x_scale=s, x_zero=zq, out_dtype=torch.float32)
    assert (y2 - ref).abs().max().item() < 1e-4 * ref.abs().max().item()
    y0 = K.conv_igemm(q, pw, b, (1, 1), x_scale=s, out_dtype=torch.float32)  # zq taken as 0: far off
    assert _rel(y0, ref) > 0.1
    # a resnet's residual added in the epilogue: residual + (conv + bias), the border fix-up still right after it
    r = (torch.randn(N, CO, H, W, generator=torch.Generator().manual_seed(10)) * 5 + 3).contiguous(
        memory_format=torch.channels_last)
    y3 = TC.conv_tma_checked(q, pw, b, (1, 1), a, cfg, residual=r)
    assert (y3 - (r + ref)).abs().max().item() < 1e-4 * (r + ref).abs().max().item()
    assert y3.is_contiguous(memory_format=torch.channels_last)
    y4 = K.conv_igemm(q, pw, b, (1, 1), x_scale=s, x_zero=zq, out_dtype=torch.float32, residual=r)
    assert (y4 - (r + ref)).abs().max().item() < 1e-4 * (r + ref).abs().max().item()


def test_int8_is_closer_to_fp32_than_e4m3_on_silu_inputs():
    """The reason for the int8 path: on a SiLU output (mostly >= 0, bounded below by -0.28) 255 uniform levels over
    its range beat e4m3's 3 mantissa bits, with per-output-channel weights in both."""
    q, s, zq, _ = _int8_inputs(1, 64, 8, 8, 3)
    g = torch.Generator().manual_seed(3)
    x = torch.nn.functional.silu(torch.randn(1, 64, 8, 8, generator=g) * 2).contiguous(
        memory_format=torch.channels_last)
    w = torch.randn(64, 64, 3, 3, generator=torch.Generator().manual_seed(4)) * 0.1
    ref = conv_reference(x, w, None, (1, 1))
    y8 = K.conv_igemm(q, K.pack_weight(w, torch.int8), None, (1, 1), x_scale=s, x_zero=zq,
                      out_dtype=torch.float32)
    xe, se = K.quantize_activation(x)
    ye = K.conv_igemm(xe, K.pack_weight(w, K.E4M3), None, (1, 1), x_scale=se, out_dtype=torch.float32)
    assert _rel(y8, ref) < 0.5 * _rel(ye, ref), (_rel(y8, ref), _rel(ye, ref))


def test_int8_rejects_what_it_cannot_compute():
    q, s, zq, _ = _int8_inputs(1, 32, 4, 4, 1)
    w = torch.randn(32, 32, 3, 3)
    with pytest.raises(ValueError, match="int8 weights need torch.int8 activations"):
        K.conv_igemm(q.float().contiguous(memory_format=torch.channels_last), K.pack_weight(w, torch.int8),
                     None, (1, 1))
    with pytest.raises(ValueError, match="8-bit activations need 8-bit weights"):
        K.conv_igemm(q, K.pack_weight(w.float(), kmajor=True), None, (1, 1))
    with pytest.raises(ValueError, match="3x3"):
        K.conv_igemm(q, K.pack_weight(torch.randn(32, 32, 1, 1), torch.int8), None, (0, 0))
    with pytest.raises(ValueError, match="x_zero is for int8"):
        xe, se = K.quantize_activation(q.float())
        K.conv_igemm(xe, K.pack_weight(w, K.E4M3), None, (1, 1), x_scale=se, x_zero=zq)
    with pytest.raises(ValueError, match="residual in the epilogue is for int8"):
        K.conv_igemm(xe, K.pack_weight(w, K.E4M3), None, (1, 1), x_scale=se, residual=torch.zeros(1, 32, 4, 4))
    pw8 = K.pack_weight(w, torch.int8)
    for bad in (torch.zeros(1, 32, 4, 4),  # channels-first
                torch.zeros(1, 32, 4, 4, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last),  # dtype
                torch.zeros(1, 32, 4, 5).contiguous(memory_format=torch.channels_last)):  # shape
        with pytest.raises(ValueError, match="residual must be a channels_last"):
            K.conv_igemm(q, pw8, None, (1, 1), x_scale=s, x_zero=zq, out_dtype=torch.float32, residual=bad)


def test_rejects_what_it_cannot_compute():
    x, w, b = _case(1, 32, 32, 2, 4, 4, 3)
    cfg = TC.TmaConfig(2, 4, 16, 16, 16, 4, 1)
    pw = K.pack_weight(w, kmajor=True)
    with pytest.raises(ValueError, match="K-major"):
        TC.conv_tma(x, K.pack_weight(w), b, (1, 1), config=cfg)
    with pytest.raises(ValueError, match="multiple of BK"):
        TC.conv_tma(x, pw, b, (1, 1), config=TC.TmaConfig(2, 4, 24, 16, 16, 4, 1))
    with pytest.raises(ValueError, match="splits"):
        TC.conv_tma(x, pw, b, (1, 1), config=TC.TmaConfig(2, 4, 16, 16, 16, 4, 1, bk1=8))
    with pytest.raises(ValueError, match="no tile config"):
        TC.conv_tma(x, pw, b, (1, 1))  # bf16/fp32 layers have no measured config: the caller must pass one
    with pytest.raises(ValueError, match="padding"):
        TC.conv_tma(x, pw, b, (0, 0), config=cfg)
    with pytest.raises(ValueError, match="channels_last"):
        TC.conv_tma(x.contiguous(), pw, b, (1, 1), config=cfg)


def test_dispatch_only_on_measured_gpus(monkeypatch):
    """conv_igemm hands e4m3 layers to the TMA kernel only on CUDA sm_90 with a measured tile; a CPU tensor never
    goes there, and a Triton without TMA tensor descriptors keeps the pointer kernel."""
    assert not TC.available(torch.device("cpu"))
    monkeypatch.setattr(TC, "TensorDescriptor", None)
    assert not TC.available(torch.device("cuda"))
    assert TC.tuned_config(96, 96, 832, True).bk1 == 32
    # bf16: only Wan's 96-ch causal Conv3d (E28; 2D 96-ch layers were not measured), and only where bf16_wan96
    assert TC.tuned_config(96, 96, 832, False, video=True) == TC.BF16_WAN96
    assert TC.tuned_config(96, 96, 832, False) is None and TC.tuned_config(192, 192, 416, False, video=True) is None
    assert not TC.bf16_wan96(torch.device("cpu"), torch.bfloat16)
    monkeypatch.setattr(TC, "available", lambda d: True)  # a GPU where it runs: bf16 only
    assert TC.bf16_wan96(torch.device("cuda"), torch.bfloat16)
    assert not TC.bf16_wan96(torch.device("cuda"), torch.float16)
    assert not TC.bf16_wan96(torch.device("cuda"), torch.float32)
    monkeypatch.undo()
    monkeypatch.setattr(TC, "TensorDescriptor", None)
    assert TC.tuned_config(192, 96, 416, True) is None
    assert TC.tuned_config(512, 256, 512, True) is not None  # SDXL's 512 -> 256 resnet conv
    # 128-512 ch: one 128-px row where the width is a multiple of 128 (2D convs), else 4 x 32 (a row would overhang;
    # Wan's causal Conv3d layers were not re-measured)
    assert TC.tuned_config(128, 128, 1024, True) == TC.ROW_TILE
    assert TC.tuned_config(128, 128, 160, True) not in (None, TC.ROW_TILE)
    assert TC.tuned_config(384, 384, 256, True, video=True) not in (None, TC.ROW_TILE)
    assert TC.tuned_upconv_config(256, 256, 512) == TC.ROW_TILE
    assert TC.tuned_upconv_config(512, 512, 64) not in (None, TC.ROW_TILE)
    assert TC.tuned_upconv_config(512, 512) not in (None, TC.ROW_TILE)  # width unknown
    assert TC.tuned_upconv_config(256, 96, 512) is None
    called = []
    monkeypatch.setattr(TC, "conv_tma_checked", lambda *a, **k: called.append(1))
    x, w, b = _case(1, 16, 16, 1, 4, 4, None)
    xq, s = K.quantize_activation(x)
    K.conv_igemm(xq, K.pack_weight(w, K.E4M3), b, (1, 1), x_scale=s)
    assert not called


@pytest.mark.gpu
def test_gpu_dispatch_and_match():
    """On the GPU the e4m3 96- and 128-channel layers go to the TMA kernel (when sm_90; the row tile on a batch of
    two 256-px-wide frames, 4 x 32 on 64- and 160-px ones) and match the pointer kernel; bf16 with an explicit config
    matches cuDNN."""
    dev = torch.device("cuda")
    for shape in [(1, 96, 96, 4, 60, 104, 3), (1, 128, 128, 1, 64, 64, None), (1, 256, 128, 1, 96, 160, None),
                  (2, 256, 128, 1, 40, 256, None)]:
        x, w, b = _case(*shape, dtype=torch.bfloat16, device="cuda")
        xq, s = K.quantize_activation(x)
        pw = K.pack_weight(w, K.E4M3)
        y = K.conv_igemm(xq, pw, b, (1, 1), x_scale=s)
        desc, TC.TensorDescriptor = TC.TensorDescriptor, None  # as a Triton without TMA: the pointer kernel
        try:
            y_ptr = K.conv_igemm(xq, pw, b, (1, 1), x_scale=s)
        finally:
            TC.TensorDescriptor = desc
        assert _rel(y, y_ptr) < 1e-2
        assert _rel(y, conv_reference(x, w, b, (1, 1))) < 0.08
        if torch.cuda.get_device_capability(dev) == (9, 0):
            cfg = TC.tuned_config(shape[1], shape[2], shape[5], True)
            assert cfg is not None and (cfg == TC.ROW_TILE) == (shape[1] != 96 and shape[5] % 128 == 0)
            cfg16 = TC.TmaConfig(1, 128, 32, 64, 32, 4, 3) if shape[1] == 96 else TC.TmaConfig(1, 128, 64, 128, 0, 8, 3)
            y16 = TC.conv_tma(x, K.pack_weight(w, kmajor=True), b, (1, 1), config=cfg16)
            assert _rel(y16, conv_reference(x, w, b, (1, 1))) < 1e-2


@pytest.mark.gpu
def test_gpu_int8_row_tile_matches_dequantized_reference():
    """sm_90: int8 layers of the image decoders' widths on the row tile (int32 accumulation in wgmma) equal the fp32
    conv of the dequantized operands, a batch of two with different zero points."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TMA kernel's tiles were measured on sm_90")
    for N, C, CO, H, W in [(2, 128, 128, 64, 128), (1, 256, 128, 32, 256), (1, 512, 512, 16, 128)]:
        q, s, zq, xd = _int8_inputs(N, C, H, W, 11)
        w = torch.randn(CO, C, 3, 3, generator=torch.Generator().manual_seed(12)) / (9 * C) ** 0.5
        pw = K.pack_weight(w, torch.int8)
        q, s, zq, xd, pw.w, pw.scale, pw.tapsum = (t.cuda() for t in (q, s, zq, xd, pw.w, pw.scale, pw.tapsum))
        assert TC.int8_config(C, CO, W) == TC.ROW_TILE
        y = K.conv_igemm(q, pw, None, (1, 1), x_scale=s, x_zero=zq, out_dtype=torch.float32)
        wd = (pw.w.float() * pw.scale[:, None]).reshape(CO, 3, 3, C).permute(0, 3, 1, 2)
        ref = conv_reference(xd.cpu(), wd.cpu(), None, (1, 1))  # on the CPU: no TF32
        assert (y.cpu() - ref).abs().max().item() < 1e-4 * ref.abs().max().item()
        # the residual in the epilogue (the register-capped variant, TC.RES_MAXNREG): residual + conv
        r = torch.randn(N, CO, H, W, generator=torch.Generator().manual_seed(13)).cuda().contiguous(
            memory_format=torch.channels_last)
        yr = K.conv_igemm(q, pw, None, (1, 1), x_scale=s, x_zero=zq, out_dtype=torch.float32, residual=r)
        assert (yr.cpu() - (ref + r.cpu())).abs().max().item() < 1e-4 * (ref + r.cpu()).abs().max().item()


def _wan21_pipeline(**opts):
    """Full-width Wan 2.1 with random N(0, 0.02) weights (seed 0), bf16 on CUDA, graphs and tiling off."""
    from vaeopt.families import build_model, get_family
    from vaeopt.loading import LoadedVAE
    from vaeopt.pipeline import Options, Pipeline

    spec = get_family("wan21")
    torch.manual_seed(0)
    with torch.device("meta"):
        m = build_model(spec)
    m = m.to_empty(device="cpu")
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return Pipeline(LoadedVAE(m, spec, "random", None, [], None),
                    Options(device="cuda", dtype="bf16", graphs="off", tiling="off", **opts))


@pytest.mark.gpu
def test_gpu_wan_fp8_on_tma_graph_replay_equals_eager(monkeypatch):
    """Full-width Wan 2.1 (random weights), FP8 level 3 on every candidate (gate 0): on sm_90 the e4m3 convs run on
    the TMA kernel (its host descriptors are captured into the per-chunk CUDA graph), and the replay equals the eager
    decode bitwise."""
    from vaeopt import stage_table, video

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TMA tiles were measured on sm_90 only")
    pipe = _wan21_pipeline(fp8="on", gate_db=0.0)
    line = next((s for s in pipe.stages if s.name == "fp8 convs" and s.status == "applied"), None)
    assert line is not None, [s.line() for s in pipe.stages]
    # every residual conv but up_blocks.1.resnets.0.conv1 (192 -> 384: no measured tile) takes the TMA kernel
    assert line.data["tma_layers"] == 27 and "27 of the 28 8-bit convs through TMA boxes" in line.line(), line.line()
    calls = []
    real = TC.conv_tma_checked
    monkeypatch.setattr(TC, "conv_tma_checked", lambda *a, **k: calls.append(1) or real(*a, **k))
    z = torch.randn(1, 16, 3, 16, 16, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    with torch.inference_mode():
        ref = video.decode_video(pipe.model, z, 1, graphs="off", info={})
        assert len(calls) > 0
        pol = stage_table.chunk_graphs("on", stage_table.DeviceInfo.of(torch.device("cuda")))
        out = video.decode_video(pipe.model, z, 1, graphs=pol, info={})
    assert pol.clips[-1]["status"] == "captured", pol.clips[-1]
    assert torch.equal(out, ref), (out.float() - ref.float()).abs().max().item()


@pytest.mark.gpu
def test_gpu_wan_bf16_96_channel_convs_on_tma(monkeypatch):
    """bf16 on sm_90 (E28): stacked_conv3d stacks only the 384-channel convs, the six 96-channel ones run on the TMA
    kernel with BF16_WAN96 (one bf16 conv: close to cuDNN's Conv3d), and a full-width Wan 2.1 decode (random weights,
    two chunks) agrees with the all-stacked decode to bf16 rounding."""
    from vaeopt import planner, video
    from vaeopt.stages import stacked_conv3d

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TMA tiles were measured on sm_90 only")
    from vaeopt.kernels import ws_conv as WS

    x, w, b = _case(1, 96, 96, 12, 40, 64, 3, dtype=torch.bfloat16, device="cuda")
    calls = []
    real = TC.conv_tma_checked
    monkeypatch.setattr(TC, "conv_tma_checked", lambda *a, **k: calls.append(a[-1]) or real(*a, **k))
    # with Gluon (E42) the warp-specialized variant takes them: the same tile order and sums, bitwise equal
    ws = WS.available(x.device, x.dtype)
    real_ws = WS.conv_checked
    monkeypatch.setattr(WS, "conv_checked", lambda *a, **k: calls.append("ws") or real_ws(*a, **k))
    y = K.conv_igemm(x, K.pack_weight(w, kmajor=True), b, (1, 1))
    assert calls == (["ws"] if ws else [TC.BF16_WAN96])
    if ws:
        assert torch.equal(y, real(x, K.pack_weight(w, kmajor=True), b, (1, 1),
                                   K.check_args("t", x, K.pack_weight(w, kmajor=True), (1, 1), None, None),
                                   TC.BF16_WAN96))
    ref = torch.nn.functional.conv3d(x.float(), w.float(), b.float(), padding=(0, 1, 1))
    assert _rel(y, ref) < 1e-2

    z = torch.randn(1, 16, 5, 16, 16, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    p = _wan21_pipeline()
    st = {s.name: s for s in p.stages}
    assert st["stacked_conv3d"].data["channels"] == [384] and st["stacked_conv3d"].data["left_to_triton_conv"] == 6
    # with Gluon the six 192-ch convs join (E42), on the warp-specialized kernel as well
    n = 12 if ws else 6
    assert st["triton_conv"].data["layers"] == n
    assert ("on the warp-specialized Gluon TMA kernel" if ws else "TMA variant") in st["triton_conv"].line()
    calls.clear()
    with torch.inference_mode():
        out = video.decode_video(p.model, z, 2, graphs="off", replan=planner.smaller_video_plan, info=(info := {}))
    steps = len(video.chunk_schedule(z.shape[2], 2))
    assert info["stats"]["triton_conv"] == n * steps and len(calls) == n * steps
    assert set(calls) == ({"ws"} if ws else {TC.BF16_WAN96})
    # without the triton_conv stage the 96-ch convs stay stacked (not left to a stage that does not run)
    off = {s.name: s for s in _wan21_pipeline(conv_kernel="off").stages}
    assert off["stacked_conv3d"].data["channels"] == [96, 384] and off["triton_conv"].status == "skipped"
    monkeypatch.setattr(stacked_conv3d, "tma_takes_96", lambda *a: False)  # auto stacking the 96-ch convs too
    q = _wan21_pipeline()
    assert {s.name: s for s in q.stages}["stacked_conv3d"].data["channels"] == [96, 384]
    with torch.inference_mode():
        ref = video.decode_video(q.model, z, 2, graphs="off", replan=planner.smaller_video_plan, info={})
    d = (out.float() - ref.float()).abs()
    assert d.max().item() < 0.1 and d.mean().item() < 2e-3, (d.max().item(), d.mean().item())
    # spatial tiles (no stacking there) run the marked 96-ch convs on the same kernel, on each tile's buffer
    calls.clear()
    with torch.inference_mode():
        tiled = video.decode_video(p.model, z, 2, graphs="off", tile=(8, 8), info=(info := {}))
    # the tiles split the full-resolution up block: the 96-ch convs run once per tile, the 192-ch ones once
    assert info["tiles"] == 4 and len(calls) == (4 * 6 + n - 6) * steps, (info.get("tiles"), len(calls))
    d = (tiled.float() - out.float()).abs()
    assert d.max().item() < 0.1 and d.mean().item() < 2e-3, (d.max().item(), d.mean().item())
