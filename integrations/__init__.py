"""Adapters from kvckpt to the systems around it, installed as ``kvckpt.integrations``.

Each adapter lives in its own subpackage and imports its heavy dependency (ray, vllm,
transferqueue) only there, through :func:`kvckpt.integrations.common.require_peer`, so
``import kvckpt`` never pulls them in. What the adapters share (the peer-missing error, the
config loader) is ``kvckpt.integrations.common``; docs/architecture.md ("Adding a backend") is
the recipe for a new one.
"""
