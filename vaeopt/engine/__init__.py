"""The decode engine: what whole, tiled, chunked and band-parallel decodes share.

Region geometry with receptive-field halos (regions), the halo sources (store: crop a stored activation; halo: rows
from the neighbour ranks), one GroupNorm statistics reducer (stats), the shortcut-bias fold (fold), the
AutoencoderKL structure (image), Wan's chunk decoder (wan, wan_ops) with its dry-run memory estimate (memory), and
HunyuanVideo 1.5's / LTX-2's (stream) with its conv inputs padded in one buffer (pad).
The decoders (vaeopt.tiling, vaeopt.video, vaeopt.video_tiling, vaeopt.bands) are configurations of these.
"""
