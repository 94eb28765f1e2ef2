"""Shared fixtures. Ray-using modules start and stop their own Ray instance (see their helpers)."""
import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The embedded tiny model, built once per test session."""
    from app.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module", autouse=True)
def _ray_left_connected(request):
    """A module whose setup failed between `ray.init` and its `try` left this process connected to its Ray:
    every later module's `ray.init` then failed ("called ray.init twice"), 280 errors in one CI run from
    one failed fixture. Disconnect it here (this process's own instance, nothing else) and report the
    module that left it, so the failure stays where it began."""
    yield
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        try:
            from ray import serve

            serve.shutdown()
        finally:
            ray.shutdown()
        pytest.fail(f"{request.module.__name__} left Ray connected (its fixture or test did not shut it down)")
