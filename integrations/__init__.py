"""Adapters from kvckpt to the systems around it, installed as ``kvckpt.integrations``.

Each adapter lives in its own subpackage and imports its heavy dependency (ray, vllm,
transferqueue) only there, so ``import kvckpt`` never pulls them in.
"""
