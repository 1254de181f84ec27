"""vaeopt: fast, memory-aware, fidelity-checked VAE decoding for latent diffusion."""

from vaeopt.version import VERSION as __version__


def __getattr__(name):  # lazy: `import vaeopt` stays cheap for the CLI's --help
    if name == "decode":
        from vaeopt.api import decode

        return decode
    if name in ("optimize", "refresh"):
        # the drop-in for diffusers, in vaeopt.dropin: a module named vaeopt/optimize.py would take the attribute
        # vaeopt.optimize once imported, and vaeopt.optimize(vae) would then call a module
        from vaeopt import dropin

        return getattr(dropin, name)
    if name == "load_vae":
        from vaeopt.loading import load_vae

        return load_vae
    if name in ("Pipeline", "Options"):
        from vaeopt import pipeline

        return getattr(pipeline, name)
    raise AttributeError(name)


__all__ = ["decode", "optimize", "refresh", "load_vae", "Pipeline", "Options", "__version__"]
