"""The nodes inside a real ComfyUI, headless and in-process: correctness against ComfyUI's own VAEDecode and
VAEDecodeTiled, and (--repeat) time and peak memory of each.

    python comfyui_vaeopt/tests/run_in_comfyui.py --comfyui /path/to/ComfyUI --workload cpu-sd --out out/
    python comfyui_vaeopt/tests/run_in_comfyui.py --comfyui /path/to/ComfyUI --workload sdxl-1024 --repeat 5 --out out/

For each workload a full-size VAE with random weights is built from vaeopt's family config and saved in the layout
ComfyUI's VAELoader reads (LDM for SD/SDXL, the original Wan names for Wan 2.1) into ComfyUI's models/vae, and the
latent into its input folder as a .latent file (raw latents, as ComfyUI's LoadLatent gives them). Then the API-format
workflows

    VAELoader -> {VAE Decode (vaeopt) | VAEDecode | VAEDecodeTiled | VAE Decode (vaeopt) tiled} -> SaveImage
    (LoadLatent feeds the decode)

run through ComfyUI's PromptExecutor. The IMAGE each SaveImage receives is kept (float, before the PNG) and compared
with the untiled VAEDecode's: PSNR in dB over [0, 1]; the node's log lines (memory request, plan, stages) are kept
with it. A small decode through the node then checks that every weight of ComfyUI's VAE is one of the tensors
vaeopt decodes with, and records the memory the node asked ComfyUI's model manager for. With --repeat N the decode
nodes are also run N more times each on the same loaded VAE (after one warm-up run) and timed, with the peak of
torch.cuda.max_memory_allocated. One JSON per workload goes to --out.

Use a scratch copy of ComfyUI: the script writes into its models/vae, input and output folders. Where torchvision
or torchaudio cannot be installed to match torch (ComfyUI imports them for models unrelated to this check),
--stub-missing puts empty stand-ins on the path for this process only.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
NODE_DIR = HERE.parents[1]
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO))  # this checkout's vaeopt, ahead of any installed one

# name: (vaeopt family, latent shape, ComfyUI VAEDecodeTiled settings, node settings for its tiled run). The node's
# budgets are ones its planner meets with tiles (spatial bands for Wan), so the tiled row is a tiled decode.
_TILED_2D = dict(overlap=64, temporal_size=64, temporal_overlap=8)
WORKLOADS = {
    "cpu-sd": ("sdxl", (1, 4, 32, 32), dict(_TILED_2D, tile_size=128, overlap=32), dict(tile_size=128)),
    "cpu-wan": ("wan21", (1, 16, 3, 16, 16), dict(_TILED_2D, tile_size=64, overlap=32), dict(vram_budget_gb=0.45)),
    "sdxl-1024": ("sdxl", (1, 4, 128, 128), dict(_TILED_2D, tile_size=512), dict(vram_budget_gb=2.0)),
    "sdxl-4096": ("sdxl", (1, 4, 512, 512), dict(_TILED_2D, tile_size=512), dict(vram_budget_gb=16.0)),
    "wan-480p": ("wan21", (1, 16, 21, 60, 104), dict(_TILED_2D, tile_size=256), dict(vram_budget_gb=3.0)),
}


_STUB = """# stand-in: the real package is not installed in this Python (see run_in_comfyui.py --stub-missing)
__version__ = "0.0.0"


class _Missing(type):
    def __getattr__(cls, name):
        return cls

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"{cls.__name__}: a stand-in; install the real package to use it")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(name, (), {})
"""


def stub_missing() -> list[str]:
    """Stand-ins for torchvision / torchaudio / PyAV where the real ones do not import: ComfyUI imports them at module
    level for models and video types this check never builds (cascade, cosmos, audio VAEs, video files). Any name imported from them is a class that
    refuses to be called."""
    # diffusers decides once, on first use, which optional packages exist: settle that before any stand-in exists
    import diffusers

    for cls in ("AutoencoderKL", "AutoencoderKLWan", "AutoencoderKLHunyuanVideo", "AutoencoderTiny"):
        getattr(diffusers, cls)
    made = []
    root = Path(tempfile.mkdtemp(prefix="comfy-stubs-"))
    for name, subs in (("torchvision", ("transforms", "models", "io", "ops", "utils")),
                       ("torchaudio", ("transforms", "functional", "compliance")), ("av", ("container", "error", "subtitles", "subtitles/stream"))):
        try:
            __import__(name)
            continue
        except Exception:
            pass
        (root / name).mkdir()
        (root / name / "__init__.py").write_text(_STUB + "".join(f"from . import {s}\n" for s in subs if "/" not in s))
        for s in subs:
            (root / name / s).mkdir(parents=True)
            (root / name / s / "__init__.py").write_text(_STUB + "from . import functional\n" if s == "transforms"
                                                        else _STUB)
            if s == "transforms":
                (root / name / s / "functional.py").write_text(_STUB)
        made.append(name)
    if made:
        sys.path.insert(0, str(root))
    return made


def make_vae_file(family: str, folder: Path, seed: int = 0) -> str:
    """A full-size VAE of `family` with random weights, saved as ComfyUI's VAELoader reads it. -> file name."""
    from safetensors.torch import save_file

    sys.path.insert(0, str(REPO / "tests"))
    from test_loading import to_ldm, to_wan_original  # diffusers -> LDM / original-Wan key names

    import vaeopt

    name = f"vaeopt-random-{family}.safetensors"
    path = folder / name
    if path.exists():
        return name
    torch.manual_seed(seed)
    model = vaeopt.load_vae(None, family=family).model
    sd = model.state_dict()
    sd = to_wan_original(sd) if family.startswith("wan") else to_ldm(sd)
    tmp = path.with_suffix(".part")
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp))
    os.replace(tmp, path)
    return name


def make_latent_file(shape: tuple, folder: Path, seed: int = 0) -> str:
    from safetensors.torch import save_file

    name = "vaeopt-" + "x".join(map(str, shape)) + ".latent"
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(shape, generator=g)
    # latent_format_version_0: LoadLatent then takes the tensor as it is (raw latents)
    save_file({"latent_tensor": z, "latent_format_version_0": torch.tensor([])}, str(folder / name))
    return name


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = (a.float() - b.float()).pow(2).mean().item()
    return float("inf") if mse == 0 else 10 * math.log10(1.0 / mse)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--comfyui", required=True, type=Path, help="a scratch copy of ComfyUI's source")
    ap.add_argument("--workload", action="append", choices=sorted(WORKLOADS), help="repeatable; default cpu-sd")
    ap.add_argument("--out", type=Path, default=Path("comfyui-check"))
    ap.add_argument("--repeat", type=int, default=0, help="timed runs per decode node (0: correctness only)")
    ap.add_argument("--stub-missing", action="store_true", help="empty torchvision/torchaudio/av if they do not import")
    ap.add_argument("--fp32-vae", action="store_true", help="ComfyUI's --fp32-vae: decode in fp32, not its bf16")
    ap.add_argument("--variants", default="comfy_untiled,vaeopt,comfy_tiled,vaeopt_tiled",
                    help="comma-separated subset (comfy_untiled, the reference, always runs)")
    ap.add_argument("--skip-comfy-untiled", action="store_true",
                    help="time VAEDecode only once (a 4096² decode without tiling takes most of a large GPU)")
    a = ap.parse_args()
    comfy_root = a.comfyui.resolve()
    if not (comfy_root / "comfy" / "sd.py").is_file():
        print(f"error: {comfy_root} is not a ComfyUI source folder (no comfy/sd.py)", file=sys.stderr)
        return 2
    a.out = a.out.resolve()  # (ComfyUI is imported from its own folder, which becomes the working directory)
    a.out.mkdir(parents=True, exist_ok=True)
    stubs = stub_missing() if a.stub_missing else []
    sys.path.insert(0, str(comfy_root))
    os.chdir(comfy_root)
    import comfy.cli_args

    if not torch.cuda.is_available():
        comfy.cli_args.args.cpu = True
    comfy.cli_args.args.fp32_vae = a.fp32_vae
    import asyncio

    import comfy.model_management as mm
    import execution
    import folder_paths
    import nodes

    folder_paths.set_output_directory(str((a.out / "images").resolve()))
    assert asyncio.run(nodes.load_custom_node(str(NODE_DIR))) is not False
    assert "VAEDecodeVaeopt" in nodes.NODE_CLASS_MAPPINGS, "the vaeopt nodes did not load"

    lines: list[str] = []  # what the node logs (its memory request, plan, stage lines)

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    node_log = logging.getLogger("vaeopt.comfyui")
    node_log.addHandler(Keep())
    node_log.setLevel(logging.INFO)
    captured: dict[str, torch.Tensor] = {}
    save = nodes.SaveImage.save_images

    def keep(self, images, filename_prefix="ComfyUI", **kw):  # the float IMAGE, before 8-bit PNG rounding
        captured[filename_prefix] = images.detach().float().cpu().clone()
        return save(self, images, filename_prefix=filename_prefix, **kw)

    nodes.SaveImage.save_images = keep

    class Server:  # what PromptExecutor reports to: nothing listens here
        client_id = None
        last_node_id = None
        last_prompt_id = None

        def send_sync(self, *args, **kwargs):
            pass

        def queue_updated(self):
            pass

    vae_dir = Path(folder_paths.get_folder_paths("vae")[0])
    vae_dir.mkdir(parents=True, exist_ok=True)
    in_dir = Path(folder_paths.get_input_directory())
    in_dir.mkdir(parents=True, exist_ok=True)
    hw = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.processor() or 'x86'})"
    import vaeopt

    try:
        import comfyui_version

        comfy_version = comfyui_version.__version__
    except (ImportError, AttributeError):
        comfy_version = None
    for wl in a.workload or ["cpu-sd"]:
        family, shape, comfy_tiled, node_tiled = WORKLOADS[wl]
        video = len(shape) == 5
        vae_name = make_vae_file(family, vae_dir)
        lat_name = make_latent_file(shape, in_dir)
        node = "VAEDecodeVideoVaeopt" if video else "VAEDecodeVaeopt"
        variants = {
            "comfy_untiled": ("VAEDecode", {}),
            "vaeopt": (node, {}),
            "comfy_tiled": ("VAEDecodeTiled", comfy_tiled),
            "vaeopt_tiled": (node, node_tiled),
        }
        wanted = {"comfy_untiled", *a.variants.split(",")}
        if wanted - set(variants):
            print(f"error: unknown variant(s) {', '.join(sorted(wanted - set(variants)))}", file=sys.stderr)
            return 2
        variants = {k: v for k, v in variants.items() if k in wanted}
        result = {"workload": wl, "family": family, "latent_shape": list(shape), "hardware": hw,
                  "torch": torch.__version__, "vaeopt": vaeopt.__version__, "comfyui": comfy_version,
                  "stubs": stubs, "fp32_vae": a.fp32_vae,
                  "comfy_tiled_settings": comfy_tiled, "vaeopt_tiled_settings": node_tiled, "variants": {}}
        ex = execution.PromptExecutor(Server(), cache_type=execution.CacheType.CLASSIC)
        for tag, (cls, extra) in variants.items():
            prefix = f"{wl}-{tag}"
            prompt = {
                "1": {"class_type": "VAELoader", "inputs": {"vae_name": vae_name}},
                "2": {"class_type": "LoadLatent", "inputs": {"latent": lat_name}},
                "3": {"class_type": cls, "inputs": {"samples": ["2", 0], "vae": ["1", 0], **extra}},
                "4": {"class_type": "SaveImage", "inputs": {"images": ["3", 0], "filename_prefix": prefix}},
            }
            valid = asyncio.run(execution.validate_prompt(prefix, prompt, None))
            if not valid[0]:
                print(f"error: ComfyUI refused the {tag} workflow: {valid[1]} {valid[3]}", file=sys.stderr)
                return 1
            t0 = time.perf_counter()
            lines.clear()
            ex.execute(prompt, prefix, {}, ["4"])
            if not ex.success or prefix not in captured:
                msgs = [m for m in ex.status_messages if m[0] == "execution_error"]
                print(f"error: the {tag} workflow failed: {msgs}", file=sys.stderr)
                return 1
            result["variants"][tag] = {"node": cls, "inputs": extra, "workflow_s": round(time.perf_counter() - t0, 3),
                                       "shape": list(captured[prefix].shape), "node_log": list(lines)}
        ref = captured[f"{wl}-comfy_untiled"]
        for tag in variants:
            img = captured[f"{wl}-{tag}"]
            v = result["variants"][tag]
            v["psnr_vs_comfy_untiled_db"] = round(psnr(img, ref), 2) if img.shape == ref.shape else None
        del ex  # its cache holds the workflow's VAE: give its memory back before the measurements
        mm.unload_all_models()
        mm.soft_empty_cache()
        result["sharing"] = check_sharing(vae_name, shape, node, nodes, mm)
        if a.repeat > 0:
            time_variants(result, variants, vae_name, lat_name, a.repeat, a.skip_comfy_untiled, nodes, mm)
        path = a.out / f"comfyui_{wl}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result, indent=1))
    return 0


def check_sharing(vae_name, shape, node, nodes, mm) -> dict:
    """The node's side effects in ComfyUI, on a small latent: the memory it asked ComfyUI's model manager for, and
    whether every weight of ComfyUI's VAE is one of the tensors vaeopt decodes with (no second copy)."""
    calls = []
    load = mm.load_models_gpu

    def record(models, memory_required=0, **kw):
        calls.append({"memory_required_gb": round(memory_required / 2**30, 4), **{k: v for k, v in kw.items()
                                                                                 if k == "force_full_load"}})
        return load(models, memory_required=memory_required, **kw)

    small = (*shape[:-2], 8, 8)
    g = torch.Generator().manual_seed(1)
    obj = nodes.NODE_CLASS_MAPPINGS[node]()
    bridge = type(obj).decode.__globals__["bridge"]  # the node package's module, as ComfyUI imported it
    mm.load_models_gpu = record
    try:
        with torch.inference_mode():
            vae = nodes.VAELoader().load_vae(vae_name)[0]
            (img,) = getattr(obj, obj.FUNCTION)(samples={"samples": torch.randn(small, generator=g)}, vae=vae)
    finally:
        mm.load_models_gpu = load
    ours = {p.data_ptr() for p in bridge.entry_for(vae).loaded.model.parameters()}
    theirs = [p.data_ptr() for p in vae.first_stage_model.parameters()]
    return {"latent": list(small), "image": list(img.shape), "vae_device": str(vae.device),
            "vae_dtype": str(vae.vae_dtype).replace("torch.", ""), "load_models_gpu": calls,
            "comfy_weights": len(theirs), "comfy_weights_shared": sum(t in ours for t in theirs)}


def time_variants(result, variants, vae_name, lat_name, repeat, skip_untiled, nodes, mm) -> None:
    """Each decode node called as the executor calls it (same VAE object, under inference_mode): one warm-up, then
    `repeat` timed runs; seconds (median, min, max) and the peak allocated GPU memory."""
    cuda = torch.cuda.is_available()
    with torch.inference_mode():
        vae = nodes.VAELoader().load_vae(vae_name)[0]
        latent = nodes.LoadLatent().load(lat_name)[0]
        for tag, (cls, extra) in variants.items():
            obj = nodes.NODE_CLASS_MAPPINGS[cls]()
            fn = getattr(obj, obj.FUNCTION)
            n = 1 if (skip_untiled and tag == "comfy_untiled") else repeat
            times, peaks = [], []
            for i in range(n + 1):
                mm.soft_empty_cache()
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                fn(samples=latent, vae=vae, **extra)
                if cuda:
                    torch.cuda.synchronize()
                    peaks.append(torch.cuda.max_memory_allocated())
                if i:  # the first run warms up (kernels, plans, our pipeline's build)
                    times.append(time.perf_counter() - t0)
                else:
                    warm = time.perf_counter() - t0
            v = result["variants"][tag]
            v["first_run_s"] = round(warm, 3)
            v["seconds_median"] = round(statistics.median(times), 4)
            v["seconds_min"] = round(min(times), 4)
            v["seconds_max"] = round(max(times), 4)
            v["runs"] = len(times)
            if peaks:
                v["peak_allocated_gb"] = round(max(peaks[1:] or peaks) / 2**30, 3)


if __name__ == "__main__":
    sys.exit(main())
