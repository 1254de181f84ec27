"""Where the tiled image decoder keeps its full-size buffers (vaeopt/engine/store.py `place`,
tiling_memory.storage_buffers): all on the device when they fit, else the ones that fit beside the working set on the
device and the rest on the host; the decode is bitwise the same whichever way they are placed."""

from __future__ import annotations

import weakref

import pytest
import torch

from vaeopt import tiling, tiling_memory
from vaeopt.engine import store
from vaeopt.engine.store import place
from vaeopt.families import build_model, get_family

GIB = 2**30
SCALING = 0.30478  # the scaling_factor in samples/tiny_kl_image.safetensors


@pytest.fixture(scope="module")
def sdxl():
    with torch.device("meta"):
        return build_model(get_family("sdxl")).to(torch.bfloat16)


@pytest.fixture(scope="module")
def vae(sample_kl_vae):
    return sample_kl_vae


@pytest.fixture(scope="module")
def z(samples_dir):
    lat = torch.load(samples_dir / "tiny_kl_image_latents.pt")
    return (lat["coffee"].float() / SCALING)[..., :16, :24].contiguous()


def device_peak(bufs, placement) -> int:
    steps = range(2 * len(bufs) + 1)
    return max(sum(b for (b, a, f), d in zip(bufs, placement) if d and a <= s < f) for s in steps)


def test_sdxl_4096_buffers(sdxl):
    """sdxl at 4096² in bf16: 18 buffers, 41 GiB allocated over the decode, at most 16 GiB alive at once (the
    channel-changing resnet at full resolution: its 8 GiB input, 4 GiB conv1 output and 4 GiB block output)."""
    bufs = tiling_memory.storage_buffers(sdxl, (512, 512), torch.bfloat16)
    assert len(bufs) == 18 and sum(b for b, _, _ in bufs) == 41 * GIB
    assert device_peak(bufs, [True] * 18) == tiling_memory.storage_bytes(sdxl, (512, 512), torch.bfloat16) == 16 * GIB
    assert sorted({b // GIB for b, _, _ in bufs if b >= GIB}) == [1, 2, 4, 8]


def test_place_all_device_when_they_fit(sdxl):
    bufs = tiling_memory.storage_buffers(sdxl, (512, 512), torch.bfloat16)
    assert place(bufs, 16 * GIB) == [True] * len(bufs)
    assert place(bufs, 0) == [False] * len(bufs)


def test_place_overflow_to_host(sdxl):
    """Within the 12.1 GiB a 16 GB budget leaves beside the working set of 1152-px tiles, only the conv1 output of the
    channel-changing resnet at 4096² goes to the host: 4 GiB, the least that can (16 GiB are alive at that step), and
    of the three buffers alive there the one written and read once (its block output lives on through two more
    resnets, each reading and writing it). At any budget the device buffers alive at once stay within it."""
    bufs = tiling_memory.storage_buffers(sdxl, (512, 512), torch.bfloat16)
    p = place(bufs, int(12.1 * GIB))
    host = [i for i, d in enumerate(p) if not d]
    assert host == [14] and bufs[14][0] == 4 * GIB
    assert bufs[14][2] - bufs[14][1] < bufs[15][2] - bufs[15][1]
    for budget in (0.3, 1, 2.5, 5, 9, 12, 15.9):
        p = place(bufs, budget * GIB)
        assert device_peak(bufs, p) <= budget * GIB
        assert any(p) and not all(p)


def _allocation_schedule(vae, z, keep_inputs: bool = False) -> list[tuple[int, int, int]]:
    """(bytes, allocation step, free step) of each full-size buffer of a tiled decode (every buffer on the 'host',
    so each goes through the decoder's allocation; weakref finalizers see the frees). keep_inputs: every activation
    object a pass is given stays referenced until the decode ends."""
    events, sizes, kept = [], [], []
    td = tiling.TiledDecoder(vae, tile=8, kernels=False, shape="bands")
    td._force_copy = True
    real = td._alloc

    def alloc(*a, **k):
        t = real(*a, **k)
        i = len(sizes)
        sizes.append(t.numel() * t.element_size())
        events.append(("new", i))
        weakref.finalize(t, lambda: events.append(("free", i)))
        return t

    def keeping(step):
        def run(i, ps, *acts):
            kept.extend(acts)
            return step(i, ps, *acts)
        return run

    td._alloc = alloc
    if keep_inputs:
        td.res1, td.res2, td.up, td.head = (keeping(s) for s in (td.res1, td.res2, td.up, td.head))
    td.decode(z)
    del td
    kept.clear()
    steps = {}
    for s, (what, i) in enumerate(events):
        steps.setdefault(i, [None, None])[what == "free"] = s
    return [(sizes[i], a, f) for i, (a, f) in sorted(steps.items())]


def test_schedule_is_what_the_decoder_allocates(vae, z):
    """storage_buffers is the decoder's own order of allocations and frees."""
    assert _allocation_schedule(vae, z) == tiling_memory.storage_buffers(vae, tuple(z.shape[-2:]), torch.float32)


def test_schedule_holds_when_pass_inputs_are_kept_alive(vae, z):
    """A pass lets its input buffer go itself once it has read it: the schedule does not depend on the walk's own
    references being the last ones. (Python keeps a frame's arguments until it returns while torch's compiler hooks
    frames, e.g. for the rest of a process in which a torch.compile failed.)"""
    assert (_allocation_schedule(vae, z, keep_inputs=True)
            == tiling_memory.storage_buffers(vae, tuple(z.shape[-2:]), torch.float32))


def test_mixed_placement_decodes_bitwise_the_same(vae, z):
    """All buffers local, some moved as if on the host, all moved: the same image, bit for bit; only the host-placed
    buffers are copied (their bytes written out once each)."""
    bufs = tiling_memory.storage_buffers(vae, tuple(z.shape[-2:]), torch.float32)
    total = sum(b for b, _, _ in bufs)
    mid = sorted(b for b, _, _ in bufs)[-1] + sorted(b for b, _, _ in bufs)[-2] // 2  # room for some, not all
    outs = {}
    for name, room in (("device", 10 * total), ("mixed", mid), ("host", 0)):
        td = tiling.TiledDecoder(vae, tile=8, kernels=False, shape="bands")
        td._force_copy = True
        td._device_store_bytes = room
        outs[name] = (td.decode(z), dict(td.info), td.placement)
    (dev, idev, pdev), (mix, imix, pmix), (host, ihost, phost) = outs["device"], outs["mixed"], outs["host"]
    assert all(pdev) and not any(phost) and any(pmix) and not all(pmix)
    assert idev["host_store_bytes"] == 0 and idev["bytes_d2h"] == 0
    assert ihost["host_store_bytes"] == total
    assert imix["host_store_bytes"] == sum(b for (b, _, _), d in zip(bufs, pmix) if not d)
    assert 0 < imix["bytes_d2h"] < ihost["bytes_d2h"]
    assert torch.equal(dev, mix) and torch.equal(dev, host)
    ref = vae.decode(z).sample
    assert (dev - ref).abs().max().item() < 1e-3


def test_fast_pinning_switches_torch_option_and_back(monkeypatch):
    """fast_pinning sets torch's host-register option (the user's settings kept in front) and restores torch's
    defaults after; where the user chose a pinning option it leaves the allocator alone."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "expandable_segments:True",
                        raising=False)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    with store.fast_pinning(8) as on:
        assert on and calls == ["expandable_segments:True,pinned_use_cuda_host_register:True,"
                                "pinned_num_register_threads:8"]
    assert calls[1] == "expandable_segments:True,pinned_use_cuda_host_register:False,pinned_num_register_threads:1"
    # the next time torch reports our own restored keys among the settings: they are not repeated
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: calls[-1], raising=False)
    with store.fast_pinning(8):
        pass
    assert calls[2:] == calls[:2]
    calls.clear()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "pinned_use_cuda_host_register:True,pinned_num_register_threads:4")
    with store.fast_pinning() as on:
        assert not on
    assert calls == []


def test_mixed_placement_kernel_path(vae, z):
    """The kernel path (resnet outputs written straight into device buffers, in place over the residual): some
    buffers moved as if on the host, the others local, gives bitwise the image of all of them local."""
    from vaeopt.kernels import triton_available

    if not triton_available(torch.device("cpu"))[0]:
        pytest.skip("Triton (interpreter) not available")
    zz = z[..., :12, :16].contiguous()
    bufs = tiling_memory.storage_buffers(vae, tuple(zz.shape[-2:]), torch.float32)
    outs = []
    for room in (sum(b for b, _, _ in bufs), max(b for b, _, _ in bufs)):
        td = tiling.TiledDecoder(vae, tile=8, kernels=True)
        td._force_copy = True
        td._device_store_bytes = room
        outs.append((td.decode(zz), td.placement, td.info["host_store_bytes"]))
    (a, pa, ha), (b, pb, hb) = outs
    assert all(pa) and ha == 0 and any(pb) and not all(pb) and hb > 0
    assert torch.equal(a, b)


def test_sdxl_4096_within_16gb_storage_choice(sdxl, monkeypatch):
    """The decoder's own choice on an (emulated) big GPU within a 16 GB budget at 4096²: the planned tile's working
    set leaves too little room, so half the tile, with all buffers but one 4 GiB one on the GPU."""
    from vaeopt import planner

    fam = get_family("sdxl")
    tile = planner.largest_tile(fam, sdxl, (1, 4, 512, 512), torch.bfloat16, 16 * GIB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (130 * GIB, 140 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 0)
    td = tiling.TiledDecoder(sdxl, tile=tile, vram_budget=16 * GIB, kernels=True, shape="bands")
    td.device, td.dtype, td.kernels, td.bands = torch.device("cuda", 0), torch.bfloat16, True, True
    storage, t, placement = td._choose_storage((512, 512))
    bufs = tiling_memory.storage_buffers(sdxl, (512, 512), torch.bfloat16)
    assert storage.type == "cpu" and t == (tile // 2, tile // 2)
    assert [i for i, d in enumerate(placement) if not d] == [14] and bufs[14][0] == 4 * GIB
    # a budget that holds them all beside the working set of a quarter of the tile: every buffer on the GPU
    td.vram_budget = 24 * GIB
    storage, t, placement = td._choose_storage((512, 512))
    assert storage == torch.device("cuda", 0) and placement is None


def test_sdxl_4096_tile_leaves_least_on_host(sdxl, monkeypatch):
    """With the chunked attention of the fused-epilogues stage (its score block adds ~0.8 GiB to the untiled
    mid-block's working set) and the tile an H200 plans at 4096² within 16 GB (2432 px): the tile is the largest
    8-px step that leaves only one 4 GiB buffer on the host (1152 px), where the earlier rule -- the planned tile,
    its half and its quarter, the untiled part counted beside the buffers -- kept two (8 GiB) at half the tile. The
    untiled part runs before the first full-size buffer exists, so it does not count beside them; a 1216-px tile
    would leave 8 GiB."""
    from vaeopt.stages.fused_epilogues import chunked_processor_class

    with torch.device("meta"):
        m = build_model(get_family("sdxl")).to(torch.bfloat16)
    m.decoder.mid_block.attentions[0].set_processor(chunked_processor_class()())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (130 * GIB, 140 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 0)
    bufs = tiling_memory.storage_buffers(m, (512, 512), torch.bfloat16)

    def choose():
        td = tiling.TiledDecoder(m, tile=304, vram_budget=16 * GIB, kernels=True, shape="bands")
        td.device, td.dtype, td.kernels, td.bands = torch.device("cuda", 0), torch.bfloat16, True, True
        storage, t, placement = td._choose_storage((512, 512))
        assert storage.type == "cpu"
        return t, sum(b for (b, _, _), d in zip(bufs, placement) if not d)

    monkeypatch.delenv(tiling.PLACEMENT_ENV, raising=False)
    assert choose() == ((144, 144), 4 * GIB)
    monkeypatch.setenv(tiling.PLACEMENT_ENV, "halves")
    assert choose() == ((152, 152), 8 * GIB)
    # one step larger leaves both on the host (the chosen tile is the largest with the fewest host bytes)
    need = tiling_memory.estimate_tiled_bytes(m, (512, 512), 152, torch.bfloat16, include_weights=False,
                                              untiled=False, kernels=True, shape="bands", device="cuda")
    weights = tiling_memory.decoder_weights_bytes(m)
    assert sum(b for (b, _, _), d in zip(bufs, store.place(bufs, 16 * GIB - weights - need)) if not d) == 8 * GIB


def test_host_blocks_as_torch_caches_them(sdxl):
    """The page-locked blocks a decode's host buffers take from torch's host cache: with every sdxl-4096 buffer on
    the host, 13 blocks and 29.75 GiB -- the 13 pinned buffers and ~30 GiB measured in such a decode on an H200
    (docs/experiments.md E59: a freed block is not reused by the very next allocation of its size); within 16 GB,
    the one 4 GiB buffer on the host."""
    bufs = tiling_memory.storage_buffers(sdxl, (512, 512), torch.bfloat16)
    blocks = store.host_blocks(bufs, [True] * len(bufs))
    assert len(blocks) == 13 and sum(blocks) == int(29.75 * GIB)
    assert all(b & (b - 1) == 0 for b in blocks)  # powers of two, as torch rounds requests
    assert store.host_blocks(bufs, [not d for d in place(bufs, int(12.1 * GIB))]) == [4 * GIB]
    assert store.host_blocks(bufs, [False] * len(bufs)) == []
    # a 3-byte request takes a 4-byte block; two alive at once need two
    assert store.host_blocks([(3, 0, 2), (4, 1, 3), (8, 4, 5)], [True, True, False]) == [4, 4]


def test_pin_ahead_pins_then_hands_back(monkeypatch):
    """PinAhead allocates each block pinned on its own thread (inside fast_pinning), lets them go into torch's host
    cache, and wait() joins it; an allocation error is kept, never raised."""
    from contextlib import contextmanager

    calls, threads = [], []
    real_empty = torch.empty

    @contextmanager
    def fake_pinning(n):
        calls.append(("pinning", n))
        yield True

    def fake_empty(n, dtype=None, pin_memory=False):
        import threading

        assert pin_memory and dtype is torch.uint8
        calls.append(n)
        threads.append(threading.current_thread().name)
        return real_empty(n, dtype=dtype)

    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(store, "fast_pinning", fake_pinning)
    monkeypatch.setattr(torch, "empty", fake_empty)
    p = store.PinAhead([64, 64, 16], torch.device("cuda", 0), threads=4)
    p.wait()
    monkeypatch.setattr(torch, "empty", real_empty)
    assert calls == [("pinning", 4), 64, 64, 16] and set(threads) == {"vaeopt-pin-ahead"}
    s = p.summary()
    assert s["blocks"] == 3 and s["bytes"] == 144 and s["error"] is None and s["seconds"] >= 0

    def failing(*a, **k):
        raise RuntimeError("no pinned memory here")

    monkeypatch.setattr(torch, "empty", failing)
    q = store.PinAhead([64], torch.device("cuda", 0))
    q.wait()
    monkeypatch.setattr(torch, "empty", real_empty)
    assert "no pinned memory here" in q.summary()["error"]


def test_pin_ahead_switch(monkeypatch, vae, z):
    """The decoder starts no pinning thread for a CPU decode (nothing is pinned there) or with VAEOPT_PIN_AHEAD=off,
    and reports none."""
    monkeypatch.setenv(store.PIN_AHEAD_ENV, "off")
    assert not store.pin_ahead_enabled()
    monkeypatch.setenv(store.PIN_AHEAD_ENV, "on")
    assert store.pin_ahead_enabled()
    td = tiling.TiledDecoder(vae, tile=8, kernels=False, shape="bands", storage="cpu")
    td.decode(z[..., :8, :8])
    assert td.info["pin_ahead"] is None and td._pins is None


@pytest.mark.gpu
def test_pin_ahead_on_gpu_same_image(monkeypatch, vae, z):
    """On a GPU with every buffer on the host: the thread pins host_blocks' blocks, the decode's own pinned
    allocations all come from torch's host cache (no page-locked allocation beside the thread's), and the image is
    bitwise the one of a decode that pins as it goes."""
    import copy

    zz = z.cuda()
    gpu_vae = copy.deepcopy(vae).cuda()
    outs = {}
    for mode in ("off", "on"):
        monkeypatch.setenv(store.PIN_AHEAD_ENV, mode)
        torch.cuda.synchronize()
        torch._C._host_emptyCache()  # (a fresh host cache: each mode pins its own blocks)
        n0 = torch.cuda.host_memory_stats().get("num_host_alloc", 0)
        td = tiling.TiledDecoder(gpu_vae, tile=8, storage="cpu", kernels=False, shape="bands")
        img = td.decode(zz)
        outs[mode] = (img, dict(td.info), torch.cuda.host_memory_stats().get("num_host_alloc", 0) - n0)
    (a, ia, _), (b, ib, pinned) = outs["off"], outs["on"]
    assert ia["pin_ahead"] is None and torch.equal(a, b)
    pa = ib["pin_ahead"]
    bufs = tiling_memory.storage_buffers(gpu_vae, tuple(zz.shape[-2:]), torch.float32)
    assert pa["error"] is None and pa["blocks"] == len(store.host_blocks(bufs, [True] * len(bufs)))
    assert pinned == pa["blocks"] and pa["seconds"] > 0


def _host_bytes(bufs, placement) -> int:
    return sum(b for (b, _, _), d in zip(bufs, placement) if not d)


def test_place_is_not_monotone_in_room_for_any_buffers():
    """Why the tile search below is pinned on the decoder's own buffers: `place` keeps the costliest buffers (bytes
    x lifetime) first, so for an arbitrary list more room can leave MORE bytes on the host (room 6 keeps the 6-byte
    long-lived buffer and sends both 5-byte short-lived ones out; room 5 keeps those two instead)."""
    bufs = [(6, 0, 10), (5, 1, 5), (5, 5, 9)]
    assert _host_bytes(bufs, place(bufs, 5)) == 6 and _host_bytes(bufs, place(bufs, 6)) == 10


@pytest.mark.parametrize("kernels,shape", [(True, "bands"), (False, "tiles"), (False, "bands"), (True, "tiles")])
def test_tile_search_finds_the_largest_tile_of_fewest_host_bytes(kernels, shape, monkeypatch):
    """_choose_storage bisects the 8-px tile ladder on the assumption that a smaller tile never leaves more bytes on
    the host. That holds for the KL decoder's buffer schedule: over square, odd and wide latents, planned tiles
    larger and smaller than the latent, the Triton and torch paths, bands and tiles, and budgets from a sliver of the
    buffers to nearly all of them, (1) the working set shrinks with the tile, (2) the host bytes never grow as the
    tile shrinks, and (3) the bisection's choice is the linear scan's: the largest tile of the fewest host bytes."""
    with torch.device("meta"):
        models = [build_model(get_family("sdxl")).to(torch.bfloat16),  # SDXL's widths (128, 256, 512, 512)
                  build_model(get_family("sdxl"), block_out_channels=[64, 128, 256, 256], layers_per_block=1,
                              norm_num_groups=32).to(torch.bfloat16)]  # a narrower custom KL decoder
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (130 * GIB, 140 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 0)
    monkeypatch.delenv(tiling.PLACEMENT_ENV, raising=False)
    checked = 0
    for m in models:
        weights = tiling_memory.decoder_weights_bytes(m)
        for hw in ((512, 512), (509, 387), (130, 770)):  # square; odd (primes-ish); wider than any tile is tall
            bufs = tiling_memory.storage_buffers(m, hw, torch.bfloat16)
            store_bytes = tiling_memory.storage_bytes(m, hw, torch.bfloat16)
            for tile in ((304, 304), (97, 161), (200, 136)):  # square; odd non-square; taller than 130
                ladder = tiling._tile_ladder(tile, (max(8, tile[0] // 4), max(8, tile[1] // 4)))
                needs = [tiling_memory.estimate_tiled_bytes(m, hw, t, torch.bfloat16, include_weights=False,
                                                            untiled=False, kernels=kernels, shape=shape,
                                                            device="cuda") for t in ladder]
                assert needs == sorted(needs, reverse=True), (hw, tile)  # (1)
                for frac in (0.05, 0.15, 0.3, 0.45, 0.6, 0.75, 0.9, 1.0):
                    budget = int(weights + needs[-1] + frac * store_bytes)
                    hosts = [_host_bytes(bufs, place(bufs, budget - weights - n)) for n in needs]
                    assert hosts == sorted(hosts, reverse=True), (hw, tile, frac)  # (2)
                    td = tiling.TiledDecoder(m, tile=tile, vram_budget=budget, kernels=kernels, shape=shape)
                    td.device, td.dtype, td.kernels, td.bands = (torch.device("cuda", 0), torch.bfloat16, kernels,
                                                                 shape == "bands")
                    storage, t, placement = td._choose_storage(hw)
                    if storage.type != "cpu":
                        continue  # a smaller tile holds every buffer on the device: no host bytes to weigh
                    best = min(hosts)
                    assert (t, _host_bytes(bufs, placement)) == (ladder[hosts.index(best)], best)  # (3)
                    checked += 1
    assert checked > 60  # (the grid reaches the host path, not only all-on-device plans)
