"""The edge side of autoglm-split: front layers on the device, the rest in the cloud (docs/edge.md).

``from edge_client import EdgeClient`` - the names below are imported lazily, so ``edge_client.config`` or
``edge_client.activation_cache`` can be used without loading onnxruntime and the WebSocket stack.
"""

from __future__ import annotations

_EXPORTS = {
    "EdgeClient": "edge_client.client",
    "Generation": "edge_client.client",
    "AsyncGeneration": "edge_client.client",
    "EdgeClientError": "edge_client.errors",
    "EdgeConfig": "edge_client.config",
    "RetryPolicy": "edge_client.config",
    "RequestStats": "edge_client.request",
    "ActivationCache": "edge_client.activation_cache",
    "FrontRuntime": "edge_client.front",
}

__all__ = ["ActivationCache", "AsyncGeneration", "EdgeClient", "EdgeClientError", "EdgeConfig", "FrontRuntime",
           "Generation", "RequestStats", "RetryPolicy"]


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'edge_client' has no attribute {name!r}")
