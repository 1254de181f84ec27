import os
from pathlib import Path

import pytest
import torch

# Triton kernels run through the interpreter on CPU-only machines. Must be set before triton.jit decorates anything.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "samples"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def samples_dir() -> Path:
    return SAMPLES
