"""The sample trainer (scripts/train_sample_vaes.py) trains the Wan video VAE on whole clips in one call per module;
the weights it ships are decoded by diffusers' frame-by-frame cached loop and by vaeopt. The whole-clip forward must
be the same function as the cached loop, or the trained model would decode differently from how it was trained."""

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_sample_vaes.py"


@pytest.fixture(autouse=True)
def torch_flags_kept():
    """trainer.main sets process-wide torch flags (cuDNN autotuning, TF32) for its run: put them back, so the tests
    that run after these in the same process see torch's settings, not the trainer's."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    was = cudnn.benchmark, cudnn.allow_tf32, matmul.allow_tf32
    yield
    cudnn.benchmark, cudnn.allow_tf32, matmul.allow_tf32 = was


@pytest.fixture(scope="module")
def trainer():
    spec = importlib.util.spec_from_file_location("train_sample_vaes", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


def _in_child(body: str) -> str:
    """Run `body` in a fresh interpreter with the trainer loaded as `trainer`; returns its stdout. For the runs whose
    torch.compile fails: after that, torch's frame hook keeps every Python frame's arguments alive until it returns,
    for the rest of the process, which would change what later tests in this worker measure of memory."""
    code = textwrap.dedent(f"""
        import importlib.util, sys, torch
        spec = importlib.util.spec_from_file_location("train_sample_vaes", {str(SCRIPT)!r})
        trainer = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = trainer
        spec.loader.exec_module(trainer)
        torch.set_num_threads(1)
    """) + textwrap.dedent(body)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r.stdout


def _tiny_cfg(trainer):
    # the shipped layout (three levels of 2x downsampling, two of them also in time) at widths a CPU runs in
    # milliseconds; a decoder wider than the encoder, as the sample's is
    return dict(trainer.VIDEO_CONFIG, base_dim=4, decoder_base_dim=8, z_dim=4)


@pytest.fixture(scope="module")
def tiny_wan(trainer):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(**_tiny_cfg(trainer)).eval()
    with torch.no_grad():  # larger biases than the default init, so a frame mixed up in time would show
        for m in vae.modules():
            if isinstance(getattr(m, "bias", None), torch.nn.Parameter):
                m.bias.normal_(0, 0.2)
        vae.decoder.conv_out.weight.mul_(20)  # outputs past [-1, 1], where the clamp of diffusers' decode acts
    return trainer.whole_clip(vae)


# frames: a single frame (no temporal resampling runs), one latent step, and the shipped clips' 17 (five latent
# frames: the cache carries state across four chunk boundaries); 24x40 is not square and not a power of two
@pytest.mark.parametrize("frames", [1, 5, 17])
def test_whole_clip_encode_equals_diffusers_encode(trainer, tiny_wan, frames):
    torch.manual_seed(frames)
    x = torch.rand(2, 3, frames, 24, 40) * 2 - 1
    with torch.no_grad():
        ref = tiny_wan.encode(x).latent_dist
        got = trainer.wan_encode_whole(tiny_wan, x)
    assert got.mean.shape == ref.mean.shape == (2, 4, 1 + (frames - 1) // 4, 3, 5)
    torch.testing.assert_close(got.mean, ref.mean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.logvar, ref.logvar, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("latent_frames", [1, 2, 5])
def test_whole_clip_decode_equals_diffusers_decode(trainer, tiny_wan, latent_frames):
    torch.manual_seed(latent_frames)
    z = torch.randn(2, 4, latent_frames, 3, 5)
    with torch.no_grad():
        ref = tiny_wan.decode(z).sample  # diffusers' cached loop, clamped to [-1, 1]
        loop = trainer.wan_decode_unclamped(tiny_wan, z)  # the same loop, unclamped
        got = trainer.wan_decode_whole(tiny_wan, z)
    assert got.shape == ref.shape == (2, 3, 1 + 4 * (latent_frames - 1), 24, 40)
    assert got.abs().max() > 1  # the unclamped decode is what trains: the comparison below must see the clamp
    torch.testing.assert_close(got, loop, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.clamp(-1, 1), ref, atol=1e-5, rtol=1e-5)


def test_whole_clip_trains_the_same_function_as_the_loop(trainer, tiny_wan):
    """The gradients agree too: a step on whole clips is a step on the function the cached loop computes."""
    torch.manual_seed(3)
    z = torch.randn(1, 4, 3, 3, 5)
    grads = []
    for fwd in (trainer.wan_decode_whole, trainer.wan_decode_unclamped):
        tiny_wan.zero_grad(set_to_none=True)
        fwd(tiny_wan, z).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in tiny_wan.decoder.named_parameters() if p.grad is not None})
    tiny_wan.zero_grad(set_to_none=True)
    assert grads[0].keys() == grads[1].keys() and any("time_conv" in n for n in grads[0])
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=1e-5, rtol=1e-4, msg=n)


def test_saved_sample_decodes_the_same_through_vaeopt(trainer, tiny_wan, tmp_path):
    """The trainer's file (fp16 weights, config with a decoder wider than the encoder in its metadata) is read by
    vaeopt as the model it trained: vaeopt's decode equals diffusers' decode of the same fp16 weights."""
    import vaeopt
    from diffusers import AutoencoderKLWan

    cfg = _tiny_cfg(trainer)
    path = tmp_path / "tiny_wan.safetensors"
    sd = trainer.save_weights(tiny_wan, cfg, path)
    ref_vae = AutoencoderKLWan(**cfg).eval()
    ref_vae.load_state_dict({k: v.float() for k, v in sd.items()})
    torch.manual_seed(4)
    z = torch.randn(1, 4, 3, 3, 5)
    with torch.no_grad():
        ref = ref_vae.decode(z).sample
    out = vaeopt.decode(z, path, latent_space="raw")
    assert out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=0)


def _step_grads(trainer, fwd, x, decoder_only, seed):
    """One training step's loss and gradients through `fwd` (a VideoForward), as the trainer takes it."""
    fwd.vae.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # post.sample()'s noise
    total, loss, psnr, kl = trainer.video_loss(fwd, x, 1e-3, decoder_only, torch.autocast("cpu", enabled=False))
    total.backward()
    grads = {n: p.grad.clone() for n, p in fwd.vae.named_parameters() if p.grad is not None}
    fwd.vae.zero_grad(set_to_none=True)
    return total.detach(), grads


def test_compiled_step_equals_eager_step_without_recompiling(trainer, tiny_wan):
    """The compiled training step (encoder and decoder compiled apart) is the eager step: same loss, same gradients, in
    both phases of a run; and the switch to the decoder-only phase reuses the two compiled graphs. aot_eager traces
    what inductor compiles (dynamo's graph, AOTAutograd's forward and backward) and runs it op by op; inductor's C++
    build of this graph takes minutes on a CPU."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    eager = trainer.VideoForward(tiny_wan)
    compiled = trainer.VideoForward(tiny_wan, compile_mode="default", backend=counter)
    torch.manual_seed(5)
    x = torch.rand(2, 3, 5, 16, 24) * 2 - 1
    for decoder_only in (False, True):
        ref_total, ref = _step_grads(trainer, eager, x, decoder_only, seed=6)
        got_total, got = _step_grads(trainer, compiled, x, decoder_only, seed=6)
        torch.testing.assert_close(got_total, ref_total, atol=1e-5, rtol=1e-5)
        assert got.keys() == ref.keys()
        # the full phase trains both halves; the decoder-only phase leaves the encoder without gradient (frozen)
        assert any(n.startswith("encoder.") for n in ref) != decoder_only
        assert any(n.startswith("decoder.") and "time_conv" in n for n in ref)
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=1e-4, msg=n)
    assert compiled.compile_mode == "default" and counter.frame_count == 2  # encoder + decoder, compiled once each
    torch._dynamo.reset()


def test_decoder_only_step_is_the_frozen_encoder_step(trainer, tiny_wan):
    """The decoder-only phase (encoder output detached, so the compiled graphs hold) trains the decoder exactly as a
    frozen encoder under no_grad did: the decoder's gradients on the fp16-rounded latents of the encoder's mode."""
    torch.manual_seed(7)
    x = torch.rand(1, 3, 5, 16, 16) * 2 - 1
    _, got = _step_grads(trainer, trainer.VideoForward(tiny_wan), x, True, seed=0)
    with torch.no_grad():
        z = trainer.wan_encode_whole(tiny_wan, x).mode().half().float()
    rec = trainer.wan_decode_whole(tiny_wan, z)
    loss, _ = trainer.recon_loss(rec.transpose(1, 2).flatten(0, 1), x.transpose(1, 2).flatten(0, 1))
    loss.backward()
    ref = {n: p.grad.clone() for n, p in tiny_wan.named_parameters() if p.grad is not None}
    tiny_wan.zero_grad(set_to_none=True)
    assert got.keys() == ref.keys() and not any(n.startswith(("encoder.", "quant_conv")) for n in got)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=1e-6, rtol=1e-5, msg=n)


def test_compile_failure_falls_back_to_eager():
    """A compiler that fails costs the run nothing but the compile: the step runs eager and says so once."""
    out = _in_child("""
        from diffusers import AutoencoderKLWan
        torch.manual_seed(0)
        vae = trainer.whole_clip(AutoencoderKLWan(**dict(trainer.VIDEO_CONFIG, base_dim=4, decoder_base_dim=8,
                                                         z_dim=4)).eval())
        def broken(gm, example_inputs):
            raise RuntimeError("no compiler here")
        fwd = trainer.VideoForward(vae, compile_mode="default", backend=broken)
        x = torch.rand(1, 3, 1, 16, 16) * 2 - 1
        try:
            fwd(x, False)
        except Exception as e:
            fwd.eager(e)
        else:
            raise SystemExit("the broken compiler did not fail")
        assert fwd.compile_mode == "off" and fwd.encoder is vae.encoder and fwd.decoder is vae.decoder
        post, rec = fwd(x, False)
        print("shape", tuple(rec.shape))
    """)
    assert out.count("torch.compile failed (") == 1 and "shape (1, 3, 1, 16, 16)" in out


def test_crop_curriculum(trainer):
    """Small crops (a larger batch) for the first --small-frac of the run, then the full crop; off by default."""
    from types import SimpleNamespace

    args = SimpleNamespace(small_crop=96, small_batch=40, small_frac=0.5, batch=16, crop=160)
    assert [trainer.crop_at(f, args) for f in (0.0, 0.49, 0.5, 0.99)] == [(40, 96), (40, 96), (16, 160), (16, 160)]
    assert trainer.crop_at(0.0, SimpleNamespace(**{**vars(args), "small_crop": 0})) == (16, 160)



def test_training_run_survives_a_failing_compiler(tmp_path):
    """The whole run, as the GPU command starts it (compile, crop curriculum, decoder-only phase), with a compiler
    that fails: it logs one line, trains every step eager, and writes the weights, latents and measurements."""
    import json

    data = SCRIPT.parents[1] / ".train_data" / "photos.npz"
    if not data.is_file():
        pytest.skip("no photo pack (make it with `train_sample_vaes.py --which pack`)")
    log = _in_child(f"""
        from torch._dynamo import register_backend
        @register_backend(name="broken_for_test")
        def broken(gm, example_inputs):
            raise RuntimeError("no compiler here")
        trainer.main(["--which", "video", "--data", {str(data)!r}, "--out", {str(tmp_path)!r}, "--minutes", "0",
                      "--max-steps", "4", "--batch", "1", "--crop", "16", "--small-crop", "8", "--small-batch", "2",
                      "--decoder-only", "0.25", "--compile", "default", "--compile-backend", "broken_for_test",
                      "--base-dim", "4", "--decoder-base-dim", "4", "--skip-frames", "--log-every", "0",
                      "--device", "cpu"])
    """)
    assert log.count("torch.compile failed (") == 1 and "training eager" in log
    assert "batch 2 of 17x8x8 clips" in log and "batch 1 of 17x16x16 clips" in log and "encoder frozen" in log
    res = json.loads((tmp_path / "video_results.json").read_text())
    assert res["train_steps"] == 4 and res["astronaut_pan"]["psnr_db"] > 0
    assert {p.name for p in tmp_path.iterdir()} == {"tiny_wan_video.safetensors", "tiny_wan_video_latents.pt",
                                                    "video_results.json"}


def test_a_diverged_run_stops_with_one_line(trainer, tmp_path, monkeypatch):
    """Losses that are never finite are a diverged run, not rare bf16 blow-ups: it stops with one line instead of
    skipping batches for ever (a --max-steps run would never end) and writes nothing."""
    data = SCRIPT.parents[1] / ".train_data" / "photos.npz"
    if not data.is_file():
        pytest.skip("no photo pack (make it with `train_sample_vaes.py --which pack`)")
    nan = torch.tensor(float("nan"))
    monkeypatch.setattr(trainer, "video_loss", lambda *a, **k: (nan, nan, 0.0, nan))
    with pytest.raises(SystemExit, match="non-finite batches in 0 steps: the run diverged"):
        trainer.main(["--which", "video", "--data", str(data), "--out", str(tmp_path), "--minutes", "0",
                      "--max-steps", "4", "--batch", "1", "--crop", "16", "--base-dim", "4", "--decoder-base-dim", "4",
                      "--skip-frames", "--log-every", "0", "--device", "cpu"])
    assert not any(tmp_path.iterdir())
