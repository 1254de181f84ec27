"""Load a VAE checkpoint of any common layout into a diffusers model, working out its family and real widths.

Layouts: diffusers (single file or a directory with config.json, also a pipeline directory with vae/), the original
LDM / A1111 / ComfyUI files (with or without `first_stage_model.` / `vae.` prefix, full SD checkpoints included),
FLUX's `ae.safetensors`, the original Wan 2.1 / 2.2 `.pth` files, and the original TAESD decoder files. The family is
read from the weights (class, latent channels, quant convs) and, where weights cannot tell (SD 1.x vs SD 2.x vs SDXL,
SD3 vs FLUX, TAESD vs TAESDXL), from the `family=` argument, the file's metadata, the other weights in a full
checkpoint, then the file name; else a documented default (see docs/user-guide.md). Nothing is downloaded.
"""

from vaeopt.loading.family import Notice
from vaeopt.loading.files import (MAX_JSON_DEPTH, allow_numpy_scalars, expand_user, magic_name, parse_json,
                                  read_state_dict, refused_global, safetensors_header_problem, sniff)
from vaeopt.loading.load import LoadedVAE, detect, load_vae, load_vae_from_state_dict, quiet_diffusers

__all__ = ["LoadedVAE", "read_state_dict", "detect", "load_vae", "load_vae_from_state_dict", "Notice", "MAX_JSON_DEPTH",
           "allow_numpy_scalars", "expand_user", "magic_name", "parse_json", "quiet_diffusers", "refused_global",
           "safetensors_header_problem", "sniff"]
