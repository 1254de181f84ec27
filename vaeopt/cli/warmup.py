"""`vaeopt warmup`: one planned decode per shape, so that later decodes on this GPU find their kernels, plans and FP8
verdicts cached."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape

from vaeopt.cli import printing
from vaeopt.cli.exits import clean_errors
from vaeopt.cli.printing import QUIET_HELP, VERBOSE_HELP, detail, say, set_verbosity
from vaeopt.options import Options, check_device_name, check_dtype_name, parse_shape, spell_flags


@clean_errors
def warmup(
    model: Optional[Path] = typer.Argument(None, help="The VAE checkpoint later decodes will use (or --workload)."),
    workload: Optional[str] = typer.Option(None, "--workload", "-w", help="A standard workload: its family's "
                                           "architecture (random weights) and latent shape."),
    family: Optional[str] = typer.Option(None, "--family", help="A family's architecture with random weights."),
    shape: Optional[List[str]] = typer.Option(None, "--shape", help="Latent shape N,C,[T,]H,W to warm up "
                                              "(repeatable; default: the workload's or the family's standard one)."),
    dtype: str = typer.Option("auto", "--dtype", help="auto | fp32 | bf16 | fp16, as the later decodes."),
    device: Optional[str] = typer.Option(None, "--device", help="cuda, cuda:1, cpu (default: cuda if available)."),
    fp8: str = typer.Option("off", "--fp8", help="As the later decodes: on stores the FP8 gate's verdict (needs the "
                                                 "checkpoint: a verdict is per weights)."),
    fp8_gate: float = typer.Option(40.0, "--fp8-gate", help="The FP8 gate's PSNR (dB), as the later decodes."),
    vram_budget: Optional[float] = typer.Option(None, "--vram-budget", help="Plan for this many GB, as the later "
                                                "decodes."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help=VERBOSE_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help=QUIET_HELP),
):
    """Compile and cache what later decodes on this GPU need: Triton kernels, plans, FP8 verdicts (prints where)."""
    set_verbosity(verbose, quiet)
    opts = Options(device=device, dtype=dtype, fp8=fp8, gate_db=fp8_gate, vram_budget_gb=vram_budget)
    opts.validate()  # argument mistakes first, before torch loads (seconds)
    check_dtype_name(dtype)
    check_device_name(device)
    for s in shape or ():
        parse_shape(s)
    if family is not None:
        from vaeopt.families import get_family

        get_family(family)  # a misspelled name: the known ones listed
    from vaeopt import warmup as wu
    from vaeopt.hw import resolve_device

    loaded, shapes = wu.load(model, workload, family, shape, resolve_device(device))
    rep = wu.run(loaded, shapes, opts, log=detail, spell=spell_flags)
    if as_json:
        printing.out_console.print_json(json.dumps(rep.to_dict()))
    for line in wu.summary(rep):
        say(escape(line))
