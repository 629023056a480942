import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton reads this when a kernel is decorated, so it must be set before asyncmoe is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import transformers  # noqa: E402

transformers.logging.set_verbosity_error()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
