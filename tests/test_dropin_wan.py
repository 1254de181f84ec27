"""vaeopt.optimize(pipe.vae) on diffusers' own Wan-family classes: AutoencoderKLWan and AutoencoderKLQwenImage
(Qwen-Image's VAE, whose decoder is Wan 2.1's module for module). vae.decode goes through vaeopt's exact chunk
decoder -- for Qwen-Image through an AutoencoderKLWan view of the VAE's own weights (dropin.wan_view) -- and returns
what diffusers' decode returns: DecoderOutput(sample) or a 1-tuple, (N, 3, 1 + 4(T-1), 8h, 8w), contiguous.

fp32 outputs are compared with >= 100 dB and a 1e-5 max difference, not bitwise: the chunk decoder runs a one-frame
call's causal convs as the Conv2d of their last temporal tap and several frames per Conv3d call (diffusers: one frame
per call, zero history frames included), which sums the same products in another order (~1e-6 apart here)."""

import copy
import io
import pickle

import pytest
import torch
from safetensors.torch import save

import vaeopt
from vaeopt import dropin, video
from vaeopt.fidelity import psnr


def _tiny(cls_name: str):
    """A stock tiny model (random weights, jittered so that no norm gamma is exactly 1) in eval mode."""
    import diffusers

    torch.manual_seed(0)
    m = getattr(diffusers, cls_name)(base_dim=8)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return m.eval()


def _decoder_cls(vae):
    return type(vae.decoder)


CLASSES = ["AutoencoderKLQwenImage", "AutoencoderKLWan"]


@pytest.fixture(scope="module", params=CLASSES)
def pair(request):
    stock = _tiny(request.param)
    vae = copy.deepcopy(stock)
    lines = []
    vaeopt.optimize(vae, device="cpu", log=lines.append)
    return stock, vae, lines


def _spy(monkeypatch, vae):
    """Counts of vaeopt's chunk decoder calls and of diffusers' per-frame decoder calls (its frame loop)."""
    calls = {"chunk": 0, "frames": 0}
    real_dv = video.decode_video
    monkeypatch.setattr(video, "decode_video", lambda *a, **k: calls.__setitem__("chunk", calls["chunk"] + 1)
                        or real_dv(*a, **k))
    cls = _decoder_cls(vae)
    real_fwd = cls.forward

    def counted(self, *a, **k):
        calls["frames"] += 1
        return real_fwd(self, *a, **k)

    monkeypatch.setattr(cls, "forward", counted)
    return calls


@pytest.mark.parametrize("frames", [1, 3])
def test_decode_takes_the_chunk_decoder_with_diffusers_outputs(pair, monkeypatch, frames):
    """One latent frame (a Qwen-Image picture) and a clip, a batch of 2: vaeopt's chunk decoder runs (not diffusers'
    frame loop), with diffusers' return types, shapes and values."""
    stock, vae, lines = pair
    assert any(line.startswith("vae.decode: vaeopt's exact chunk decoder") for line in lines), lines
    z = torch.randn(2, 16, frames, 6, 8, generator=torch.Generator().manual_seed(frames))
    with torch.no_grad():
        want = stock.decode(z).sample
        calls = _spy(monkeypatch, vae)
        out = vae.decode(z)
        tup = vae.decode(z, return_dict=False)
    assert calls == {"chunk": 2, "frames": 0}
    assert type(out).__name__ == "DecoderOutput" and isinstance(tup, tuple) and len(tup) == 1
    got = out.sample
    assert got.shape == want.shape == (2, 3, 1 + 4 * (frames - 1), 48, 64) and got.is_contiguous()
    assert got.dtype == want.dtype == torch.float32 and torch.equal(tup[0], got)
    assert (got - want).abs().max().item() < 1e-5 and psnr(got, want) >= 100


def test_autograd_and_diffusers_tiling_take_diffusers_decode(pair, monkeypatch):
    """Where vaeopt's path does not apply (gradients wanted, the user's enable_tiling() on a latent larger than its
    tile) diffusers' own decode runs, on the VAE's own modules."""
    stock, vae, _ = pair
    z = torch.randn(1, 16, 2, 6, 8, generator=torch.Generator().manual_seed(5))
    calls = _spy(monkeypatch, vae)
    zg = z.clone().requires_grad_()
    vae.decode(zg).sample.square().sum().backward()
    assert calls == {"chunk": 0, "frames": 2} and zg.grad is not None and zg.grad.abs().sum() > 0
    tiles = dict(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=16,
                 tile_sample_stride_width=16)
    vae.enable_tiling(**tiles)
    stock.enable_tiling(**tiles)
    try:
        with torch.no_grad():
            got, want = vae.decode(z).sample, stock.decode(z).sample
    finally:
        vae.disable_tiling()
        stock.disable_tiling()
    assert calls["chunk"] == 0 and calls["frames"] > 2 and (got - want).abs().max().item() < 1e-5


def test_qwenimage_view_shares_the_vaes_weights():
    """The Wan view holds no weights of its own: every decoder parameter is the VAE's own object (so an edit of
    either, in place or by replacing a parameter, is seen by both), the state dict keeps its keys and values, and
    the view is no submodule of the VAE."""
    stock = _tiny("AutoencoderKLQwenImage")
    vae = copy.deepcopy(stock)
    vaeopt.optimize(vae, device="cpu", log=None)
    wan = dropin.wan_runs(vae)
    assert type(wan).__name__ == "AutoencoderKLWan" and wan is not vae
    assert [id(p) for p in wan.decoder.parameters()] == [id(p) for p in vae.decoder.parameters()]
    assert wan.post_quant_conv.weight is vae.post_quant_conv.weight and wan.encoder is vae.encoder
    assert not any(p.is_meta for p in wan.parameters())
    sd, ref = vae.state_dict(), stock.state_dict()
    assert sd.keys() == ref.keys() and all(torch.equal(sd[k], ref[k]) for k in ref)
    assert not any(m is wan for m in vae.modules())
    save(vae.state_dict())  # the channels_last weights go out contiguous (the stage's state-dict hook, shared)
    z = torch.randn(1, 16, 1, 6, 8, generator=torch.Generator().manual_seed(2))
    edits = [
        lambda m: m.decoder.conv_in.weight.data.mul_(0.5),  # through .data: no version count
        lambda m: setattr(m.decoder.up_blocks[0].resnets[0].conv1, "weight",
                          torch.nn.Parameter(m.decoder.up_blocks[0].resnets[0].conv1.weight * -1)),
        lambda m: m.load_state_dict({"decoder.conv_out.bias": torch.full_like(m.decoder.conv_out.bias, 0.25)},
                                    strict=False, assign=True),
    ]
    for edit in edits:
        with torch.no_grad():
            edit(stock)
            edit(vae)
        vaeopt.refresh(vae)
        with torch.no_grad():
            got, want = vae.decode(z).sample, stock.decode(z).sample
        assert (got - want).abs().max().item() < 1e-5
    assert wan.decoder.conv_out.bias is vae.decoder.conv_out.bias and dropin.wan_runs(vae) is wan


def test_qwenimage_view_survives_pickle_and_deepcopy():
    stock = _tiny("AutoencoderKLQwenImage")
    vae = copy.deepcopy(stock)
    vaeopt.optimize(vae, device="cpu", log=None)
    z = torch.randn(1, 16, 2, 6, 8, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = stock.decode(z).sample
    buf = io.BytesIO()
    torch.save(vae, buf)
    buf.seek(0)
    for again in (torch.load(buf, weights_only=False), copy.deepcopy(vae), pickle.loads(pickle.dumps(vae))):
        wan = dropin.wan_runs(again)
        assert again._decode.vae is again and again.decode.graphs.run is wan
        assert wan.decoder.conv_in.weight is again.decoder.conv_in.weight  # its own copy's weights, still shared
        with torch.no_grad():
            assert (again.decode(z).sample - want).abs().max().item() < 1e-5


def test_qwenimage_stand_down_undoes_the_views_changes():
    """accelerate's hooks placing the layers after optimize: vaeopt steps aside at the first decode, undoing what
    its stages changed through the view (the channels_last weights are the VAE's own), and the output is the stock
    model's bitwise."""
    from accelerate import cpu_offload

    stock = _tiny("AutoencoderKLQwenImage")
    vae = copy.deepcopy(stock)
    vaeopt.optimize(vae, device="cpu", log=None)
    convs = [m for m in vae.decoder.modules() if isinstance(m, torch.nn.Conv3d) and max(m.kernel_size) > 1]
    assert sum(not c.weight.is_contiguous() for c in convs) > 10  # the view's channels_last stage, on these weights
    cpu_offload(vae, execution_device=torch.device("cpu"))
    z = torch.randn(1, 16, 2, 6, 8, generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), pytest.warns(UserWarning, match="accelerate hooks on .* place its layers now"):
        got = vae.decode(z).sample
    with torch.no_grad():
        assert torch.equal(got, stock.decode(z).sample)


def test_qwenimage_with_a_changed_decoder_keeps_diffusers_decode(monkeypatch):
    """A decoder that is not Qwen-Image's stock one (a module swapped in) has no Wan view: optimize says so, and
    vae.decode stays diffusers' frame loop, with the stock model's output."""
    stock = _tiny("AutoencoderKLQwenImage")
    stock.decoder.mid_block.resnets[0].nonlinearity = torch.nn.GELU()
    vae = copy.deepcopy(stock)
    lines = []
    vaeopt.optimize(vae, device="cpu", log=lines.append)
    said = [x for x in lines if x.startswith("! vae.decode stays diffusers' own frame loop")]
    assert len(said) == 1 and "its module mid_block.resnets.0.nonlinearity (GELU) is not" in said[0], lines
    assert dropin.wan_runs(vae) is vae
    calls = _spy(monkeypatch, vae)
    z = torch.randn(1, 16, 2, 6, 8, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        got = vae.decode(z).sample
        assert calls == {"chunk": 0, "frames": 2}
        assert (got - stock.decode(z).sample).abs().max().item() < 1e-5


def test_qwenimage_fused_kernel_path_runs_through_the_view(monkeypatch):
    """The Triton path (here through the interpreter): the fused stages are applied to the view's Wan modules, the
    chunk decoder runs its fused blocks on the VAE's weights, and the output is diffusers' within float rounding;
    the VAE's own modules stay diffusers' (its frame loop still runs them where vaeopt steps aside)."""
    from vaeopt.engine.wan import ChunkDecoder

    stock = _tiny("AutoencoderKLQwenImage")
    vae = copy.deepcopy(stock)
    lines = []
    vaeopt.optimize(vae, device="cpu", triton="on", log=lines.append)
    assert any(x.startswith("✓ fused_norms: fused 29 RMSNorm+SiLU pairs") for x in lines), lines
    made = []
    real_back = ChunkDecoder.back
    monkeypatch.setattr(ChunkDecoder, "back", lambda self, *a, **k: made.append(self) or real_back(self, *a, **k))
    z = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        got, want = vae.decode(z).sample, stock.decode(z).sample
    ran = {d for d in made if d.vae is dropin.wan_runs(vae)}  # (not the planner's meta-device estimates)
    assert len(ran) == 1 and ran.pop().stats["fused_blocks"] > 10
    assert (got - want).abs().max().item() < 1e-4 and psnr(got, want) >= 90
    assert all(type(m).__module__.endswith("autoencoder_kl_qwenimage") for m in vae.decoder.modules()
               if not isinstance(m, (torch.nn.ModuleList, torch.nn.SiLU, torch.nn.Upsample, torch.nn.Conv2d,
                                     torch.nn.Dropout, torch.nn.Sequential, torch.nn.Identity)))


def test_qwenimage_pictures_are_graphed_through_the_view(monkeypatch):
    """Repeated pictures (one latent frame, the Qwen-Image pipeline's call) are captured whole once the measured
    rule says so, as for a Wan VAE: the captured callable is the chunk decoder on the view, and each replay gives
    diffusers' picture. (CPU stand-in for the capture, as in test_one_chunk_graphs.)"""
    from test_one_chunk_graphs import StandInGraphs

    from vaeopt import planner
    from vaeopt.stages import graphs as graphs_stage

    monkeypatch.setattr(planner, "graphs_rule", lambda: {
        "capture_factor": 3.0, "max_pixel_ratio": 4.0, "unmeasured_capture_margin": 4.0,
        "rows": [{"family": "qwenimage", "cls": "AutoencoderKLWan", "workload": None, "pixels": 48 * 64,
                  "variant": "bf16", "gpu": "test", "eager_ms": 10.0, "replay_ms": 5.0, "capture_ms": 10.0,
                  "source": "test"}]})
    monkeypatch.setattr(graphs_stage, "GraphedDecode", StandInGraphs)
    monkeypatch.setattr(dropin._RepeatGraphs, "_plain", lambda self, z, kw: not set(kw) - {"return_dict"})
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 40, 1 << 40))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "test")
    stock = _tiny("AutoencoderKLQwenImage")
    vae = copy.deepcopy(stock)
    lines = []
    vaeopt.optimize(vae, device="cpu", log=lines.append)
    runs = []
    real_dv = video.decode_video
    monkeypatch.setattr(video, "decode_video", lambda m, *a, **k: runs.append(m) or real_dv(m, *a, **k))
    StandInGraphs.made.clear()
    z = torch.randn(1, 16, 1, 6, 8, generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        want = stock.decode(z).sample
        outs = [vae.decode(z).sample for _ in range(3)]
        (tup,) = vae.decode(z, return_dict=False)
    (g,) = StandInGraphs.made
    assert g.captures == 1 and g.replays == 3 and sum("captured as a CUDA graph" in x for x in lines) == 1
    assert runs and all(m is dropin.wan_runs(vae) for m in runs)
    for out in outs + [tup]:
        assert out.shape == want.shape == (1, 3, 1, 48, 64) and (out - want).abs().max().item() < 1e-5


@pytest.mark.gpu
def test_gpu_qwenimage_dropin_runs_the_fused_wan_path():
    """On a GPU in bf16: the Qwen-Image drop-in applies the GPU stages through its Wan view (fused norms and
    epilogues, phase upsample convs) and decodes as an optimized AutoencoderKLWan with the same weights does, within
    bf16 rounding of diffusers' fp32 decode."""
    stock = _tiny("AutoencoderKLQwenImage")
    wan = _tiny("AutoencoderKLWan")
    wan.load_state_dict(stock.state_dict())
    z = torch.randn(1, 16, 1, 40, 36, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        ref = stock.decode(z).sample.cuda()
    lines = []
    vae = vaeopt.optimize(copy.deepcopy(stock).cuda().to(torch.bfloat16), log=lines.append)
    vaeopt.optimize(wan.cuda().to(torch.bfloat16), log=None)
    assert any(x.startswith("✓ fused_norms") for x in lines) and any(x.startswith("✓ fused_epilogues") for x in lines)
    zb = z.cuda().to(torch.bfloat16)
    with torch.inference_mode():
        got, twin = vae.decode(zb).sample, wan.decode(zb).sample
    assert got.shape == ref.shape and got.dtype == torch.bfloat16
    assert psnr(got.float(), twin.float()) >= 60 and psnr(got.float(), ref) >= 35


@pytest.mark.parametrize("where", ["decoder.conv_out", "decoder.up_blocks.0.resnets.0", "post_quant_conv"])
def test_qwenimage_module_swapped_after_optimize_is_the_one_decoding(monkeypatch, where):
    """A child module replaced on the VAE after optimize (`pipe.vae.decoder.conv_out = new_conv`: a fine-tuned or
    LoRA-merged layer) is not in the Wan view, whose modules were the VAE's at optimize time; the view would decode
    with the old one, silently. vaeopt steps aside at the next decode instead (its changes undone, one warning
    naming the module): the output is the stock model's with the same swap, bitwise."""
    stock = _tiny("AutoencoderKLQwenImage")
    vae = copy.deepcopy(stock)
    vaeopt.optimize(vae, device="cpu", log=None)
    z = torch.randn(1, 16, 1, 6, 8, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        before = vae.decode(z).sample  # the view's path, with the modules optimize saw
    parent, _, name = where.rpartition(".")
    new = copy.deepcopy(stock.get_submodule(where))
    with torch.no_grad():
        for p in new.parameters():
            p.mul_(-1)
    for m in (stock, vae):
        setattr(m.get_submodule(parent) if parent else m, name, copy.deepcopy(new))
    with torch.no_grad():
        want = stock.decode(z).sample
    calls = _spy(monkeypatch, vae)
    with torch.no_grad(), pytest.warns(UserWarning, match=f"vae.{where} was replaced after vaeopt.optimize"):
        got = vae.decode(z).sample
    assert calls == {"chunk": 0, "frames": 1} and torch.equal(got, want)
    assert (before - want).abs().max().item() > 0.01  # (the swap changes the image: the old view would be wrong)
    import warnings

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # and stays diffusers' decode, without a second warning
        assert torch.equal(vae.decode(z).sample, want)
