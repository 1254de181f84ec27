"""vaeopt: fast, memory-aware, fidelity-checked VAE decoding for latent diffusion."""

from vaeopt.version import VERSION as __version__


def __getattr__(name):  # lazy: `import vaeopt` stays cheap for the CLI's --help
    if name in ("decode", "optimize", "refresh"):
        from vaeopt import api

        return getattr(api, name)
    if name == "load_vae":
        from vaeopt.loading import load_vae

        return load_vae
    if name in ("Pipeline", "Options"):
        from vaeopt import pipeline

        return getattr(pipeline, name)
    raise AttributeError(name)


__all__ = ["decode", "optimize", "refresh", "load_vae", "Pipeline", "Options", "__version__"]
