"""Shared test setup: CPU-friendly vLLM environment, offline model folders, GPU skipping."""

import logging
import os
import sys
from pathlib import Path

import pytest

from hotwire_core.cpu_env import CPU_ENV

# vLLM on a CPU-only machine (see ../shared/docs/cpu-vllm.md); set before anything imports vLLM.
for key, value in {
    **CPU_ENV,
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DISABLE_COMPILE_CACHE": "1",
    "HOTWIRE_STORE": "off",
}.items():
    os.environ.setdefault(key, value)

_ROOT_LEVEL = logging.getLogger().level  # before any test imports vLLM

# CUDA may be initialised in the test process (reference models, availability checks): engines must spawn.
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

sys.path.insert(0, str(Path(__file__).parent))


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: run on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _hotwire_log_records_reach_caplog(caplog):
    """Importing vLLM's SageMaker routes sets the root logger and its handlers (pytest's capture handler among them)
    to ERROR, and a test that installs hotwire's hooks routes hotwire's loggers through vLLM's, which does not
    propagate (``vllm_glue._log_through_vllm``): later tests' caplog would see none of hotwire's warnings. Each test
    starts as the process did."""
    loggers = [logging.getLogger(name) for name in ("hotwire_core", "hotwire_api")]
    parents = [logger.parent for logger in loggers]
    logging.root.setLevel(_ROOT_LEVEL)
    caplog.handler.setLevel(logging.NOTSET)
    yield
    for logger, parent in zip(loggers, parents):
        logger.parent = parent


@pytest.fixture(scope="session")
def model_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(model_root) -> Path:
    """A 4-layer Qwen3-shaped model with real random weights (0.02 init), float32."""
    from hotwire_core.tiny_model import build_model

    return build_model(model_root / "qwen3-tiny", "tiny")


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server with an append-only file, stopped after the test (``redis_fixture.RedisServer``)."""
    from redis_fixture import RedisServer

    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()
