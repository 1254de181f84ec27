"""vaeopt.distributed: band-parallel decode over 2 and 3 CPU processes (gloo) == the single-process decode; many
files spread over ranks, each output written once; a failing or dying rank gives one clear error, no hang.

Real data: the trained tiny_kl_image VAE (astronaut and coffee latents, cropped; the coffee crop has 13 latent rows,
which split 6/7 and 4/4/5) and the trained tiny_wan_video VAE (3 latent frames of a 5x4 crop: bands of 1 and 2 latent
rows with 3 ranks; chunks [1, 2], so the causal caches carry across calls); plus a random small Wan 2.2 (patch 2,
DupUp3D, batch 2) and, on the Triton interpreter, the GPU path (fused stages applied, kernels, folded biases).
Every rank count runs in ONE launch (process start + imports dominate on a small CPU): the ranks run all
cases and rank 0 returns the results.
"""

from __future__ import annotations

import math
import os
import time

import pytest
import torch
import torch.distributed as dist

from vaeopt import distributed as D

SCALING = 0.30478  # tiny_kl_image latents are pipeline-scaled (the scaling_factor in its metadata)
IMG_CROPS = {"astronaut": (slice(20, 37), slice(24, 36)), "coffee": (slice(3, 16), slice(5, 16))}
WAN_CROP = ("astronaut_pan", slice(0, 3), slice(10, 15), slice(30, 34))
LAUNCH_TIMEOUT = 300  # a hang guard, not a speed check: the launch shares the cores with another test worker


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = (a.double() - b.double()).pow(2).mean().item()
    return float("inf") if mse == 0 else 10 * math.log10(4.0 / mse)


def _image_inputs(samples: str):
    from vaeopt.loading import load_vae

    vae = load_vae(os.path.join(samples, "tiny_kl_image.safetensors")).model
    lat = torch.load(os.path.join(samples, "tiny_kl_image_latents.pt"))
    zs = {k: (lat[k].float()[:, :, r, c] / SCALING).contiguous() for k, (r, c) in IMG_CROPS.items()}
    return vae, zs


def _wan_inputs(samples: str, rows: slice | None = None):
    from vaeopt.loading import load_vae

    vae = load_vae(os.path.join(samples, "tiny_wan_video.safetensors")).model
    name, t, r, c = WAN_CROP
    r = r if rows is None else rows
    z = torch.load(os.path.join(samples, "tiny_wan_video_latents.pt"))[name].float()[:, :, t, r, c].contiguous()
    return vae, z


def _triton_ok() -> bool:
    from vaeopt.kernels import triton_available

    return triton_available("cpu")[0]


def _wan22_inputs():
    """Wan 2.2 topology (residual up blocks with DupUp3D, patch_size 2), random small weights, a batch of 2."""
    from vaeopt.families import build_model, get_family

    torch.manual_seed(0)
    vae = build_model(get_family("wan22"), base_dim=8, decoder_base_dim=8)
    z = torch.randn(2, 48, 3, 5, 4, generator=torch.Generator().manual_seed(1))
    return vae, z


# ---------------------------------------------------------------------------------------------- rank workers


def _suite(samples: str, files_job: dict | None):
    """Runs on every rank: all band decodes (+ the many-files run). Rank 0 returns everything."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    res: dict = {}
    vae, zs = _image_inputs(samples)
    for name, z in zs.items():
        res[name] = D.band_parallel_decode(vae, z, return_info=True)
    # gather=False: every rank keeps its band and its output rows
    band, rows = D.band_parallel_decode(vae, zs["coffee"], gather=False)
    allb = [None] * dist.get_world_size()
    dist.all_gather_object(allb, (rows, band))
    res["coffee_bands"] = allb
    wan, zw = _wan_inputs(samples)
    res["wan"] = D.band_parallel_decode(wan, zw, chunk=2, return_info=True)
    from vaeopt.stages import upsample_conv

    upsample_conv.apply(wan, force=True)  # the resample convs as 2x2 phase convs inside the bands (torch path)
    res["wan_phase"] = D.band_parallel_decode(wan, zw, chunk=2, return_info=True)
    upsample_conv.revert(wan)
    w22, z22 = _wan22_inputs()
    res["wan22"] = D.band_parallel_decode(w22, z22, chunk=2, return_info=True)
    if _triton_ok() and files_job is not None:  # once (2 ranks; the interpreter is slow)
        # the GPU path on CPU (Triton interpreter): pipeline stages applied (NHWC, fused GroupNorm+SiLU, patched
        # epilogues), Triton statistics/apply kernels, conv biases folded, upsample written by the epilogue
        from vaeopt.stages import channels_last, fused_epilogues, fused_norms

        for st in (channels_last, fused_norms, fused_epilogues):
            st.apply(vae)
        res["coffee_fused"] = D.band_parallel_decode(vae, zs["coffee"], kernels=True, return_info=True)
        # Wan's fused chunk path (bias folding through the halo-aware _run)
        fused_norms.apply(wan)
        channels_last.apply(wan)
        res["wan_fused"] = D.band_parallel_decode(wan, zw, chunk=2, fused=True, return_info=True)
        # every causal conv time-stacked (stacked_conv3d's Conv2d over the stack; halo rows of the stack)
        from vaeopt.stages import stacked_conv3d

        stacked_conv3d.mark(stacked_conv3d.candidates(wan, every=True))
        res["wan_stacked"] = D.band_parallel_decode(wan, zw, chunk=2, fused=True, return_info=True)
        stacked_conv3d.revert(wan)
    if dist.get_world_size() == 3:
        # 3 latent rows on 3 ranks: the middle band is one row with a neighbour on each side, so both halos land on
        # the same output rows (torch path; and with the kernels: stacked convs, tap head, chunked attention)
        wan3, z3 = _wan_inputs(samples, rows=slice(10, 13))
        res["wan_onerow"] = D.band_parallel_decode(wan3, z3, chunk=2, return_info=True)
        if _triton_ok():
            from vaeopt.stages import channels_last, fused_norms, stacked_conv3d

            fused_norms.apply(wan3)
            channels_last.apply(wan3)
            # every causal conv stacked but the head, which then runs on tapconv
            stacked_conv3d.mark(m for m in stacked_conv3d.candidates(wan3, every=True) if m is not wan3.decoder.conv_out)
            res["wan_onerow_kernels"] = D.band_parallel_decode(wan3, z3, chunk=2, fused=True, return_info=True)
    if files_job is not None:
        job = dict(files_job)
        one = job.pop("output_one")
        res["files"] = D.decode_files_distributed(**job)  # 3 jobs on 2 ranks: spread
        res["one_file"] = D.decode_files_distributed(**{**job, "latents": job["latents"][:1], "output": one})
    return res if rank == 0 else None


def _fail(kind: str):
    if dist.get_rank() == 1:
        time.sleep(0.5)
        if kind == "raise":
            raise ValueError("boom on rank 1")
        os._exit(7)
    t = torch.zeros(4)
    dist.all_reduce(t)  # rank 0 waits here for a peer that never comes
    dist.all_reduce(t)
    return "unreachable"


def _hello(x):
    return (dist.get_rank(), dist.get_world_size(), x)


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def refs(samples_dir):
    vae, zs = _image_inputs(str(samples_dir))
    wan, zw = _wan_inputs(str(samples_dir))
    with torch.no_grad():
        out = {k: vae.decode(z).sample for k, z in zs.items()}
        out["wan"] = wan.decode(zw).sample
        wan3, z3 = _wan_inputs(str(samples_dir), rows=slice(10, 13))
        out["wan_onerow"] = wan3.decode(z3).sample
        w22, z22 = _wan22_inputs()
        out["wan22"] = w22.decode(z22).sample
    return out


@pytest.fixture(scope="module")
def latent_files(tmp_path_factory, samples_dir):
    d = tmp_path_factory.mktemp("lat")
    lat = torch.load(samples_dir / "tiny_kl_image_latents.pt")
    paths = []
    for i, (name, r, c) in enumerate([("astronaut", slice(0, 9), slice(0, 7)), ("coffee", slice(2, 8), slice(0, 10)),
                                      ("astronaut", slice(30, 35), slice(40, 48))]):
        p = d / f"lat{i}.pt"
        torch.save(lat[name][:, :, r, c].clone(), p)
        paths.append(str(p))
    return paths


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def run(request, samples_dir, latent_files, tmp_path_factory):
    world = request.param
    files_job = None
    if world == 2:
        out = tmp_path_factory.mktemp("out")
        one = tmp_path_factory.mktemp("one")
        files_job = {"latents": latent_files, "model": str(samples_dir / "tiny_kl_image.safetensors"),
                     "output": str(out), "output_one": str(one)}
    t0 = time.perf_counter()
    res = D.launch(world, _suite, str(samples_dir), files_job, timeout=LAUNCH_TIMEOUT)
    print(f"\n{world} ranks: launch + all cases {time.perf_counter() - t0:.1f} s")
    return world, res


# ---------------------------------------------------------------------------------------------------- tests


def test_band_rows_and_assignment():
    assert D.band_rows(13, 2) == [(0, 6), (6, 13)]
    assert D.band_rows(13, 3) == [(0, 4), (4, 8), (8, 13)]
    assert D.band_rows(5, 5) == [(i, i + 1) for i in range(5)]
    a = D.assign_jobs([10, 1, 1, 8, 2], 2)
    assert sorted(sum(a, [])) == [0, 1, 2, 3, 4]
    assert a == [[0, 1], [2, 3, 4]]  # 10+1 vs 8+2+1: largest first to the least loaded rank (ties: rank 0)


@pytest.mark.parametrize("name", list(IMG_CROPS))
def test_image_band_decode_matches_single_process(run, refs, name):
    world, res = run
    out, info = res[name]
    ref = refs[name]
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = (out - ref).abs().max().item()
    p = psnr(out, ref)
    print(f"{name} {tuple(ref.shape)} on {world} ranks: {p:.1f} dB, max abs {err:.2e}, "
          f"{info['halo_exchanges']} halo exchanges ({info['halo_bytes']} B sent by rank 0), "
          f"{info['stat_merges']} GroupNorm stat merges, bands {info['bands']}")
    assert p >= 100.0 and err <= 1e-4
    assert info["notes"] == []  # query-split attention, no fallbacks
    assert info["world"] == world and len(info["bands"]) == world


def test_fused_kernel_path_matches_single_process(run, refs):
    """What runs on a GPU: NHWC, fused norms and epilogues applied, Triton GroupNorm statistics/apply, conv biases
    folded into the next norm / the residual epilogue (also through a 1x1 shortcut), upsample by the epilogue."""
    world, res = run
    if "coffee_fused" not in res:
        pytest.skip("runs in the 2-rank launch, with triton (interpreter) available")
    out, info = res["coffee_fused"]
    ref = refs["coffee"]
    err = (out - ref).abs().max().item()
    print(f"fused path on {world} ranks: {psnr(out, ref):.1f} dB, max abs {err:.2e}")
    assert err <= 1e-4 and psnr(out, ref) >= 100.0 and info["notes"] == []
    assert info["fold"] and info["bias_folded"] > 0 and info["upsample_fused"] == 3
    if "wan_fused" in res:
        out, info = res["wan_fused"]
        assert info["stats"].get("fused_blocks", 0) > 0 and info["stats"].get("bias_folded", 0) > 0
        # the mid-block attention on the chunked GEMM path (this rank's queries), once per call
        assert info["stats"].get("attention_chunked", 0) == len(info["schedule"])
        # the head conv as tapconv's GEMM + tap sum, its edge rows from the neighbours' GEMM rows
        assert info["stats"].get("conv_taps", 0) == len(info["schedule"])
        assert (out - refs["wan"]).abs().max().item() <= 1e-4
        assert info["stats"].get("stacked_conv", 0) == 0
    if "wan_stacked" in res:
        out, info = res["wan_stacked"]
        # chunks [1, 2]: per call, the 3x3x3 causal convs of the mid and up blocks ran time-stacked on every band
        assert info["stats"].get("stacked_conv", 0) > 0, info["stats"]
        err = (out - refs["wan"]).abs().max().item()
        print(f"wan time-stacked on {world} ranks: {psnr(out, refs['wan']):.1f} dB, max abs {err:.2e}, "
              f"{info['stats']['stacked_conv']} stacked convs")
        assert err <= 1e-4


def test_gather_false_returns_each_rank_its_rows(run, refs):
    world, res = run
    ref = refs["coffee"]
    bands = res["coffee_bands"]
    assert len(bands) == world
    y = 0
    for (y0, y1), band in bands:
        assert y0 == y and y1 > y0
        assert (band - ref[:, :, y0:y1]).abs().max().item() <= 1e-4
        y = y1
    assert y == ref.shape[2]


def test_wan_band_decode_matches_single_process(run, refs):
    world, res = run
    out, info = res["wan"]
    ref = refs["wan"]
    assert out.shape == ref.shape == (1, 3, 9, 40, 32)
    err = (out - ref).abs().max().item()
    print(f"wan {tuple(ref.shape)} on {world} ranks: {psnr(out, ref):.1f} dB, max abs {err:.2e}, "
          f"schedule {info['schedule']}, bands {info['bands']}")
    assert info["schedule"] == [1, 2]
    assert err <= 1e-4 and psnr(out, ref) >= 100.0


def test_wan_band_decode_with_phase_upsample_convs(run, refs):
    """stages/upsample_conv's phase convs on each band (zero padding at the band edges, rows fixed by the halo
    slabs as for the plain conv): the same decode."""
    world, res = run
    out, info = res["wan_phase"]
    assert info["stats"].get("upsample_phase", 0) > 0
    assert (out - refs["wan"]).abs().max().item() <= 1e-4


def test_one_row_band_between_two_neighbours(run, refs):
    """A middle band of one latent row: the halos from above and below both complete the same output rows."""
    world, res = run
    if "wan_onerow" not in res:
        pytest.skip("runs in the 3-rank launch")
    ref = refs["wan_onerow"]
    for key in ("wan_onerow", "wan_onerow_kernels"):
        if key not in res:
            continue
        out, info = res[key]
        assert out.shape == ref.shape
        err = (out - ref).abs().max().item()
        print(f"{key} on {world} ranks (bands of 1 latent row): {psnr(out, ref):.1f} dB, max abs {err:.2e}, "
              f"{ {k: v for k, v in info['stats'].items() if k in ('stacked_conv', 'conv_taps', 'attention_chunked')} }")
        assert err <= 1e-4
        if key == "wan_onerow_kernels":
            st = info["stats"]
            assert st.get("stacked_conv", 0) > 0 and st.get("conv_taps", 0) > 0 and st.get("attention_chunked", 0) > 0


def test_wan22_band_decode_matches_single_process(run, refs):
    world, res = run
    out, info = res["wan22"]
    ref = refs["wan22"]
    assert out.shape == ref.shape == (2, 3, 9, 80, 64) and info["scale"] == 16  # patch 2: 16 px per latent row
    assert (out - ref).abs().max().item() <= 1e-4


def test_many_files_each_output_written_once(run):
    world, res = run
    if world != 2:
        pytest.skip("many-files mode runs in the 2-rank launch")
    summary = res["files"]
    assert len(summary) == 3 and [d["index"] for d in summary] == [0, 1, 2]
    written = [w for d in summary for w in d["written"]]
    assert len(written) == len(set(written)) == 3
    assert all(os.path.getsize(w) > 0 for w in written)
    assert {d["rank"] for d in summary} == {0, 1} and {d["mode"] for d in summary} == {"files"}
    one = res["one_file"]  # one job, 2 ranks: decoded together band-parallel, written by rank 0
    assert len(one) == 1 and one[0]["mode"] == "band" and one[0]["rank"] == 0
    assert len(one[0]["written"]) == 1 and os.path.getsize(one[0]["written"][0]) > 0
    assert sorted(os.listdir(os.path.dirname(one[0]["written"][0]))) == ["lat0.png"]


def test_ranks_check_the_callers_limits(samples_dir, tmp_path):
    """`--gpus` runs check the caller's --max-outputs / --max-output-gb on every rank before any decode, as one-GPU
    runs do: a file with more tensors than allowed is refused and nothing is written."""
    from vaeopt.api import Limits

    lat = torch.load(samples_dir / "tiny_kl_image_latents.pt")["astronaut"][:, :, :8, :8]
    src = tmp_path / "three.pt"
    torch.save([lat.clone() for _ in range(3)], src)
    out = tmp_path / "out"
    with pytest.raises(D.DistributedError, match="max-outputs"):
        D.launch(1, D.decode_files_distributed, [str(src)], str(samples_dir / "tiny_kl_image.safetensors"),
                 kwargs=dict(output=str(out / "x.png"), latent_space="scaled", limits=Limits(max_outputs=2)),
                 backend="gloo", timeout=120)
    assert not out.exists()


@pytest.mark.parametrize("kind,expect", [("raise", "ValueError: boom on rank 1"), ("exit", "died (exit code 7)")])
def test_rank_failure_is_a_clear_error_not_a_hang(kind, expect):
    t0 = time.perf_counter()
    with pytest.raises(D.DistributedError) as ei:
        D.launch(2, _fail, kind, backend="gloo", timeout=60)
    dt = time.perf_counter() - t0
    msg = str(ei.value)
    print(f"\n{kind}: {dt:.1f} s -> {msg.splitlines()[0]}")
    assert msg.startswith("rank 1 failed: " + expect), msg
    assert dt < 45


def test_launch_joins_an_existing_torchrun_job(monkeypatch):
    """With torchrun's variables set, launch() runs fn in this process (world of 1 here) instead of spawning."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(D._free_port()))
    monkeypatch.delenv("_VAEOPT_SPAWNED", raising=False)
    assert D.under_torchrun()
    assert D.launch(None, _hello, "x", backend="gloo") == (0, 1, "x")
    assert not dist.is_initialized()
    assert os.environ["NCCL_NVLS_ENABLE"] == "0" and os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    with pytest.raises(D.DistributedError, match="torchrun with 1 ranks"):
        D.launch(2, _hello, "x", backend="gloo")


def test_band_decode_needs_a_process_group():
    from vaeopt.families import build_model, get_family

    vae = build_model(get_family("sdxl"), block_out_channels=[32, 32, 64, 64], norm_num_groups=8)
    with pytest.raises(D.DistributedError, match="process group"):
        D.band_parallel_decode(vae, torch.zeros(1, 4, 4, 4))


def test_wan_with_fp8_convs_is_not_split(samples_dir):
    """triton_conv's e4m3 convs stage their inputs in fp8, which the bands' halo convs cannot take: supports_band
    says so (decode_files_distributed's auto mode then decodes one file per rank), band_parallel_decode refuses."""
    wan, z = _wan_inputs(str(samples_dir))
    assert D.supports_band(wan) == (True, "")
    wan.decoder.up_blocks[0].resnets[0].conv1._vaeopt_fp8conv = True
    ok, why = D.supports_band(wan)
    assert not ok and "1 of the decoder's convs run in fp8" in why and "one GPU" in why
    with pytest.raises(D.DistributedError, match="fp8"):
        D.band_parallel_decode(wan, z)
