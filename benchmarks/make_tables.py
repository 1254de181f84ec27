"""Write docs/benchmarks.md from the result JSON in benchmarks/results/, so the docs quote only measurements.

    python3 benchmarks/make_tables.py              # rewrites docs/benchmarks.md
    python3 benchmarks/make_tables.py FILE.json... # prints the ladder table of each file

The README's headline table is the summary printed here. To add a workload or replace a result, edit the lists below
and rerun; never edit docs/benchmarks.md by hand.
"""

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

# workload -> the `vaeopt benchmark` ladder quoted for it (bf16, default options)
HEADLINE = {
    "sd15-512": "h200_sd15-512_2026-11-21.json",
    "sdxl-1024": "h200_sdxl-1024-e26_2026-11-22.json",
    "flux-1024": "h200_flux-1024-e26_2026-11-22.json",
    "sdxl-2048": "h200_sdxl-2048_2026-11-21b.json",
    "wan21-480p": "h200_wan21-480p-e42_2026-11-23.json",
    "wan21-720p": "h200_wan21-720p-e42_2026-11-23.json",
    "wan22-720p": "h200_wan22-720p_2026-11-21g.json",
    "flux2-1024": "h200_flux2-1024_2026-11-28.json",
    "qwenimage-1328": "h200_qwenimage-1328_2026-11-29.json",
}
NOTES = {w: "¹" for w in ("sd15-512", "sdxl-2048")}  # ladders from before the phase upsample convs existed
COMPILE = ["h200_sdxl-1024_2026-11-21a.json"]  # ladders that ran the torch.compile peer (--peers ...,compile)
FP8 = [  # `vaeopt benchmark --fp8 [--fp8-gate G]`: lossy, gated on PSNR vs fp32
    "h200_sdxl-1024-fp8-gate40-e46c_2026-11-23.json",
    "h100_sdxl-1024-fp8-gate40-e46c_2026-11-23.json",
    "h200_flux-1024-fp8-gate40-e46c_2026-11-23.json",
    "h200_sdxl-1024-fp8-gate30-e46_2026-11-23.json",
    "h200_wan21-480p-fp8-tma_2026-11-21.json",
    "h200_wan21-480p-fp8-gate30-tma_2026-11-21.json",
    "h200_wan21-720p-fp8-gate30-tma_2026-11-21.json",
]
FP8_LEVELS = ["h200_sdxl-1024-fp8-gate30-levels_2026-11-28b.json", "h200_sdxl-1024-fp8-levels_2026-11-28b.json"]
OTHER_LADDERS = ["h100_hunyuan-480p_2026-11-22.json", "h200_ltx2-768_2026-11-29.json", "h200_hunyuan15-480p_2026-11-29.json"]
DISTRIBUTED = ["h200x2_distributed_2026-11-22.json", "h200x4_distributed_2026-11-22.json"]
ONE_SHOT = ["h200_one_shot_2026-11-29.json", "h200_one_shot_wan21-480p_2026-11-29.json"]
PHASES = ["h200_one_shot_phases_sdxl-1024_2026-11-29.json"]  # scripts/one_shot_phases.py: the same job, phase by phase
# benchmarks/decode_video.py and benchmarks/dropin.py: one thing changed per row against diffusers
VARIANTS = ["h200_ltx2-768_onebuffer_2026-11-29.json", "h200_hunyuan15-480p_onebuffer_2026-11-29.json",
            "h200_qwenimage-1328_dropin_2026-11-29.json", "h200_ltx2-768_upsampler-variants_2026-11-29.json"]
VARIANT_NOTES = {
    f: "vaeopt: NCDHW, the auto layout when this ran; cl: channels_last_3d, the auto layout since (E66).\n"
    for f in VARIANTS[:2]} | {VARIANTS[2]: "optimize: `vaeopt.optimize(pipe.vae)` on diffusers' own AutoencoderKLQwenImage; "
                                          "graphs: the same with CUDA graphs on (repeated same-shape calls).\n",
                                VARIANTS[3]: "vaeopt: the default (channels_last_3d); feed, submajor, pad2 (both): "
                                             "LTX-2's upsampler options (E68), off by default, none faster.\n"}
VARIANT_TITLES = {VARIANTS[3]: "ltx2-768 (upsampler options)"}  # (a workload's second variants table)
LADDER_NOTES = {f: "Measured before the planner took the whole clip (E61) and before each conv's input was padded in one "
                   "buffer (E66); the current default is in the variants table above (`cl`).\n"
                for f in ("h200_ltx2-768_2026-11-29.json", "h200_hunyuan15-480p_2026-11-29.json")}


def load(name: str) -> dict:
    return json.load(open(RESULTS / name if not Path(name).exists() else name))


def hardware(r: dict) -> str:
    v = r["versions"]
    gpu = r.get("gpu") or f"{v.get('gpu_count', '')}x {v.get('gpu_name', '')}".strip()
    return (f"{gpu}; torch {v['torch']}, cuDNN {v['cudnn']}, Triton {v['triton']}, diffusers {v['diffusers']}")


def ok_rows(r: dict, kind: str) -> list:
    return [x for x in r["rows"] if x["kind"] == kind and x["status"] == "ok"]


def row(r: dict, name: str):
    return next((x for x in r["rows"] if x["name"] == name and x["status"] == "ok"), None)


def gate(r: dict) -> str:
    m = re.search(r"--fp8-gate (\d+)", r["command"])
    return m.group(1) if m else "40 (default)"


def ms(x) -> str:
    return "—" if x is None else f"{x['median_ms']:.0f} ms" if x["median_ms"] >= 200 else f"{x['median_ms']:.1f} ms"


def summary() -> str:
    lines = ["| workload | diffusers bf16 | torch.compile | vaeopt | speedup | PSNR vs fp32 (diffusers bf16 → vaeopt) |",
             "|---|---|---|---|---|---|"]
    compiled = {load(f)["workload"]: row(load(f), "diffusers bf16 + torch.compile") for f in COMPILE}
    hw = set()
    for workload, f in HEADLINE.items():
        r = load(f)
        hw.add(hardware(r))
        base, best = row(r, "diffusers bf16 eager"), min(ok_rows(r, "ladder"), key=lambda x: x["median_ms"])
        lines.append(f"| {workload}{NOTES.get(workload, '')} | {ms(base)} | {ms(compiled.get(workload))} | **{ms(best)}** | "
                     f"{base['median_ms'] / best['median_ms']:.1f}x | {base['psnr_db']:.1f} → {best['psnr_db']:.1f} dB |")
    return "\n".join(lines) + (f"\n\nHardware: {'; '.join(sorted(hw))}. bf16, random weights, median of 2–10 "
                               "repeats. ¹ Measured before the upsamplers ran as phase convs, an exact rewrite that took "
                               "sdxl-1024 from 21.9 to 19.2 ms (eager); these two are slower than today's code.\n")


def fp8_summary() -> str:
    lines = ["| workload | GPU | gate | vaeopt (fastest row) | PSNR vs fp32 | source |", "|---|---|---|---|---|---|"]
    for f in FP8:
        r = load(f)
        best = min(ok_rows(r, "ladder"), key=lambda x: x["median_ms"])
        lines.append(f"| {r['workload']} | {r['gpu']} | {gate(r)} | **{ms(best)}** ({best['name']}) | "
                     f"{best['psnr_db']:.1f} dB | `{f}` |")
    return "\n".join(lines) + f"\n\nHardware: {hardware(load(FP8[0]))} (the H100 row: the same versions).\n"


def distributed() -> str:
    lines = ["| workload | GPUs | one GPU | band-parallel | speedup | PSNR vs the one-GPU decode |", "|---|---|---|---|---|---|"]
    for f in DISTRIBUTED:
        r = load(f)
        for x in r["rows"]:
            for key, b in x["band"].items():
                gpus = b["ranks"] if key == "all" else f"{b['ranks']} of {x['world']}"
                lines.append(f"| {x['workload']} | {gpus} | {1000 * x['single']['seconds']:.0f} ms | "
                             f"{1000 * b['seconds']:.0f} ms | {b['speedup']:.2f}x | {b['psnr_vs_single_db']:.1f} dB |")
    r = load(DISTRIBUTED[0])
    check = r.get("fp32_check") or {}
    fp32 = f" In fp32 the band split is exact up to summation order: {check['psnr_db']:.1f} dB (sdxl), " \
           f"{check['wan21']['psnr_db']:.1f} dB (Wan 2.1)." if "wan21" in check else ""
    return ("\n".join(lines) + f"\n\nHardware: H200s of one host over NVLink; {hardware(r).split('; ', 1)[1]}; bf16, "
            f"random weights, median of 3.{fp32} Sources: " + ", ".join(f"`{f}`" for f in DISTRIBUTED) + ".\n")


def one_shot_table(path: str) -> str:
    """benchmarks/one_shot.py's rows: each job's whole process (start to file written) per variant, and vaeopt's
    decode line, against the plain diffusers script."""
    r = load(path)
    lines = ["| job | run | whole process | decode (its own line) | warmup before it | vs plain diffusers |",
             "|---|---|---|---|---|---|"]
    base = {x["job"]: x["total_s"] for x in r["rows"] if x["variant"] == "diffusers" and x["status"] == "ok"}
    names = {"cold": "vaeopt decode, empty caches", "warm": "vaeopt decode, warm caches",
             "warmup": "vaeopt decode after `vaeopt warmup`", "diffusers": "plain diffusers script"}
    for x in r["rows"]:
        name = names.get(x["variant"], x["variant"])
        if x["status"] != "ok":
            lines.append(f"| {x['job']} | {name} | *{x['status']}* | | | |")
            continue
        vs = f"{x['total_s'] / base[x['job']]:.2f}x" if x["job"] in base and x["variant"] != "diffusers" else ""
        warm = f"{x['warmup_s']:.1f} s" if x.get("warmup_s") else ""
        lines.append(f"| {x['job']} | {name} | {x['total_s']:.1f} s | {x.get('decode_s', 0):.2f} s | {warm} | {vs} |")
    v = r["versions"]
    return (f"{r.get('gpu') or 'CPU'}; torch {v['torch']}, Triton {v['triton']}, diffusers {v['diffusers']}. "
            f"`{r['command']}` → `benchmarks/results/{Path(path).name}`\n\n" + "\n".join(lines) + "\n")


def phases_table(path: str) -> str:
    """scripts/one_shot_phases.py: where each process's seconds go (medians), vaeopt against the plain script."""
    r = load(path)
    runs = {k: v for k, v in r["median_s"].items()}
    phases = [p for p in next(iter(runs.values())) if not p.startswith("pw ")]
    lines = ["| phase | " + " | ".join(runs) + " |", "|---" * (len(runs) + 1) + "|"]
    lines += [f"| {p} | " + " | ".join(f"{v[p]:.2f} s" for v in runs.values()) + " |" for p in phases]
    return (f"{r['gpu']}; torch {r['versions']['torch']}; {r['family']} latent {tuple(r['latent'])} to PNG. "
            f"`scripts/one_shot_phases.py` → `benchmarks/results/{Path(path).name}`\n\n" + "\n".join(lines) + "\n")


def variants_table(path: str) -> str:
    """The harness's variant rows (decode_video.py, dropin.py): time, speed-up over the first row, PSNR vs fp32, peak."""
    r = load(path)
    lines = ["| variant | ms | x | PSNR vs fp32 | peak GiB |", "|---|---|---|---|---|"]
    for x in r["rows"]:
        if x["status"] != "ok":
            lines.append(f"| {x['variant']} | *{x['status']}: {x.get('reason', '')}* | | | |")
            continue
        lines.append(f"| {x['variant']} | {x['median_ms']:.1f} | {x.get('speedup', 1.0):.2f}x | {x['psnr_db']:.1f} dB "
                     f"| {x['peak_gib']:.1f} |")
    return (f"{hardware(r)}. `{r['command'].split(' --json')[0]}` → `benchmarks/results/{Path(path).name}`\n\n"
            + "\n".join(lines) + "\n")


def table(path: str) -> str:
    r = load(path)
    head = (f"**{r['workload']}**, latent {tuple(r['latent_shape'])}, {r['dtype']}, median of {r['repeats']}. "
            f"Hardware: {hardware(r)}; bf16 matmul {r['matmul_tflops']:.0f} TFLOP/s in the same run.\n"
            f"`{r['command'].split(' --json')[0]}` → `benchmarks/results/{Path(path).name}`\n\n")
    base = r.get("speedup_baseline") or "diffusers bf16 eager"  # results before the field: always that row
    lines = [f"| row | median ms | peak GiB | TFLOP/s (% of matmul) | PSNR vs fp32 | max abs err | vs {base} |",
             "|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        if x["status"] != "ok":
            lines.append(f"| {x['name']} | *{x['status']}*: {x['reason']} | | | | | |")
            continue
        psnr = "reference" if x["kind"] == "reference" else f"{x['psnr_db']:.1f} dB"
        lines.append(f"| {x['name']} | {x['median_ms']:.1f} | {x['peak_alloc_gib']:.2f} | {x['tflops']:.0f} "
                     f"({100 * x['frac_of_matmul']:.0f}%) | {psnr} | {x['max_abs']:.3f} | "
                     f"{x.get('speedup_vs_baseline') or x['speedup_vs_diffusers_bf16']:.2f}x |")
    return head + "\n".join(lines) + "\n"


INTRO = """# Benchmarks

Generated by `python3 benchmarks/make_tables.py` from the JSON files in `benchmarks/results/`; do not edit by hand.
Every run is `vaeopt benchmark` (or the named script) on the full-size architecture with random weights: timing
does not depend on the weights, fidelity does (see [fp8.md](fp8.md) for what the FP8 gate does with trained ones).
PSNR and max abs error are against the fp32 decode of the same weights and latents. Each ladder row adds one stage to
the row above it; a stage that does nothing on a workload is listed as skipped with its reason. The workloads are
defined in `vaeopt/benchmark.py` (`sdxl-1024`: latent 1x4x128x128; `wan21-480p`: 81 frames at 480x832, ...).

Caveats: GPUs of one model differ by 3–5% between machines, and a GPU decoding back to back at its power cap runs a
few percent slower than these medians of a few repeats ([experiments.md](experiments.md), E31); the first decode
in a new process compiles or loads the Triton kernels and is not timed.
"""


def main() -> str:
    parts = [INTRO, "## Summary (bf16)\n", summary(),
             "\n## FP8 level 3 (`--fp8`, lossy, gated on fidelity)\n", fp8_summary(),
             "\n## Several GPUs (`--gpus N`)\n", distributed()]
    if ONE_SHOT:
        parts += ["\n## One-shot `vaeopt decode` (whole process)\n", *map(one_shot_table, ONE_SHOT),
                  "\nPhase by phase, after the warm-up thread left the GIL to the imports (E67):\n", *map(phases_table, PHASES)]
    parts.append("\n## Variants (one thing changed per row)\n")
    for f in VARIANTS:
        parts += [f"### {VARIANT_TITLES.get(f, load(f)['workload'])}\n", VARIANT_NOTES.get(f, ""), variants_table(f)]
    parts.append("\n## Ladders\n")
    for f in [*HEADLINE.values(), *COMPILE, *OTHER_LADDERS, *FP8, *FP8_LEVELS]:
        parts += [f"### {load(f)['workload']} ({load(f)['gpu']}, `{f}`)\n", *[LADDER_NOTES.get(f)][:f in LADDER_NOTES], table(f)]
    return "\n".join(parts)


if __name__ == "__main__":
    if sys.argv[1:]:
        print("\n".join(one_shot_table(p) if load(p).get("setup") == "one_shot" else
                        variants_table(p) if "variants" in load(p) else table(p) for p in sys.argv[1:]))
    else:
        (ROOT / "docs" / "benchmarks.md").write_text(main())
        print("wrote docs/benchmarks.md")
