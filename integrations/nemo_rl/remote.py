"""Token progress from NeMo-RL's Ray generation workers, written through the buffer's Ray client.

NeMo-RL starts its vLLM workers as Ray actors (``VllmGeneration`` builds them from a class path with
``RayWorkerBuilder``); its ``TQReplayBuffer`` lives in another process (the driver, or the
``SingleControllerActor`` it is shipped to) and owns the store file (one writer). The engine proxy inside a worker
(:mod:`.engine`) writes through kvckpt's :class:`~kvckpt.integrations.ray.BufferClient` to a named Ray actor, the
**desk** (:class:`ProgressDesk`), which speaks the buffer actor's progress calls (``info``,
``record_progress_steps``, ``progress``) and hands each call to the process that owns the store:
:class:`ProgressService`, started by the buffer there, takes the calls (a thread), runs each as the store's own
call (one durable transaction per call) and answers. A worker's write is acknowledged once the owner's
transaction is durable (so durable >= acknowledged), a fenced attempt's is refused by the store (``StaleAttempt``)
as in process, and the desk is owned by the owner's process: it dies with it, so a worker of a killed run reaches
nothing until a restarted owner starts a new desk, whose store fenced that run.

Which workers record and where to: the sequence key that :class:`~.engine.KeyedGeneration` adds to a request's
``data`` carries :func:`ProgressService.settings` (the desk's name and namespace, the interval, the EOS token and the
trainer's version); the worker's ``generate_async`` (wrapped by :func:`~.engine.install_worker`) attaches the proxy
on the first keyed request, with :func:`desk_sink` as its sink. :func:`install_worker_class` makes NeMo-RL build
its async vLLM worker from :data:`WORKER_FQN` (NeMo-RL's own class, so wrapped; :mod:`.worker_actor`).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from kvckpt.integrations.common import require_peer

from kvckpt import ReplayBuffer

#: The desk's name prefix; the rest is a digest of the store's path (one desk per store).
DESK_PREFIX = "kvckpt-nemo-rl-progress-"
#: NeMo-RL's async vLLM worker (``vllm_generation.py`` builds it when ``vllm_cfg.async_engine``) and kvckpt's.
NEMO_RL_WORKER_FQN = "nemo_rl.models.generation.vllm.vllm_worker_async.VllmAsyncGenerationWorker"
WORKER_FQN = "kvckpt.integrations.nemo_rl.worker_actor.VllmAsyncGenerationWorker"
#: Seconds the owner's thread waits for a call before it looks at whether it should stop.
TAKE_WAIT_S = 0.5


def _ray() -> Any:
    return require_peer("ray", integration="kvckpt.integrations.nemo_rl (progress from Ray workers)",
                        install="pip install 'ray>=2.9'")


class ProgressDesk:
    """The buffer actor's progress calls, answered by the process that owns the store (module docstring).

    A Ray async actor (:meth:`ProgressService.start` makes it). ``record_progress_steps`` and ``progress`` queue
    the call and wait for the owner's answer; ``take`` and ``answer`` are the owner's side.
    """

    def __init__(self, config: Mapping[str, Any]) -> None:
        self._config = dict(config)
        self._queue: asyncio.Queue[tuple[int, str, Any]] = asyncio.Queue()
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count()

    async def info(self) -> dict[str, Any]:
        """What a producer needs to encode its progress (the store's config), as the buffer actor answers."""
        return {"config": self._config, "epoch": None, "role": "primary"}

    async def record_progress_steps(self, messages: Sequence[bytes], client: str | None = None, seq: int = 0,
                                    oldest: int = 0, wait: float = 0.0) -> list[Any]:
        """:meth:`kvckpt.ReplayBuffer.record_progress_steps` in the owner's process, answered once durable (the
        order tags are the buffer actor's; a client of the engine proxy has one call in flight at a time)."""
        return await self._ask("steps", [bytes(m) for m in messages])

    async def progress(self, group_id: str) -> dict[int, dict[str, Any]]:
        """A group's durable prefixes, as :meth:`BufferActor.progress` returns them."""
        return await self._ask("progress", str(group_id))

    async def take(self, timeout: float) -> list[tuple[int, str, Any]]:
        """The owner's side: every call waiting (at most ``timeout`` seconds for the first)."""
        try:
            calls = [await asyncio.wait_for(self._queue.get(), timeout)]
        except asyncio.TimeoutError:
            return []
        while not self._queue.empty():
            calls.append(self._queue.get_nowait())
        return calls

    async def answer(self, answers: Sequence[tuple[int, bool, Any]]) -> None:
        """The owner's side: ``(call id, failed, result or exception)`` of calls it took."""
        for call, failed, value in answers:
            future = self._waiting.pop(call, None)
            if future is not None and not future.done():
                (future.set_exception if failed else future.set_result)(value)

    async def _ask(self, kind: str, payload: Any) -> Any:
        call = next(self._ids)
        future = self._waiting[call] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((call, kind, payload))
        return await future


_SERVICES: weakref.WeakKeyDictionary[Any, ProgressService] = weakref.WeakKeyDictionary()


def service_for(buffer: Any, *, eos: int | None) -> ProgressService:
    """The desk of ``buffer`` (a kvckpt ``TQReplayBuffer`` with ``progress_every_tokens`` set), started in this
    process at the first call (the process that owns the store) and stopped when the buffer closes."""
    service = _SERVICES.get(buffer)
    if service is None:
        service = _SERVICES[buffer] = ProgressService(buffer.core, every_tokens=buffer.progress_every_tokens, eos=eos)
        buffer.on_close(service.close)
    return service


def desk_name(path: str) -> str:
    """The desk's Ray name for the store at ``path``."""
    return DESK_PREFIX + hashlib.sha256(str(path).encode()).hexdigest()[:16]


class ProgressService:
    """The owner's side of the desk: the store's progress calls made by NeMo-RL's Ray workers (module docstring).

    Args:
        core: the open store (the ``TQReplayBuffer``'s ``core``), in this process.
        every_tokens: the interval the workers record at (``progress_every_tokens``).
        eos: the end-of-sequence token of the tokenizer (a prefix ending with it is complete); ``None`` for none.
        namespace: the Ray namespace of the desk. Defaults to the driver's.
    """

    def __init__(self, core: ReplayBuffer, *, every_tokens: int, eos: int | None,
                 namespace: str | None = None) -> None:
        ray = _ray()
        self.core, self.every_tokens, self.eos = core, int(every_tokens), eos
        self.name = desk_name(core.path)
        self.namespace = namespace or ray.get_runtime_context().namespace
        self.desk = ray.remote(ProgressDesk).options(name=self.name, namespace=self.namespace,
                                                     max_concurrency=1000).remote(core.config.to_dict())
        ray.get(self.desk.info.remote())
        #: calls served: step calls, messages, progress reads
        self.stats = {"step_calls": 0, "messages": 0, "reads": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvckpt-nemo-rl-progress-desk", daemon=True)
        self._thread.start()

    def settings(self) -> dict[str, Any]:
        """What a worker needs to record (the ``progress`` entry of a sequence key): the desk, the interval, EOS
        and the trainer's version now (the proxy's first version)."""
        return {"desk": self.name, "namespace": self.namespace, "every": self.every_tokens, "eos": self.eos,
                "version": int(self.core.trainer_version)}

    def close(self) -> None:
        """Stop serving (the desk is killed; a worker's call then fails) and wait for the thread."""
        self._stop.set()
        self._thread.join()
        _ray().kill(self.desk)

    def _serve(self) -> None:
        from kvckpt.integrations.ray.wire import progress_to_dict

        ray = _ray()
        while not self._stop.is_set():
            try:
                calls = ray.get(self.desk.take.remote(TAKE_WAIT_S))
            except Exception:
                return
            answers = []
            for call, kind, payload in calls:
                try:
                    if kind == "steps":
                        self.stats["step_calls"] += 1
                        self.stats["messages"] += len(payload)
                        value: Any = self.core.record_progress_steps(payload)
                    else:
                        self.stats["reads"] += 1
                        value = progress_to_dict(self.core.progress(payload))
                    answers.append((call, False, value))
                except Exception as exc:
                    answers.append((call, True, exc))
            if answers:
                self.desk.answer.remote(answers)


class DeskSink:
    """A worker's sink (what :class:`~.engine.ProgressEngine` writes to): the desk named in the key's settings,
    through kvckpt's :class:`~kvckpt.integrations.ray.BufferClient` (one call in flight, answered once durable)."""

    def __init__(self, settings: Mapping[str, Any]) -> None:
        from kvckpt.integrations.ray import BufferClient

        actor = _ray().get_actor(settings["desk"], namespace=settings["namespace"])
        self.client = BufferClient(actor, batch_groups=1, max_in_flight=1, retries=0, encode_at_edge=False)

    def progress_encoder(self) -> Any:
        """The encoder of the store's progress step messages."""
        return self.client.progress_encoder()

    def record_progress_step(self, message: Any) -> list[Any]:
        """One step message in one call, answered once durable (or refused per sequence)."""
        future = self.client.record_progress_step(message)
        self.client.flush()
        return future.result()

    def progress(self, lease: Any) -> dict[int, Any]:
        """The lease's durable prefixes."""
        return self.client.progress(lease)


def desk_sink(settings: Mapping[str, Any]) -> DeskSink:
    """The sink of a key's ``progress`` settings (:meth:`ProgressService.settings`)."""
    return DeskSink(settings)


def install_worker_class(generation_module: Any, registry: dict[str, Any]) -> None:
    """Make NeMo-RL's ``VllmGeneration`` (``generation_module``, ``vllm_generation``) build kvckpt's async worker
    class (:data:`WORKER_FQN`) where it would build its own, with NeMo-RL's Python environment for it
    (``registry``: NeMo-RL's ``ACTOR_ENVIRONMENT_REGISTRY``, its documented way to add an actor class). Idempotent."""
    resolve = generation_module.resolve_generation_worker_cls
    if getattr(resolve, "kvckpt_original", None) is not None:
        return
    if NEMO_RL_WORKER_FQN in registry:
        registry.setdefault(WORKER_FQN, registry[NEMO_RL_WORKER_FQN])

    def resolved(default_cls: str, config: Any) -> str:
        chosen = resolve(default_cls, config)
        return WORKER_FQN if chosen == NEMO_RL_WORKER_FQN else chosen

    resolved.kvckpt_original = resolve  # type: ignore[attr-defined]
    generation_module.resolve_generation_worker_cls = resolved
