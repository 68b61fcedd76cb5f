"""Inference side: SGLang server management (``server``) and the async pool client (``client``)."""

from areal_mega.inference.client import (
    InferenceError,
    InferencePool,
    InferenceServerError,
    ServerCapabilities,
    ServerHandle,
)
from areal_mega.inference.config import InferenceClientConfig, InferenceConfig, SGLangServerConfig
from areal_mega.inference.server import (
    SGLangServer,
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
    "SGLangServer",
    "SGLangServerConfig",
    "ServerCapabilities",
    "ServerHandle",
    "ServerStartError",
    "build_launch_command",
    "launch_servers",
    "make_servers",
]
