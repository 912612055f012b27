import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run through the interpreter on CPU; this must be set before any kernel is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))  # tests/configs.py, tests/mutants.py


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked @pytest.mark.gpu); this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
