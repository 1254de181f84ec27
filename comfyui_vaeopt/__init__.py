"""vaeopt's VAE decode as ComfyUI nodes. Install: copy or symlink this folder into ComfyUI/custom_nodes/ and
`pip install -r requirements.txt` in ComfyUI's Python (see docs/comfyui.md)."""

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
