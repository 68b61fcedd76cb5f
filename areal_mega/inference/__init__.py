"""Inference side: the SGLang HTTP API (``sglang_api``: routes, bodies, capabilities, the blocking
client), server processes (``server``) and the async pool client (``client``)."""

from areal_mega.inference.client import (
    InferenceError,
    InferencePool,
    InferenceServerError,
    ServerHandle,
)
from areal_mega.inference.sglang_api import SGLangClient, SGLangError, ServerCapabilities
from areal_mega.inference.config import InferenceClientConfig, InferenceConfig, SGLangServerConfig
from areal_mega.inference.server import (
    SGLangServer,
    ServedLora,
    ServerStartError,
    build_launch_command,
    launch_servers,
    make_servers,
)

__all__ = [
    "InferenceClientConfig",
    "InferenceConfig",
    "InferenceError",
    "InferencePool",
    "InferenceServerError",
    "SGLangClient",
    "SGLangError",
    "SGLangServer",
    "SGLangServerConfig",
    "ServedLora",
    "ServerCapabilities",
    "ServerHandle",
    "ServerStartError",
    "build_launch_command",
    "launch_servers",
    "make_servers",
]
