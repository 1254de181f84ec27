"""pytest plugin: diffusers' own autoencoder model tests, run against models that vaeopt.optimize patched right after
construction (and after from_pretrained, which constructs on the meta device), to check that the drop-in API passes
wherever the stock model does.

From a diffusers source checkout of the installed version (its tests/ folder; the tests also need accelerate and
parameterized), with this repository on the path:

    VAEOPT_PATCH=1 PYTHONPATH=/path/to/vaeopt:/path/to/vaeopt/scripts HF_HUB_OFFLINE=1 \\
        python -m pytest -q -p diffusers_tests_optimized tests/models/autoencoders/test_models_autoencoder_wan.py

and the same without VAEOPT_PATCH=1 for the stock counts (docs/reliability.md lists both). Add
`-p no:cacheprovider` to leave the checkout as it was.

Models are optimized where they are built: on the CPU. Tests that then move one to a GPU, or set up group offloading
or accelerate's device maps on it, check that vaeopt steps aside there with diffusers' own output (an optimized VAE
decodes vaeopt's way only on the device it was optimized for, docs/python-api.md); vaeopt's CUDA stages are tested by
its own GPU tests (`pytest -m gpu`).
"""

import functools
import os

if os.environ.get("VAEOPT_PATCH"):
    import diffusers

    import vaeopt

    def _optimized(m):
        p = next(m.parameters(), None)
        if p is not None and p.device.type != "meta" and getattr(m, "_vaeopt_optimized", None) is None:
            vaeopt.optimize(m, log=None)
        return m

    def _after_init(orig):
        @functools.wraps(orig)
        def __init__(self, *a, **k):
            orig(self, *a, **k)
            _optimized(self)

        return __init__

    def _after_load(orig):
        @functools.wraps(orig)
        def from_pretrained(*a, **k):
            return _optimized(orig(*a, **k))

        return classmethod(from_pretrained)

    for name in ("AutoencoderKL", "AutoencoderKLWan", "AutoencoderKLHunyuanVideo", "AutoencoderTiny"):
        cls = getattr(diffusers, name)
        cls.__init__ = _after_init(cls.__init__)
        cls.from_pretrained = _after_load(cls.from_pretrained.__func__)
