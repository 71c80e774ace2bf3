"""A real vLLM OpenAI-compatible server on CPU, on loopback, for the TRL server-path tests and benchmark.

TRL 1.16's async GRPO talks to a plain ``vllm serve`` (``/v1/completions``, and ``/pause`` /
``/resume`` with ``VLLM_SERVER_DEV_MODE=1``). vLLM's CPU build pins its own torch and transformers,
so it lives in ``.venv-vllm`` (``bash scripts/setup_peer_env.sh vllm``); the server runs from there
as a subprocess while the trainer runs in the main venv. :func:`vllm_python` is ``None`` where that
venv is absent, and the tests skip.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def vllm_python() -> str | None:
    """``.venv-vllm``'s interpreter (``KVCKPT_VLLM_PYTHON`` overrides it), or None if absent."""
    path = os.environ.get("KVCKPT_VLLM_PYTHON") or os.path.join(ROOT, ".venv-vllm", "bin", "python")
    return path if os.path.isfile(path) else None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class VLLMServer:
    """``vllm serve MODEL`` on 127.0.0.1 (float32, eager, no prefix caching), stopped on exit.

    ``max_num_seqs=1`` makes the server run one sequence per engine step: vLLM's CPU kernels round
    differently with the batch's size (a CI run saw one logprob of 64 differ in its seventh digit
    between a sequence batched with others and the same sequence alone), so a test that compares
    logprobs bit for bit against a run alone needs every run alone. ``None`` keeps vLLM's default.
    """

    def __init__(self, model: str, log_path: str, *, max_model_len: int = 256,
                 max_num_seqs: int | None = None) -> None:
        self.model, self.log_path, self.port = model, log_path, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> VLLMServer:
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING"}
        cmd = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model, "--host", "127.0.0.1",
               "--port", str(self.port), "--dtype", "float32", "--max-model-len", str(self.max_model_len),
               "--enforce-eager", "--no-enable-prefix-caching", "--seed", "0"]
        if self.max_num_seqs is not None:
            cmd += ["--max-num-seqs", str(self.max_num_seqs)]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}; log: {self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(1)
        self.__exit__()
        raise RuntimeError(f"vllm serve did not answer /health in 300 s; log: {self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        """The end of the server's log."""
        with open(self.log_path) as log:
            return log.read()[-chars:]

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.proc = None
