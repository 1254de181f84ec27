"""Stage fused_epilogues (after fused_norms) on a small SDXL-config AutoencoderKL: decode equals stock, the counts are
what the model holds and what ran, the upsample is fused exactly where it should be, revert restores.

CPU: fp32 through the Triton interpreter. "cuda" (pytest -m gpu): fp32 with TF32 off, and bf16 judged against stock
bf16's own error vs fp32.
"""

import importlib

import pytest
import torch
import torch.nn.functional as F

from vaeopt.families import build_model, get_family
from vaeopt.kernels import triton_available
from vaeopt.stages import fused_epilogues, fused_norms

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _need(device):
    ok, why = triton_available(device)
    if not ok:
        pytest.skip(why)


def _spy(monkeypatch, module_name, fn_name):
    """Record the launches of a kernel launcher that the patched forwards import at call time."""
    mod = importlib.import_module(module_name)
    calls = []
    real = getattr(mod, fn_name)

    def wrapper(*a, **k):
        calls.append((tuple(a[0].shape), k))
        return real(*a, **k)

    monkeypatch.setattr(mod, fn_name, wrapper)
    return calls


def _decode(model, z):
    with torch.no_grad():
        return model.decode(z).sample.float()


@pytest.fixture(scope="module")
def small_kl():
    torch.manual_seed(0)
    return build_model(get_family("sdxl"), block_out_channels=[32, 32, 64, 64], norm_num_groups=8)


def _structure(dec):
    from diffusers.models.attention_processor import Attention
    from diffusers.models.resnet import ResnetBlock2D

    resnets = [m for m in dec.modules() if isinstance(m, ResnetBlock2D)]
    ups = [b for b in dec.up_blocks if b.upsamplers is not None]
    return dict(
        resnets=resnets,
        shortcuts=sum(m.conv_shortcut is not None for m in resnets),
        up_blocks=ups,
        attns=[m for m in dec.modules() if isinstance(m, Attention)],
    )


def _apply_both(model, **kw):
    assert fused_norms.apply(model).status == "applied"
    r = fused_epilogues.apply(model, min_head_dim=0, attention_chunk=24, **kw)  # head_dim 64 here: force chunking
    assert r.status == "applied", r.detail
    return r


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["cf", "cl"])
def test_autoencoder_kl(device, layout, monkeypatch, small_kl):
    _need(device)
    model = small_kl.to(device)
    mf = torch.channels_last if layout == "cl" else torch.contiguous_format
    model.to(memory_format=mf)
    st = _structure(model.decoder)
    keys = {k: v for k, v in model.state_dict().items()}
    processors = [a.processor for a in st["attns"]]
    z = torch.randn(1, 4, 8, 8, device=device).contiguous(memory_format=mf)
    torch.backends.cudnn.allow_tf32 = False  # fp32 comparison: no TF32 convs (they round differently per call)
    try:
        ref = _decode(model, z)
        r = _apply_both(model)
        n_res = len(st["resnets"])
        d = r.data
        assert d["epilogues"] == n_res == 14 and d["bias_folded"] == n_res
        assert d["shortcut_bias_folded"] == st["shortcuts"] == 1
        assert d["upsample_fused"] == d["upsamplers"] == len(st["up_blocks"]) == 3
        assert d["attention_chunked"] == len(st["attns"]) == 1 and d["head_dims"] == [64]
        assert d["head_taps"] == 3
        assert r.detail == ("folded 14 conv biases into GroupNorm, 14 residual epilogues (3 with fused 2x upsample, "
                            "1 shortcut biases folded), chunked attention for head_dim 64 (1 block), the head "
                            "(conv_norm_out + conv_out, 3 channels) as one GroupNorm+GEMM kernel and a tap sum "
                            "(whole-image decodes)")
        assert {k: v for k, v in model.state_dict().items()}.keys() == keys.keys()
        assert all(model.state_dict()[k] is not None and model.state_dict()[k].data_ptr() == v.data_ptr()
                   for k, v in keys.items()), "parameters untouched"

        epi = _spy(monkeypatch, "vaeopt.kernels.epilogue", "bias_residual")
        gn = _spy(monkeypatch, "vaeopt.kernels.group_norm_silu", "group_norm_silu")
        up = _spy(monkeypatch, "vaeopt.kernels.epilogue", "upsample_nearest2x")
        taps = _spy(monkeypatch, "vaeopt.kernels.tapconv", "group_norm_taps")
        tsum = _spy(monkeypatch, "vaeopt.kernels.tapconv", "tap_sum")
        interp, head_conv = [], []
        real_interp, real_conv = F.interpolate, F.conv2d
        monkeypatch.setattr(F, "interpolate", lambda *a, **k: interp.append(1) or real_interp(*a, **k))
        monkeypatch.setattr(F, "conv2d", lambda x, w, *a, **k: head_conv.append(w is model.decoder.conv_out.weight)
                            or real_conv(x, w, *a, **k))
        out = _decode(model, z)
        torch.testing.assert_close(out, ref, atol=2e-4, rtol=1e-4)
        # the head: on channels-last activations (here also reached from channels-first latents: the upsamplers'
        # phase convs return channels-last) the norm+GEMM kernel and the tap sum, once each, and no conv_out conv
        assert len(taps) == len(tsum) and len(taps) + sum(head_conv) == 1 and (layout == "cf" or len(taps) == 1)
        assert not any(k in m.__dict__ for m in (model.decoder.conv_norm_out, model.decoder.conv_out)
                       for k in ("forward", fused_epilogues._HEAD)), "stock modules outside the decoder call"
        assert out.is_contiguous(memory_format=mf) or layout == "cf"
        # what ran: one epilogue per resnet + the attention's; 3 of them wrote the upsampled output; no interpolate.
        # (On CUDA the chunked attention is for bf16/fp16 only: the fp32 decode keeps SDPA.)
        chunked = 1 if device == "cpu" else 0
        assert len(epi) == n_res + chunked
        assert sum(k.get("upsample2x", False) for _, k in epi) == 3 and up == [] and interp == []
        assert sum(k.get("x_bias") is not None for _, k in gn) == n_res
        proc = st["attns"][0].processor
        assert type(proc).__name__ == "ChunkedAttnProcessor" and proc.calls == chunked

        if device == "cuda":  # bf16: error vs fp32 within 2x stock bf16's own + floor
            fp32_weights = {k: v.clone() for k, v in model.state_dict().items()}  # bf16 round trip is lossy
            fused16 = _decode(model.to(torch.bfloat16), z.to(torch.bfloat16))
            assert proc.calls == 1 and len(epi) == 2 * n_res + 1
            assert len(taps) == len(tsum) and (layout == "cf" or len(taps) == 2)
            fused_epilogues.revert(model)
            fused_norms.revert(model)
            stock16 = _decode(model, z.to(torch.bfloat16))
            err, err_stock = (fused16 - ref).abs().max().item(), (stock16 - ref).abs().max().item()
            assert err <= 2 * err_stock + 2e-2, (err, err_stock)
            model.float()
            with torch.no_grad():
                for k, v in model.state_dict().items():
                    v.copy_(fp32_weights[k])
            _apply_both(model)

        assert fused_epilogues.apply(model).status == "skipped"  # applying twice is refused
        fused_epilogues.revert(model)
        assert not any("forward" in m.__dict__ for m in model.decoder.modules()), "patched forwards removed"
        assert [a.processor for a in st["attns"]] == processors
        assert not any(fused_epilogues._STATE in m.__dict__ or fused_epilogues._PENDING in m.__dict__
                       for m in model.decoder.modules())
        n_epi = len(epi)
        torch.testing.assert_close(_decode(model, z), ref, atol=2e-4, rtol=1e-4)
        assert len(epi) == n_epi, "reverted: no epilogue kernel runs"
        fused_norms.revert(model)
    finally:
        torch.backends.cudnn.allow_tf32 = True
        fused_epilogues.revert(model)
        fused_norms.revert(model)
        model.to(memory_format=torch.contiguous_format).cpu().float()


def test_epilogues_take_the_next_norms_statistics(small_kl, monkeypatch):
    """Channels-last decode: each residual epilogue whose output a GroupNorm reads next takes that norm's statistics
    (the mid-block attention's norm, the next resnet's norm1, the head's norm), so 12 of the small decoder's stats
    passes do not run; the decoded image matches the decode with every stats pass run."""
    _need("cpu")
    gn_mod = importlib.import_module("vaeopt.kernels.group_norm_silu")
    from vaeopt.stages import upsample_conv

    model = small_kl.to(memory_format=torch.channels_last)
    z = torch.randn(1, 4, 8, 8).contiguous(memory_format=torch.channels_last)
    try:
        _apply_both(model)
        assert upsample_conv.apply(model, force=True).status == "applied"  # the pipeline's order: after
        stats = _spy(monkeypatch, "vaeopt.kernels.group_norm_silu", "_launch_stats")
        noted = _decode(model, z)
        n_noted = len(stats)
        # every stats pass run: a hook inside the decoder (here one that changes nothing) turns the notes off
        handle = model.decoder.conv_in.register_forward_hook(lambda m, a, out: None)
        try:
            full = _decode(model, z)
        finally:
            handle.remove()
        # 30 norms: 14 resnets x 2, the attention's, the head's; 12 read a residual epilogue's output and 3 an
        # upsampler's phase interleave: only the mid-block's first norm (after conv_in) and the 14 norm2s (after a
        # conv) run their stats pass
        assert len(stats) - n_noted == 30 and n_noted == 30 - 12 - 3
        torch.testing.assert_close(noted, full, atol=1e-5, rtol=1e-5)
        # a foreign hook inside the decoder could change an activation in place, unseen in inference mode (no
        # version counter): then no note is taken for the call, and an in-place edit is honoured
        blk = model.decoder.up_blocks[1].resnets[0]
        handle = blk.register_forward_hook(lambda m, a, out: out.mul_(0.5))
        try:
            n0 = len(stats)
            with torch.inference_mode():
                hooked = model.decode(z).sample.float()
            assert len(stats) - n0 == 30
        finally:
            handle.remove()
        assert (hooked - noted).abs().max() > 1e-3  # the edit reached the output
    finally:
        upsample_conv.revert(model)
        fused_epilogues.revert(model)
        fused_norms.revert(model)
        model.to(memory_format=torch.contiguous_format)


def test_upsample_output_size_and_foreign_inputs(small_kl):
    """The fused resnet + upsampler pair, called as the up-block calls them and otherwise: an output_size other than
    2x, a tensor the resnet did not produce, and a resnet that fell back all give stock results."""
    _need("cpu")
    model = small_kl.cpu().float()
    blk = model.decoder.up_blocks[1]
    res, ups = blk.resnets[-1], blk.upsamplers[0]
    x = torch.randn(1, res.in_channels, 5, 7)
    with torch.no_grad():
        ref_r = res(x, None)
        ref_2x = ups(ref_r)
        ref_odd = ups(ref_r, output_size=(11, 13))
        _apply_both(model)
        try:
            y = res(x, None)
            assert y.shape[-2:] == (10, 14), "the fused resnet returns its output upsampled"
            torch.testing.assert_close(ups(y), ref_2x, atol=2e-5, rtol=1e-5)
            y = res(x, None)
            torch.testing.assert_close(ups(y, output_size=(11, 13)), ref_odd, atol=2e-5, rtol=1e-5)
            y = res(x, None)
            torch.testing.assert_close(ups(y, output_size=(10, 14)), ref_2x, atol=2e-5, rtol=1e-5)
            # a tensor that is not the resnet's: upsampled as usual (our kernel, bitwise equal to interpolate)
            torch.testing.assert_close(ups(ref_r), ref_2x, atol=0, rtol=0)
            # a live hand-off for another tensor: that other tensor is upsampled as usual
            y = res(x, None)
            torch.testing.assert_close(ups(ref_r), ref_2x, atol=0, rtol=0)
            del y
            # stale hand-off: resnet output dropped, another tensor comes in
            res(x, None)
            torch.testing.assert_close(ups(ref_r.clone()), ref_2x, atol=0, rtol=0)
        finally:
            fused_epilogues.revert(model)
            fused_norms.revert(model)


def test_fallback_and_skip_without_triton_backend(monkeypatch, small_kl):
    """CPU without the interpreter: apply() skips with the reason; patched modules run the stock forwards."""
    model = small_kl.cpu().float()
    z = torch.randn(1, 4, 4, 4)
    ref = _decode(model, z)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    r = fused_epilogues.apply(model, device="cpu")
    assert r.status == "skipped" and "CPU" in r.detail and fused_epilogues.available("cpu")[0] is False
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fused_epilogues.apply(model, device="cpu").status == "skipped", "refused without fused norms"
    _apply_both(model)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    epi = _spy(monkeypatch, "vaeopt.kernels.epilogue", "bias_residual")
    torch.testing.assert_close(_decode(model, z), ref, atol=1e-5, rtol=1e-5)
    assert epi == [] and model.decoder.mid_block.attentions[0].processor.calls == 0
    fused_epilogues.revert(model)
    fused_norms.revert(model)


def test_head_taps_only_inside_the_decoder_forward(small_kl, monkeypatch):
    """conv_norm_out / conv_out called by anyone but the decoder's own forward (the tiler, a user) give the stock
    results: the norm returns the normalized tensor, not its input, and nothing stays armed. A hook on the decoder
    itself (the channels_last stage's input relayout is one) keeps the tap head."""
    _need("cpu")
    model = small_kl.to(memory_format=torch.channels_last)
    try:
        _apply_both(model)
        dec = model.decoder
        taps = _spy(monkeypatch, "vaeopt.kernels.tapconv", "group_norm_taps")
        h = dec.register_forward_pre_hook(lambda m, a: (a[0].contiguous(memory_format=torch.channels_last),))
        try:
            _decode(model, torch.randn(1, 4, 4, 4))
        finally:
            h.remove()
        assert len(taps) == 1
        # a sample too large for the statistics kernels' int32 offsets (128 ch at 4096²: lowered here) keeps the
        # stock head, as the stock fused norm hands over to torch's GroupNorm there
        z = torch.randn(1, 4, 4, 4)
        ref = _decode(model, z)
        monkeypatch.setattr(fused_epilogues, "HEAD_MAX_SAMPLE", 32 * 32 * 32)
        torch.testing.assert_close(_decode(model, z), ref, atol=1e-4, rtol=1e-4)
        assert len(taps) == 2
        x = torch.randn(1, 32, 6, 10).contiguous(memory_format=torch.channels_last)
        with torch.no_grad():
            y = dec.conv_norm_out(x)
            torch.testing.assert_close(y, F.silu(F.group_norm(x, 8, dec.conv_norm_out.weight,
                                                               dec.conv_norm_out.bias, 1e-6)), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(dec.conv_out(y), F.conv2d(y, dec.conv_out.weight, dec.conv_out.bias,
                                                                 padding=1), atol=1e-5, rtol=1e-5)
        assert fused_epilogues._HEAD not in dec.conv_out.__dict__
    finally:
        fused_epilogues.revert(model)
        fused_norms.revert(model)
        model.to(memory_format=torch.contiguous_format)
    assert not any(k in m.__dict__ for m in (dec, dec.conv_norm_out, dec.conv_out)
                   for k in ("forward", fused_epilogues._HEAD, "_vaeopt_tap_matrix"))


def test_two_threads_decoding_with_one_model(small_kl, monkeypatch):
    """A web server decodes on several threads with one model. A decode leaves notes on shared modules for later
    modules of the same call (the upsampled tensor on Upsample2D, the head's statistics on conv_out); a second
    thread in between read them: an output upsampled twice, or conv_out on the raw activation. Decodes of one
    decoder now take turns: the first waits inside its upsampler for the other to come in, which it cannot."""
    import threading

    _need("cpu")
    model = small_kl.to(memory_format=torch.channels_last)
    try:
        _apply_both(model)
        zs = [torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(i)) for i in range(2)]
        refs = [_decode(model, z) for z in zs]
        up = next(b.upsamplers[0] for b in model.decoder.up_blocks if b.upsamplers is not None)
        inside, most, entered = [0], [0], threading.Event()
        real = type(model.decoder).forward

        def counted(self, *a, **k):
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            try:
                return real(self, *a, **k)
            finally:
                inside[0] -= 1

        monkeypatch.setattr(type(model.decoder), "forward", counted)  # what _decoder_call runs inside the lock
        f0 = up.forward

        def slow_up(*a, **k):
            entered.set()
            threading.Event().wait(0.5 if inside[0] == 1 else 0)  # room for the other thread to come in
            return f0(*a, **k)

        up.forward = slow_up
        out = [None, None]

        def work(i):
            out[i] = _decode(model, zs[i])

        ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        del up.forward
        assert most[0] == 1 and entered.is_set()
        for o, r in zip(out, refs):
            assert o.shape == r.shape
            torch.testing.assert_close(o, r, atol=1e-5, rtol=1e-5)
    finally:
        fused_epilogues.revert(model)
        fused_norms.revert(model)
        model.to(memory_format=torch.contiguous_format)
