"""Render the markdown tables of docs/benchmarks.md from the result JSON files (so the docs quote only measurements).

    python benchmarks/make_tables.py benchmarks/results/h200_sdxl-1024_2026-11-21b.json ...
"""

import json
import sys
from pathlib import Path


def table(path: str) -> str:
    r = json.load(open(path))
    v = r["versions"]
    head = (f"**{r['workload']}** latent {tuple(r['latent_shape'])}, {r['dtype']}, {r['gpu']} (torch {v['torch']}, "
            f"cuDNN {v['cudnn']}, Triton {v['triton']}, diffusers {v['diffusers']}), {r['date'][:10]}, median of "
            f"{r['repeats']}; bf16 matmul {r['matmul_tflops']:.0f} TFLOP/s in the same run. `{r['command']}` "
            f"→ `{path}`\n\n")
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
    foot = ""
    if r.get("fp8_levels"):  # `vaeopt benchmark --fp8`: one line per level, as under the CLI's table
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from vaeopt.benchmark import level_lines

        foot = "\n" + "\n".join(f"- {line}" for line in level_lines(r["fp8_levels"])) + "\n"
    return head + "\n".join(lines) + "\n" + foot


if __name__ == "__main__":
    print("\n".join(table(p) for p in sys.argv[1:]))
