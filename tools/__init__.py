"""The ``kvckpt`` command line, installed as ``kvckpt.tools``."""
