"""The CPU harness of the TRL tests: two stand-ins for GPU-only calls, and a TRL-default-like worker.

TRL 1.16.0's ``AsyncGRPOTrainer`` assumes a GPU in exactly two places on the path these tests run:

1. ``torch.cuda.get_device_name`` — called unconditionally by ``trl.trainer.utils.
   get_peak_flops_per_device`` in the trainer's ``__init__`` (for its MFU metric). Stood in by a
   function returning ``"cpu"`` (then TRL finds no peak FLOPs and turns MFU off, as it does for
   any unknown device).
2. The packed ("tree") attention's kernel — ``trl.experimental.async_grpo.packing._flash_attn``
   fetches ``kernels-community/flash-attn3`` from the hub. Stood in by
   :func:`flash_attn_varlen_func` in plain torch: per packed segment, causal attention aligned
   bottom-right (flash-attn's convention when a segment has fewer queries than keys), grouped
   KV heads repeated.

On the vLLM-server path (tests/integrations/trl/test_trl_server.py) a third: TRL's NCCL weight transfer into the
server (:class:`ServerWeightTransferOnCPU`; its readiness wait, ``/pause`` and ``/resume`` stay TRL's).

The kill probes share :func:`make_room` (the one step of the dataloader's they take themselves), and the server-path
runs (trl_server_run.py, trl_server_drain_run.py) :func:`server_run` (the dataset, reward, fsynced log and config).

Nothing else is replaced: the trainer, its dataloader, batcher, collator, loss, optimizer,
checkpointing and ``resume_from_checkpoint`` are TRL's and transformers' own. The integration
(``kvckpt.integrations.trl``) never imports this module.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import types

import torch
import torch.nn.functional as F


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                           causal=True, window_size=(-1, -1), **_):
    """flash-attn's varlen attention in plain torch (``q``: [Tq, H, D]; ``k``/``v``: [Tk, Hkv, D])."""
    assert causal and tuple(window_size) == (-1, -1), "the stand-in covers causal full attention only"
    out = torch.zeros_like(q)
    heads = q.shape[1] // k.shape[1]
    for i in range(len(cu_seqlens_q) - 1):
        qs, qe, ks, ke = (int(x) for x in (cu_seqlens_q[i], cu_seqlens_q[i + 1], cu_seqlens_k[i], cu_seqlens_k[i + 1]))
        if qe <= qs:
            continue
        qi = q[qs:qe].transpose(0, 1)
        ki = k[ks:ke].transpose(0, 1).repeat_interleave(heads, 0)
        vi = v[ks:ke].transpose(0, 1).repeat_interleave(heads, 0)
        mask = torch.ones(qe - qs, ke - ks, dtype=torch.bool).tril(diagonal=(ke - ks) - (qe - qs))
        out[qs:qe] = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=softmax_scale).transpose(0, 1)
    return out


def make_room(buffer) -> None:
    """Claim the oldest ready group of a full store with nothing in flight, as TRL's dataloader reading
    ahead would. A kill probe holds the trainer's thread, so nothing else frees capacity, and a worker
    that found the store full waits on capacity, never reaching the point the probe waits for."""
    if not buffer.admissible() and not buffer.ledger():
        ready = sorted(buffer.groups(["ready"]), key=lambda g: (g.start_weight, g.prompt_idx))
        if ready:
            buffer.claim([ready[0].group_id])


def install_cpu_stand_ins() -> None:
    """Replace the two GPU-only calls (module docstring); idempotent."""
    from trl.experimental.async_grpo import packing

    torch.cuda.get_device_name = lambda *args, **kwargs: "cpu"
    kernel = types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)
    packing._flash_attn = lambda: kernel


def default_like_worker(generate_group, dataset_len: int, log):
    """TRL's ``AsyncRolloutWorker`` minus its vLLM server: an instance of that class (so TRL's
    ``_save_checkpoint`` writes ``rollout_state.json`` and ``_inner_training_loop`` reads it back,
    unchanged) whose loop runs in a thread and generates in process. Like TRL's
    ``_repeat_iterator`` it numbers groups from 0 and starts at ``_loop_kwargs["dataset_start_index"]``;
    its queue is an in-memory ``queue.Queue`` (TRL's is an ``mp.Queue``), lost with the process.

    ``generate_group(position, model_version)`` returns the group's ``RolloutSample``s; ``log(event)``
    records each generated position.
    """
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    class DefaultLikeWorker(AsyncRolloutWorker):
        def __init__(self):
            self.rollout_buffer = queue.Queue(maxsize=64)
            self.metrics_queue = queue.Queue()
            self._loop_kwargs = {"dataset_start_index": 0}
            self._version = 0
            self._stop = threading.Event()
            self._thread = None

        def update_model_version(self, model_version):
            self._version = model_version

        def start(self):
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()

        def _loop(self):
            start = self._loop_kwargs["dataset_start_index"] % dataset_len
            group_id = 0
            while not self._stop.is_set():
                position = self._loop_kwargs["dataset_start_index"] + group_id
                log({"generated": position, "start": start})
                for sample in generate_group(position, group_id, self._version):
                    while not self._stop.is_set():
                        try:
                            self.rollout_buffer.put(sample, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                group_id += 1

        def check_health(self, stale_after_s):
            pass

        def stop(self):
            self._stop.set()
            if self._thread is not None:
                self._thread.join()

    return DefaultLikeWorker()


class ServerWeightTransferOnCPU:
    """TRL's ``WeightTransferClient`` for a CPU vLLM server, standing in for its NCCL calls only.

    TRL's client moves weights over NCCL (``init_weight_transfer``: an NCCL rendezvous with the
    server, ``/init_weight_transfer_engine``; ``send_weights``: ``/start_weight_update``, a packed
    NCCL broadcast, ``/finish_weight_update``): GPU-only, and its constructor refuses to run without
    them. This keeps every other call TRL's own, through TRL's ``VLLMClient`` on the same server:
    ``wait_for_server_ready`` at init, ``pause`` (``/pause?mode=keep``: in-flight requests wait) and
    ``resume``. ``send_weights`` consumes the trainer's parameter stream (TRL's ``_streaming_iter``)
    and sends nothing, so the server keeps the weights it has: the tests that use it train with
    ``learning_rate=0``, where those are the trainer's weights exactly. ``reload`` (``{sync number:
    model directory}``) makes a sync a real weight change instead: between TRL's pause and resume the
    server reloads its weights in place from that directory (vLLM's ``reload_weights``, through its
    dev-mode ``/collective_rpc``), as the NCCL broadcast would have changed them.
    """

    def __init__(self, server_url: str, reload: dict[int, str] | None = None) -> None:
        from trl.experimental.async_grpo.vllm_client import VLLMClient

        self.vllm = VLLMClient(server_url, 120.0)
        self.server_url = server_url
        self.reload = dict(reload or {})
        self.syncs = 0

    def init_weight_transfer(self) -> None:
        """TRL's readiness wait; the NCCL rendezvous is stood in (nothing to set up)."""
        self.vllm.wait_for_server_ready()

    def pause(self) -> None:
        """TRL's ``/pause`` (keep mode)."""
        self.vllm.pause()

    def send_weights(self, iterator) -> None:
        """Stands in for the NCCL broadcast: the parameters are read and not sent (class docstring)."""
        for _ in iterator:
            pass
        self.syncs += 1
        if self.syncs in self.reload:
            reload_server_weights(self.server_url, self.reload[self.syncs])

    def resume(self) -> None:
        """TRL's ``/resume``."""
        self.vllm.resume()

    def destroy(self) -> None:
        """Nothing to tear down without NCCL."""


def reload_server_weights(server_url: str, model_dir: str) -> None:
    """Make the vLLM server reload its weights in place from ``model_dir`` (``/collective_rpc``)."""
    import requests

    response = requests.post(f"{server_url.rstrip('/')}/collective_rpc", timeout=300,
                             json={"method": "reload_weights", "kwargs": {"weights_path": model_dir}})
    assert response.status_code == 200, response.text


def marker_model(model_dir: str, out_dir: str) -> str:
    """A copy of ``model_dir`` whose logits are the same in every context, so every token it generates
    greedily is one and the same (found by asking it once): every attention and MLP output is zeroed (the
    residual stream is the input embedding) and every embedding row is the same vector. A token it
    generated is recognisable in any completion."""
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(tensor)
        elif name.endswith("norm.weight"):
            weights[name] = torch.ones_like(tensor)
        elif name.endswith("embed_tokens.weight"):
            weights[name] = torch.full_like(tensor, 0.1)
    save_file(weights, os.path.join(out_dir, "model.safetensors"))
    return out_dir


def server_run(cfg: dict, max_steps: int, save_steps: int):
    """What the server-path runs share: ``(dataset, reward, log, args)``: the addition task's dataset, its exact-match
    reward, ``log(event)`` appending a JSON line to ``cfg["log"]`` (fsynced), and the ``AsyncGRPOConfig`` (greedy,
    ``learning_rate=0``, ``cfg``'s ``workdir``, ``max_tokens`` and ``server``)."""
    from datasets import Dataset
    from kvckpt.integrations.vllm import AdditionTask
    from trl.experimental.async_grpo import AsyncGRPOConfig

    task = AdditionTask()
    dataset = Dataset.from_list([{"prompt": task.prompt(i), "answer": task.answer(i)} for i in range(task.size)])
    log_fh = open(cfg["log"], "a")  # noqa: SIM115 - appended to until the process ends or is killed

    def log(event):
        log_fh.write(json.dumps(event) + "\n")
        log_fh.flush()
        os.fsync(log_fh.fileno())

    def reward(completions, answer, **_):
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]

    args = AsyncGRPOConfig(
        output_dir=os.path.join(cfg["workdir"], "out"), max_steps=max_steps, save_steps=save_steps,
        save_strategy="steps", per_device_train_batch_size=4, gradient_accumulation_steps=1, num_generations=2,
        max_completion_length=cfg["max_tokens"], token_budget=0, use_cpu=True, bf16=False, report_to=[],
        logging_steps=1, max_staleness=4, learning_rate=0.0, top_k=1, seed=0, save_only_model=False,
        dataloader_num_workers=0, vllm_server_base_url=cfg["server"])
    return dataset, reward, log, args
