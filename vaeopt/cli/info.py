"""`vaeopt info`: the machine, the versions, and what each stage and family does here."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from vaeopt import __version__
from vaeopt.cli import printing
from vaeopt.cli.exits import clean_errors
from vaeopt.options import spell_flags


@clean_errors
def info(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")):
    """GPU, VRAM, versions, capabilities, and what each optimization stage will do here."""
    from vaeopt.info import family_outlook, stage_outlook
    from vaeopt.hw import machine_info

    mi = machine_info()
    outlook = stage_outlook(mi, spell_flags)
    if as_json:
        printing.out_console.print_json(json.dumps({**mi.to_dict(), "stages": outlook, "families": family_outlook()}))
        return
    t = Table(title="vaeopt " + __version__, show_header=False, box=None)
    t.add_row("python", mi.python)
    t.add_row("torch", f"{mi.torch}  (CUDA {mi.cuda or '—'}, cuDNN {mi.cudnn or '—'}, "
                       f"arch list {' '.join(mi.torch_arch_list) or '—'})")
    t.add_row("triton", (mi.triton or "not installed") + ("  [TRITON_INTERPRET=1]" if mi.triton_interpret else ""))
    t.add_row("diffusers", mi.diffusers or "not installed")
    t.add_row("PyAV", mi.pyav or "not installed (no MP4 output)")
    printing.out_console.print(t)
    if not mi.gpus:
        printing.out_console.print("[bold]No CUDA GPU visible.[/] vaeopt runs on the CPU: fp32 decode, whole or "
                                   "tiled, chunked video; no CUDA graphs, no FP8 compute (--fp8 weights stores weights "
                                   "in e4m3), Triton kernels only under TRITON_INTERPRET=1.")
    for g in mi.gpus:
        printing.out_console.print(
            f"[bold]GPU {g.index}[/]: {g.name}  {g.sm}  {g.multiprocessors} SMs  "
            f"VRAM {g.free_gib:.1f} / {g.total_gib:.1f} GiB free  bf16 {'yes' if g.bf16 else 'no'}  "
            f"FP8 tensor cores {'yes' if g.fp8 else 'no'}  in torch build {'yes' if g.arch_in_build else 'NO'}")
    printing.out_console.print("SDPA backends enabled: " + ", ".join(k for k, v in mi.sdpa_backends.items() if v))
    st = Table(title="Stages on this machine", show_lines=False)
    st.add_column("stage")
    st.add_column("here")
    st.add_column("why / what")
    for s in outlook:
        st.add_row(s["stage"], "[green]runs[/]" if s["runs"] else "[yellow]skipped[/]", s["why"])
    printing.out_console.print(st)
    ft = Table(title="Families", show_lines=False)
    for col in ("family", "title", "latents", "what the stages do"):
        ft.add_column(col)
    for f in family_outlook():
        ft.add_row(f["family"], f"{f['title']} [{f['class']}]", f["latents"], f["stages"])
    printing.out_console.print(ft)
