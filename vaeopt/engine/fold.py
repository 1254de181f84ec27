"""Conv biases owed to the next consumer.

The fused decodes run a conv without its bias and let the next kernel add it (the norm that reads the output, or
the residual epilogue). A 1x1 shortcut conv (no padding) reading an activation that still owes a bias xb folds it
exactly: sc(x + xb) = sc_nobias(x) + (W @ xb + b). Every decoder (whole Wan chunks, image tiles, bands) uses this.
"""

from __future__ import annotations

import torch
from torch import nn


def shortcut_bias(sc: nn.Module, xb: torch.Tensor | None) -> torch.Tensor | None:
    """The bias that sc_nobias(x) owes so that it equals sc(x + xb): W @ xb + sc.bias in fp32, or sc.bias as it is
    when nothing is owed to x (xb None)."""
    if xb is None:
        return sc.bias
    fold = torch.mv(sc.weight.detach().reshape(sc.out_channels, -1).float(), xb.detach().float())
    return fold if sc.bias is None else fold.add_(sc.bias.detach().float())
