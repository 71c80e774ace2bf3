"""A TRL ``RolloutWorkerProtocol`` whose queue is a kvckpt store.

TRL's ``AsyncGRPOTrainer`` calls, on its main process (trl/experimental/async_grpo/
async_grpo_trainer.py, TRL 1.16.0): ``rollout_worker.rollout_buffer`` once in ``__init__``;
``start()`` on train begin after the cold weight sync; ``update_model_version(v)`` after every sync;
``check_health(stale_after_s)`` whenever ``rollout_buffer.get`` times out; ``metrics_queue.get_nowait``
in ``log()``; ``stop()`` when training ends. Its ``weight_transfer`` gets ``init_weight_transfer()``,
then per sync ``pause()``, ``send_weights(iterator)``, ``resume()``, and ``destroy()`` at the end.

:class:`KvckptRolloutWorker` runs in a thread of the trainer's process: it admits dataset
positions through :meth:`kvckpt.ReplayBuffer.admit` (the position after them is the admission's
dataloader state, so the ledger owns the cursor and every in-flight prompt), samples
``num_generations`` completions per prompt — by default from the user's vLLM server with TRL's own
request, streamed, each sample's tokens recorded durably every K tokens so a redispatched sample
resumes from its durable prefix (:mod:`~kvckpt.integrations.trl.server`); or in process with a
kvckpt generation backend — scores them with the
trainer's reward functions as TRL's own worker does (group-normalised advantage), and commits each
group in one transaction. The store is opened by :class:`~kvckpt.integrations.trl.callback.KvckptCallback`
on train begin, which also recovers it on a resume; the worker only generates once it is open.

The module is long because the worker is TRL's whole protocol in one class (the queue, the generation
thread, both weight-sync paths and the commit), each part short and tied to the others' locks.
"""

from __future__ import annotations

import json
import math
import queue
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from kvckpt.integrations.common.holder import default_holder
from kvckpt.integrations.common.progress import drain_on_sigterm
from kvckpt.integrations.trl.peer import rollout_sample_class
from kvckpt.integrations.trl.queue import BufferQueue, VersionClock
from kvckpt.integrations.trl.server import SAMPLING_FIELDS, VLLMServerBackend
from kvckpt.integrations.trl.sync import ServerWeightSync, WeightEpochs
from kvckpt.integrations.vllm import PROGRESS_EVERY_TOKENS, SequenceState, create_backend, stream_leases
from kvckpt.integrations.vllm.worker import DRAIN_SECONDS

from kvckpt import BufferConfig, GateTimeout, KvckptError, Lease, Prompt, ReplayBuffer
from kvckpt.errors import BadArgument, InvariantViolation


def trl_schema() -> dict[str, tuple[str, str]]:
    """The row schema of a TRL rollout: exactly the fields a ``RolloutSample`` trains on."""
    return {"input_ids": ("int64", "token"), "completion_mask": ("int64", "token"),
            "old_log_probs": ("float32", "token"), "advantage": ("float32", "row"), "reward": ("float32", "row")}


#: The deprecation warning of the changed default backend (0.2.0): code written for 0.1.0's in-process default
#: asks a vLLM server now. It is given while ``backend`` is left out, for one release (removed in 0.3.0).
DEFAULT_BACKEND_CHANGED = (
    'KvckptRolloutWorker\'s default backend is "server" since kvckpt 0.2.0 (it was the in-process "transformers" '
    'backend): pass backend="server" to keep asking the vLLM server at args.vllm_server_base_url, or '
    'backend="transformers" for the old default; this warning goes away in 0.3.0')

class KvckptRolloutWorker:
    """TRL's rollout worker on kvckpt: admission, generation on TRL's vLLM server (or in process),
    durable token progress, durable group commits.

    Guarantees: every dataset position leaves the cursor in the same transaction that makes it a
    ledger entry; every group is committed whole in one durable transaction before the trainer can
    see it; a crash loses no committed group and no in-flight prompt (the callback's recovery hands
    each in-flight prompt back exactly once, and this worker generates it before admitting more);
    every token is stamped with the optimizer step of the weights that generated it (on the server
    path, through the weight sync's epochs, :mod:`~kvckpt.integrations.trl.sync`, even when a sync
    lands mid-stream), a group's ``start_weight`` is its oldest token's and its ``end_weight`` its
    newest token's (a lease stamped otherwise is restamped, see :meth:`_stamped`).

    Args:
        store_path: the live kvckpt store (created on first train begin).
        model_path: the policy's Hugging Face directory (the trainer's starting weights).
        dataset: rows with a ``prompt`` (text, or chat messages rendered with the tokenizer's chat
            template); position ``i`` of the stream is row ``i % len(dataset)``.
        reward_funcs: called as TRL's worker calls them: ``f(prompts=, completions=, completion_ids=,
            **other columns)``, returning one float (or ``None``) per completion; summed.
        args: the trainer's ``AsyncGRPOConfig`` (``num_generations``, ``max_staleness``,
            ``weight_sync_steps``, ``max_completion_length``, ``temperature``).
        backend: ``"server"`` (TRL's own path: the vLLM server at ``args.vllm_server_base_url``, asked
            with TRL's request, streamed, see :mod:`~kvckpt.integrations.trl.server`; weights synced
            by TRL's own weight transfer) or a kvckpt in-process backend (``"transformers"``,
            ``"vllm"``; weights synced by :class:`InProcessWeightTransfer`). Defaults to ``"server"``; left out,
            a ``FutureWarning`` says so for one release (:data:`DEFAULT_BACKEND_CHANGED`, CHANGELOG.md 0.2.0).
        weight_transfer: on the server path, the transfer that moves the trainer's weights into the
            server (TRL's ``WeightTransferProtocol``). Defaults to None: TRL's own ``WeightTransferClient``,
            built as TRL builds it. Pass the trainer ``weight_transfer=worker.weight_transfer`` either way.
        progress_every_tokens: record each sample's tokens, logprobs and weight version durably every
            this many tokens (one step message per batch of engine steps; on the server
            path, written off the stream's reader by the recorder's flusher, tokens that arrive during
            a flush joining the next one); a redispatched sample resumes from its durable prefix. 0 turns it off.
            Defaults to :data:`~kvckpt.integrations.vllm.PROGRESS_EVERY_TOKENS` with ``"server"``,
            0 with an in-process backend.
        progress_every_seconds: also record a sample's tokens once this long passed since its last
            record. Defaults to None (by count only).
        after_step: called with the :class:`~kvckpt.integrations.vllm.SequenceState` list after each
            batch's progress records (a test and fault-injection hook; on the server path, after each
            batch of stream events was handed to the recorder, with no flush in flight while it
            runs, once what the batch made due is recorded). Defaults to None.
        capacity: ``max_buffered_rollouts`` of a new store (prompts in flight plus ready groups).
            Defaults to ``(max_staleness + 1) * 4`` prompts.
        prompts_per_admit: prompts admitted and generated per engine call. Defaults to 1.
        retain_consumed: keep trained groups' rows in the store. Defaults to False.
        seed: the backend's sampling seed. Defaults to 0.
        holder: the name its leases record (``leases_held_by``). Defaults to ``host:pid``.
        drain_seconds: on SIGTERM (a preemption notice), stop generating and make every in-flight
            sample's unrecorded tail durable within this many seconds, then let the signal end the
            process (:func:`~kvckpt.integrations.common.progress.drain_on_sigterm`, as the vLLM
            ``RolloutWorker``; installed when progress is recorded and the worker is built in the main
            thread). ``None``: leave SIGTERM alone. Defaults to
            :data:`~kvckpt.integrations.vllm.worker.DRAIN_SECONDS`.
    """

    def __init__(self, store_path: str, model_path: str, dataset: Sequence[Any], reward_funcs: Any, args: Any, *,
                 backend: str | None = None, weight_transfer: Any = None, capacity: int | None = None,
                 prompts_per_admit: int = 1, retain_consumed: bool = False, seed: int = 0,
                 progress_every_tokens: int | None = None,
                 progress_every_seconds: float | None = None,
                 after_step: Callable[[Sequence[SequenceState]], None] | None = None,
                 holder: str | None = None, drain_seconds: float | None = DRAIN_SECONDS) -> None:
        if backend is None:
            warnings.warn(DEFAULT_BACKEND_CHANGED, FutureWarning, stacklevel=2)
            backend = "server"
        self._sample_cls = rollout_sample_class()
        if len(dataset) == 0:
            raise BadArgument("the TRL worker needs a non-empty dataset")
        self.store_path = str(store_path)
        self.dataset = dataset
        self.reward_funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        self.num_generations = int(args.num_generations)
        self.max_tokens = int(args.max_completion_length)
        self.temperature = float(args.temperature)
        self.prompts_per_admit = int(prompts_per_admit)
        self.config = BufferConfig(
            group_size=self.num_generations, schema=trl_schema(),
            sampler={"name": "windowed",
                     "max_staleness_versions": int(args.max_staleness) * int(args.weight_sync_steps)},
            max_buffered_rollouts=capacity or (int(args.max_staleness) + 1) * 4, retain_consumed=retain_consumed)
        self.clock = VersionClock(weight_sync_steps=int(args.weight_sync_steps), max_staleness=int(args.max_staleness))
        self.rollout_buffer = BufferQueue(self._samples, self.clock)
        self.metrics_queue: queue.Queue = queue.Queue()
        #: Whether generation is the vLLM server's (its stream's reader hands progress to the
        #: recorder's flusher thread, so it never waits for an fsync).
        self.server = backend == "server"
        if self.server:
            self.backend: Any = VLLMServerBackend(
                model_path, server_url=args.vllm_server_base_url, request_timeout=args.request_timeout, seed=seed,
                sampling={name: getattr(args, name, None) for name in SAMPLING_FIELDS})
        else:
            self.backend = create_backend(backend, model_path, seed=seed)
        #: The server's weight epochs (told by :attr:`weight_transfer` on the server path).
        self.epochs = WeightEpochs()
        if self.server:
            self.backend.epochs = self.epochs
        self.tokenizer = self.backend.tokenizer
        self.progress_every_tokens = int(progress_every_tokens if progress_every_tokens is not None
                                         else PROGRESS_EVERY_TOKENS if self.server else 0)
        self.progress_every_seconds = progress_every_seconds
        if drain_seconds is not None and (self.progress_every_tokens > 0 or progress_every_seconds is not None):
            drain_on_sigterm(drain_seconds)
        self.after_step = after_step
        #: The name the leases this worker admits and redispatches record (``leases_held_by``).
        self.holder = holder or default_holder()
        #: Cumulative counts of the streaming path: tokens generated, tokens resumed from durable
        #: prefixes, progress appends and ``record_progress_step`` calls (one step message each).
        self.progress_stats = {"tokens_generated": 0, "tokens_resumed": 0, "appends": 0, "append_calls": 0}
        self.engine_lock = threading.Lock()
        self.buffer: ReplayBuffer | None = None
        #: TRL's ``weight_transfer=``: :class:`~kvckpt.integrations.trl.sync.ServerWeightSync` on the
        #: server path (TRL's own transfer, which tells the stream when the server's weights change),
        #: :class:`InProcessWeightTransfer` for an in-process backend.
        self.weight_transfer: Any = (ServerWeightSync(self, weight_transfer) if self.server
                                     else InProcessWeightTransfer(self))
        self._redispatch: list[Lease] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # -- the store (opened by the callback) -------------------------------------------------------
    def attach(self, buffer: ReplayBuffer, leases: Iterable[Lease] = ()) -> None:
        """Serve and generate with ``buffer``; ``leases`` (a recovery plan's) are generated first."""
        self.buffer = buffer
        self._redispatch = list(leases)
        self.rollout_buffer.attach(buffer)

    # -- RolloutWorkerProtocol ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the generation thread (TRL calls this once, after the cold weight sync)."""
        if self.buffer is None:
            raise InvariantViolation("the kvckpt store is not open: pass worker.callback in the trainer's callbacks")
        if self.server and not self.epochs.synced:
            raise InvariantViolation("the vLLM server's weights were synced without the worker knowing: pass the "
                                     "trainer weight_transfer=worker.weight_transfer (the tokens' stamps need it)")
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kvckpt-trl-rollout", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop generating and wait for the thread; the store stays open (``close`` closes it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """Stop, then close the store."""
        self.stop()
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None

    def update_model_version(self, model_version: int) -> None:
        """TRL published ``model_version``: new admissions are stamped with its weights' step."""
        self.clock.publish(model_version)

    def check_health(self, stale_after_s: float) -> None:
        """Raise the generation thread's failure, if it failed.

        Raises:
            KvckptError: the thread stopped on an error (chained as the cause).
        """
        if self._error is not None:
            raise KvckptError(f"the kvckpt rollout worker stopped: {type(self._error).__name__}: {self._error}") \
                from self._error

    @property
    def callback(self) -> Any:
        """The :class:`~kvckpt.integrations.trl.callback.KvckptCallback` of this worker (one per worker)."""
        if not hasattr(self, "_callback"):
            from kvckpt.integrations.trl.callback import KvckptCallback

            self._callback = KvckptCallback(self)
        return self._callback

    # -- weights --------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Install the trainer's parameters (TRL's names) in the engine; call with ``engine_lock`` held.

        Raises:
            BadArgument: a name the engine's model does not have (nothing is loaded then).
        """
        items = [(name, tensor.detach().to("cpu")) for name, tensor in weights]
        model = getattr(self.backend, "model", None)
        if model is not None:
            known = set(model.state_dict())
            unknown = sorted(name for name, _ in items if name not in known)
            if unknown:
                raise BadArgument(f"the trainer sent parameters the rollout engine lacks: {unknown[:5]}")
        self.backend.load_weights(items)

    # -- generation -----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                leases = self._next_leases()
                if leases:
                    self._generate(leases)
        except BaseException as exc:  # reported through check_health, which TRL polls
            self._error = exc

    def _next_leases(self) -> list[Lease]:
        if self._redispatch:
            count = self.prompts_per_admit
            taken, self._redispatch = self._redispatch[:count], self._redispatch[count:]
            return taken
        state = self.buffer.dataloader_state()
        cursor = json.loads(state)["next"] if state else 0
        count = self.prompts_per_admit
        try:
            return self.buffer.admit([Prompt(cursor + i) for i in range(count)],
                                     dataloader_state=json.dumps({"next": cursor + count}).encode(),
                                     timeout=0.2, weight_version=self.clock.weights_step, holder=self.holder)
        except GateTimeout:
            return []

    def _row(self, prompt_idx: int) -> Any:
        return self.dataset[prompt_idx % len(self.dataset)]

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return list(self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False))

    def _completion(self, prompt: Any, text: str) -> Any:
        return text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]

    def _generate(self, leases: list[Lease]) -> None:
        rows = [self._row(lease.prompt_idx) for lease in leases]
        prompts = [self._prompt_ids(row["prompt"]) for row in rows]
        refused: dict[str, Any] = {}
        with self.engine_lock:
            weights = self.epochs.running()[1] if self.server else self.clock.weights_step
            leases = [self._stamped(lease, weights) for lease in leases]
            if self.progress_every_tokens > 0 or self.progress_every_seconds is not None:
                groups, recorder = stream_leases(
                    self.buffer, self.backend, leases, prompts, max_tokens=self.max_tokens,
                    temperature=self.temperature, weight_version=weights, every_tokens=self.progress_every_tokens,
                    every_seconds=self.progress_every_seconds, after_step=self.after_step, stats=self.progress_stats,
                    background=self.server)
                refused = recorder.refused
            else:
                groups = self.backend.generate(prompts, [len(lease.missing) for lease in leases], self.max_tokens,
                                               self.temperature)
        for lease, row, samples in zip(leases, rows, groups, strict=True):
            if lease.group_id in refused:  # fenced by a recovery or aborted: its new owner generates it
                continue
            if len(lease.missing) != self.num_generations:
                raise InvariantViolation(f"lease {lease.group_id} misses {len(lease.missing)} of "
                                         f"{self.num_generations} rows; this worker commits whole groups only")
            completions = [self._completion(row["prompt"], s.text) for s in samples]
            rewards = self._score(row, completions, [list(s.completion_ids) for s in samples])
            stamps = [v for s in samples for v in token_versions(s, weights)]
            oldest, newest = min(stamps, default=weights), max(stamps, default=weights)
            if oldest > lease.start_weight:  # a weight sync landed before its first token: restamp (one transaction)
                lease = self.buffer.redispatch(lease.group_id, start_weight=oldest, holder=self.holder)
            self.buffer.commit_group(lease, _rows(samples, rewards), end_weight=newest)

    def _stamped(self, lease: Lease, weights: int) -> Lease:
        """``lease``, stamped with ``weights`` (the engine's, held under ``engine_lock``; on the server
        path the server's, from the weight epochs, and a sync before the first token restamps again at
        commit): a weight sync
        that landed between admission (or a recovery's redispatch) and this generation would leave
        the stamp older than the weights that generate the group, so it is redispatched with the
        true stamp first (one transaction; the whole group is generated now, nothing is kept). A
        recovery plan's lease is taken as the recovery fenced it, with the holder it names (the process
        before): redispatching it only to rename its holder would add an attempt to every resumed prompt."""
        if lease.start_weight == weights:
            return lease
        return self.buffer.redispatch(lease.group_id, start_weight=weights, holder=self.holder)

    def _score(self, row: Any, completions: list[Any], completion_ids: list[list[int]]) -> list[float]:
        count = len(completions)
        extra = {k: [v] * count for k, v in row.items() if k not in ("prompt", "completion", "completion_ids")}
        table = []
        for func in self.reward_funcs:
            got = func(prompts=[row["prompt"]] * count, completions=completions, completion_ids=completion_ids,
                       **extra)
            table.append([math.nan if r is None else float(r) for r in got])
        arr = np.array(table, dtype=float)
        unscored = np.all(np.isnan(arr), axis=0)
        rewards = np.nansum(arr, axis=0)
        rewards[unscored] = np.nan
        return [float(r) for r in rewards]

    def _samples(self, info: Any, rows: list[dict[str, Any]], model_version: int) -> Iterator[Any]:
        """TRL ``RolloutSample``s of one stored group (its ``group_id`` is the dataset position)."""
        prompt = self._row(info.prompt_idx)["prompt"]
        for row in rows:
            ids = row["input_ids"]
            mask = row["completion_mask"]
            text = self.tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
            reward = float(row["reward"])
            yield self._sample_cls(
                prompt=prompt, completion=self._completion(prompt, text), input_ids=ids.numpy().astype(np.int64),
                completion_mask=mask.numpy().astype(np.int64), old_log_probs=row["old_log_probs"].numpy(),
                advantage=float(row["advantage"]), model_version=model_version, group_id=int(info.prompt_idx),
                metrics={"reward": reward})


def token_versions(sample: Any, weights: int) -> list[int]:
    """The weight version of each completion token of ``sample``: its ``prefix_versions`` (a durable
    prefix's, or every token's on the server path), then ``weights`` (the generating engine's)."""
    known = list(sample.prefix_versions)
    return known + [weights] * (len(sample.completion_ids) - len(known))


def _rows(samples: Sequence[Any], rewards: list[float]) -> list[dict[str, torch.Tensor]]:
    """One row per completion, with TRL's group-normalised advantage (0 for an unscorable one)."""
    arr = np.array(rewards, dtype=float)
    scored = ~np.isnan(arr)
    advantages = np.zeros_like(arr)
    if scored.any():
        advantages[scored] = (arr[scored] - arr[scored].mean()) / (arr[scored].std() + 1e-8)
    out = []
    for sample, reward, advantage in zip(samples, rewards, advantages, strict=True):
        prompt, completion = list(sample.prompt_ids), list(sample.completion_ids)
        out.append({
            "input_ids": torch.tensor(prompt + completion, dtype=torch.int64),
            "completion_mask": torch.tensor([0] * len(prompt) + [1] * len(completion), dtype=torch.int64),
            "old_log_probs": torch.tensor([0.0] * len(prompt) + list(sample.logprobs), dtype=torch.float32),
            "advantage": torch.tensor(float(advantage), dtype=torch.float32),
            "reward": torch.tensor(reward, dtype=torch.float32),
        })
    return out


class InProcessWeightTransfer:
    """TRL's ``WeightTransferProtocol`` for a :class:`KvckptRolloutWorker`'s in-process engine.

    ``pause`` waits for the generation in progress and holds the engine; ``send_weights`` loads the
    trainer's parameters into it; ``resume`` lets generation go on. A sync therefore lands between
    two generations, never inside one.
    """

    def __init__(self, worker: KvckptRolloutWorker) -> None:
        self.worker = worker
        self._held = False

    def init_weight_transfer(self) -> None:
        """Nothing to set up in process."""

    def pause(self) -> None:
        """Hold the engine (waits for the generation in progress)."""
        if not self._held:
            self.worker.engine_lock.acquire()
            self._held = True

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Load every ``(name, tensor)`` pair into the engine."""
        self.worker.load_weights(iterator)

    def resume(self) -> None:
        """Release the engine."""
        if self._held:
            self._held = False
            self.worker.engine_lock.release()

    def destroy(self) -> None:
        """Release the engine if a sync failed between ``pause`` and ``resume``."""
        self.resume()

