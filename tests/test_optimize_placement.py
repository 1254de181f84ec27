"""vaeopt.optimize(vae) where something else decides where the VAE runs: diffusers' group offloading (to disk, too),
accelerate's hooks, or another device than the one it was optimized for. There vae.decode gives the stock model's
output, and vaeopt's in-place layouts are not in the way; where nothing of that happens the fast path stays."""

import copy
import glob
import pickle
import warnings

import pytest
import torch

import vaeopt
from vaeopt.families import build_model, get_family

TINY_KL = dict(block_out_channels=[8, 16], norm_num_groups=4, layers_per_block=1, latent_channels=4,
               down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2)


def _pair(family="sd15", **cfg):
    """A stock model and a copy with the same weights, both in eval mode."""
    torch.manual_seed(0)
    stock = build_model(get_family(family), **(cfg or TINY_KL)).eval()
    twin = copy.deepcopy(stock)
    return stock, twin


def _decoder_convs(vae):
    parts = [m for m in (getattr(vae, "post_quant_conv", None), vae.decoder) if m is not None]
    return [m for p in parts for m in p.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d))
            and max(m.kernel_size) > 1]  # (a 1x1 kernel is contiguous in both layouts)


def _channels_last(vae) -> int:
    return sum(not c.weight.is_contiguous() for c in _decoder_convs(vae))


def _no_warnings():
    w = warnings.catch_warnings()
    w.__enter__()
    warnings.simplefilter("error")
    return w


def test_fast_path_keeps_its_layout_where_nothing_else_places_the_vae():
    """No offloading, the device it was optimized for: the channels_last weights stay (what the NHWC convs read),
    decode after decode, with no warning."""
    stock, vae = _pair()
    vaeopt.optimize(vae, device="cpu", log=None)
    n = len(_decoder_convs(vae))
    assert _channels_last(vae) == n > 5
    z = torch.randn(1, 4, 8, 8)
    w = _no_warnings()
    try:
        with torch.no_grad():
            for _ in range(2):
                got = vae.decode(z).sample
    finally:
        w.__exit__(None, None, None)
    assert _channels_last(vae) == n and getattr(vae, "_vaeopt_stood_down", None) is None
    with torch.no_grad():
        torch.testing.assert_close(got, stock.decode(z).sample, atol=1e-5, rtol=0)


@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_group_offloading_to_disk_after_optimize(tmp_path, offload_type):
    """Regression (diffusers' own test_group_offloading_with_disk failed on optimized models): group offloading
    with offload_to_disk_path saves `param.data` with safetensors, which refuses channels_last tensors ("You are
    trying to save a non contiguous tensor"). vae.enable_group_offload now undoes vaeopt's in-place changes first:
    the files are written, and the offloaded decode equals the stock model's."""
    stock, vae = _pair()
    vaeopt.optimize(vae, device="cpu", log=None)
    assert _channels_last(vae) > 0
    kw = {"num_blocks_per_group": 1} if offload_type == "block_level" else {}
    with pytest.warns(UserWarning, match="group offloading places its layers now.*diffusers' own decode"):
        vae.enable_group_offload(torch.device("cpu"), offload_type=offload_type, offload_to_disk_path=str(tmp_path),
                                 use_stream=False, **kw)
    assert glob.glob(str(tmp_path / "*.safetensors"))
    x = torch.randn(1, 3, 32, 32)
    z = torch.randn(1, 4, 8, 8)
    w = _no_warnings()  # said once, when it happened
    try:
        with torch.no_grad():
            got, got_z = vae(x).sample, vae.decode(z).sample
    finally:
        w.__exit__(None, None, None)
    with torch.no_grad():
        torch.testing.assert_close(got, stock(x).sample, atol=1e-5, rtol=0)
        torch.testing.assert_close(got_z, stock.decode(z).sample, atol=1e-5, rtol=0)


def test_pipeline_group_offload_goes_through_the_vae(tmp_path):
    """pipe.enable_group_offload(...) calls each component's own enable_group_offload: the same undo happens for a
    pipeline's VAE optimized with vaeopt.optimize(pipe.vae)."""
    from diffusers import DiffusionPipeline

    class Pipe(DiffusionPipeline):
        def __init__(self, vae):
            super().__init__()
            self.register_modules(vae=vae)

    stock, vae = _pair()
    pipe = Pipe(vae)
    vaeopt.optimize(pipe.vae, device="cpu", log=None)
    with pytest.warns(UserWarning, match="group offloading"):
        pipe.enable_group_offload(onload_device=torch.device("cpu"), offload_type="leaf_level",
                                  offload_to_disk_path=str(tmp_path))
    assert glob.glob(str(tmp_path / "*.safetensors"))
    z = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(pipe.vae.decode(z).sample, stock.decode(z).sample, atol=1e-5, rtol=0)


def test_group_offloading_applied_directly_stands_down_at_the_first_decode():
    """diffusers' apply_group_offloading(vae, ...) bypasses vae.enable_group_offload: vaeopt sees the offloading
    hooks at the first decode and decodes as diffusers does from then on (its layouts undone)."""
    from diffusers.hooks import apply_group_offloading

    stock, vae = _pair()
    vaeopt.optimize(vae, device="cpu", log=None)
    apply_group_offloading(vae, onload_device=torch.device("cpu"), offload_type="block_level",
                           num_blocks_per_group=1)
    z = torch.randn(1, 4, 8, 8)
    with torch.no_grad(), pytest.warns(UserWarning, match="group offloading on .* place its layers now"):
        got = vae.decode(z).sample
    assert _channels_last(vae) == 0
    with torch.no_grad():
        assert torch.equal(got, stock.decode(z).sample)


@pytest.mark.parametrize("triton", ["off", "on"])
def test_another_device_than_planned_decodes_as_diffusers(triton):
    """A VAE optimized for one device and decoding on another (optimize, then pipe.to('cuda'), or the reverse) no
    longer runs vaeopt's plan: a CPU plan's channels_last weights make cuDNN choose other algorithms than diffusers'
    NCHW convs (TF32: ~1e-4 apart), and a GPU plan's kernels do not run on the CPU. It now decodes as the stock model
    does there, once told why. The device change is simulated on the CPU by recording another planned device;
    triton='on' (the Triton interpreter on the CPU) stands for a GPU plan with fused norms."""
    if triton == "on":
        from vaeopt.kernels import triton_available

        ok, why = triton_available("cpu")
        if not ok:
            pytest.skip(why)
    stock, vae = _pair()
    vaeopt.optimize(vae, device="cpu", triton=triton, log=None)
    z = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        fast = vae.decode(z).sample
        want = stock.decode(z).sample
    assert not torch.equal(fast, want)  # the plan runs: not the stock model's arithmetic
    vae._vaeopt_device = torch.device("cuda")  # as if optimized on a GPU, and now on the CPU
    with torch.no_grad(), pytest.warns(UserWarning, match="optimized for cuda and decodes on cpu now"):
        got = vae.decode(z).sample
    assert torch.equal(got, want)
    assert _channels_last(vae) == 0
    assert type(vae.decoder.up_blocks[0].resnets[0].norm1) is type(stock.decoder.up_blocks[0].resnets[0].norm1)
    with torch.no_grad():  # for good, and quietly
        w = _no_warnings()
        try:
            assert torch.equal(vae.decode(z).sample, want)
        finally:
            w.__exit__(None, None, None)
    sd = vae.state_dict()
    assert all(torch.equal(v, stock.state_dict()[k]) for k, v in sd.items())
    lines = []
    assert vaeopt.optimize(vae, log=lines.append) is vae  # says why nothing happens, and what would
    assert len(lines) == 1 and "stepped aside" in lines[0] and "load or build the VAE again" in lines[0], lines


def test_model_cpu_offload_device_is_where_it_decodes(monkeypatch):
    """Under pipe.enable_model_cpu_offload() the weights rest on the CPU and decode on the hook's GPU: that GPU is
    where the plan must hold (optimize sets it up for it), not where the weights rest. Simulated: a CPU plan whose
    offload hook would move it to a GPU stands down; one whose hook runs on the CPU does not."""
    from vaeopt import dropin

    stock, vae = _pair()
    vaeopt.optimize(vae, device="cpu", log=None)
    z = torch.randn(1, 4, 8, 8)
    monkeypatch.setattr(dropin, "_offload_device", lambda v: torch.device("cpu"))
    with torch.no_grad():
        vae.decode(z)
    assert getattr(vae, "_vaeopt_stood_down", None) is None and _channels_last(vae) > 0
    monkeypatch.setattr(dropin, "_offload_device", lambda v: torch.device("cuda", 0))
    with torch.no_grad(), pytest.warns(UserWarning, match="optimized for cpu and decodes on cuda now"):
        got = vae.decode(z).sample
    with torch.no_grad():
        assert torch.equal(got, stock.decode(z).sample)


def test_wan_on_another_device_takes_diffusers_frame_loop(monkeypatch):
    """Wan's vae.decode runs vaeopt's chunk decoder; off its plan it runs diffusers' own frame loop, as the stock
    model does."""
    stock, vae = _pair("wan22", base_dim=8, decoder_base_dim=8)
    vaeopt.optimize(vae, device="cpu", log=None)
    from vaeopt import video

    calls = []
    real = video.decode_video
    monkeypatch.setattr(video, "decode_video", lambda *a, **k: calls.append(1) or real(*a, **k))
    z = torch.randn(1, stock.config.z_dim, 2, 4, 4)
    with torch.no_grad():
        vae.decode(z)
        assert calls == [1]
        vae._vaeopt_device = torch.device("cuda")
        with pytest.warns(UserWarning, match="decodes on cpu now"):
            got = vae.decode(z).sample
        assert calls == [1]
        assert torch.equal(got, stock.decode(z).sample)


def test_optimized_model_still_pickles_and_copies():
    """The enable_group_offload wrapper is a class, not a closure: torch.save(vae) and deepcopy keep working."""
    _, vae = _pair()
    vaeopt.optimize(vae, device="cpu", log=None)
    again = pickle.loads(pickle.dumps(vae))
    assert again.enable_group_offload.vae is again
    assert copy.deepcopy(vae).enable_group_offload.vae is not vae


def test_accelerate_sequential_offload_after_optimize_decodes_as_diffusers():
    """accelerate's cpu_offload (what pipe.enable_sequential_cpu_offload uses) after optimize: its hooks place each
    layer from a copy of the state dict, so vaeopt steps aside at the first decode, with the stock output."""
    from accelerate import cpu_offload

    stock, vae = _pair()
    vaeopt.optimize(vae, device="cpu", log=None)
    cpu_offload(vae, execution_device=torch.device("cpu"))
    z = torch.randn(1, 4, 8, 8)
    with torch.no_grad(), pytest.warns(UserWarning, match="accelerate hooks on .* place its layers now"):
        got = vae.decode(z).sample
    with torch.no_grad():
        assert torch.equal(got, stock.decode(z).sample)


@pytest.mark.gpu
def test_cpu_plan_moved_to_the_gpu_decodes_as_diffusers_there():
    """What diffusers' own memory tests do to an optimized model: optimized where it was built (the CPU), then
    .to('cuda'). With the CPU plan's channels_last weights cuDNN chose other (TF32) algorithms than for the stock
    model. Now the output on the GPU is the stock model's there."""
    stock, vae = _pair()
    vaeopt.optimize(vae, log=None)  # where the weights are: the CPU
    stock, vae = stock.cuda(), vae.cuda()
    z = torch.randn(1, 4, 8, 8, device="cuda")
    with torch.no_grad(), pytest.warns(UserWarning, match="optimized for cpu and decodes on cuda now"):
        got = vae.decode(z).sample
    with torch.no_grad():
        assert torch.equal(got, stock.decode(z).sample)


@pytest.mark.gpu
@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_gpu_plan_group_offloaded_to_disk_with_streams(tmp_path, offload_type):
    """A VAE optimized on the GPU (fused path, channels_last weights), then group-offloaded to disk with CUDA streams
    as diffusers' test_group_offloading_with_disk does: the files are written, and the decode equals the stock
    model's group-offloaded decode."""
    stock, vae = _pair()
    stock, vae = stock.cuda(), vae.cuda()
    vaeopt.optimize(vae, log=None)
    assert _channels_last(vae) > 0
    kw = {"num_blocks_per_group": 1} if offload_type == "block_level" else {}
    outs = []
    for m, d in ((stock, tmp_path / "stock"), (vae, tmp_path / "opt")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m.enable_group_offload(torch.device("cuda"), offload_type=offload_type, offload_to_disk_path=str(d),
                                   use_stream=True, record_stream=True, **kw)
        assert glob.glob(str(d / "*.safetensors"))
        with torch.no_grad():
            outs.append(m.decode(torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0)).cuda()).sample)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
def test_gpu_plan_moved_to_the_cpu_decodes_as_diffusers_there():
    """The reverse move: a VAE optimized on the GPU (fused norms, epilogues, channels_last) then .to('cpu') decodes
    as the stock model does on the CPU: vaeopt's GPU stages are undone, not half-run."""
    stock, vae = _pair()
    vaeopt.optimize(vae.cuda(), log=None)
    vae.cpu()
    z = torch.randn(1, 4, 8, 8)
    with torch.no_grad(), pytest.warns(UserWarning, match="optimized for cuda and decodes on cpu now"):
        got = vae.decode(z).sample
    with torch.no_grad():
        assert torch.equal(got, stock.decode(z).sample)
