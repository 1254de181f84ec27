"""The ComfyUI nodes: "VAE Decode (vaeopt)" and "VAE Decode Video (vaeopt)" (classic node API: INPUT_TYPES,
RETURN_TYPES, FUNCTION, CATEGORY). Both take ComfyUI's LATENT and VAE and return IMAGE like VAEDecode; the work is
in bridge.py."""

from __future__ import annotations

from . import bridge

_BUDGET = ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1024.0, "step": 0.5,
                     "tooltip": "GPU memory the decode may use, in GB; 0 = what is free after ComfyUI unloads what it "
                                "must. Over it, the decode is tiled (exactly: no seams)."})
_FP8 = ("BOOLEAN", {"default": False,
                    "tooltip": "8-bit weights/convs where the GPU runs them; kept only if the output stays within "
                               "vaeopt's fidelity gate (40 dB vs the full-precision decode)."})


class VAEDecodeVaeopt:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "samples": ("LATENT", {"tooltip": "The latent to be decoded."}),
                "vae": ("VAE", {"tooltip": "The VAE whose weights decode it (shared, not copied)."}),
            },
            "optional": {
                "vram_budget_gb": _BUDGET,
                "tile_size": ("INT", {"default": 0, "min": 0, "max": 8192, "step": 64,
                                      "tooltip": "Tile side in output pixels; 0 = planned from the memory budget. "
                                                 "Tiles are stitched exactly."}),
                "fp8": _FP8,
            },
        }

    RETURN_TYPES = ("IMAGE",)
    OUTPUT_TOOLTIPS = ("The decoded image.",)
    FUNCTION = "decode"
    CATEGORY = "latent"
    DESCRIPTION = ("Decodes latents with vaeopt: planned memory, exact tiling, fused kernels; ComfyUI's own decode "
                   "for VAEs vaeopt does not know.")

    def decode(self, samples, vae, vram_budget_gb=0.0, tile_size=0, fp8=False):
        return (bridge.decode_or_fallback(vae, samples["samples"], fp8=fp8, vram_budget_gb=vram_budget_gb,
                                          tile=tile_size),)


class VAEDecodeVideoVaeopt:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "samples": ("LATENT", {"tooltip": "The video latent (Wan 2.1/2.2, HunyuanVideo) to be decoded."}),
                "vae": ("VAE", {"tooltip": "The VAE whose weights decode it (shared, not copied)."}),
            },
            "optional": {
                "vram_budget_gb": _BUDGET,
                "chunk": ("INT", {"default": 0, "min": 0, "max": 64, "step": 1,
                                  "tooltip": "Latent frames per decoder call; 0 = planned. The causal caches carry "
                                             "across calls, so any chunk gives the same frames."}),
                "fp8": _FP8,
            },
        }

    RETURN_TYPES = ("IMAGE",)
    OUTPUT_TOOLTIPS = ("The decoded frames, one image per frame.",)
    FUNCTION = "decode"
    CATEGORY = "latent/video"
    DESCRIPTION = ("Decodes video latents with vaeopt's chunked decoder within a planned memory budget; frames come "
                   "out in the batch, as VAEDecode gives them.")

    def decode(self, samples, vae, vram_budget_gb=0.0, chunk=0, fp8=False):
        return (bridge.decode_or_fallback(vae, samples["samples"], fp8=fp8, vram_budget_gb=vram_budget_gb,
                                          chunk=chunk),)


NODE_CLASS_MAPPINGS = {
    "VAEDecodeVaeopt": VAEDecodeVaeopt,
    "VAEDecodeVideoVaeopt": VAEDecodeVideoVaeopt,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "VAEDecodeVaeopt": "VAE Decode (vaeopt)",
    "VAEDecodeVideoVaeopt": "VAE Decode Video (vaeopt)",
}
