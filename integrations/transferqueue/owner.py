"""The single writer of a TransferQueue value store, in-process or as a Ray actor.

The store itself is kvckpt's value store (:class:`kvckpt.ValueStore`: one put batch is one durable
write transaction, a clear never destroys a newer write, a checkpoint is the core's one-file
snapshot, a load never trusts the file). It runs either inside the one process that uses
TransferQueue (``owner: process``) or as a Ray actor (:data:`ValueStoreActor`, ``owner: actor``)
that every TransferQueue client reaches by name, since LMDB allows one writer per file.

The actor runs data operations and loads one call at a time (its default concurrency group), and
checkpoints in a group of their own (:data:`CHECKPOINT_GROUP`): a checkpoint blocks puts only for
its stamp transaction, and puts keep landing while the snapshot copies.
"""

from __future__ import annotations

import ray

from kvckpt import ValueStore

#: Name of the store file inside a TransferQueue checkpoint directory.
CHECKPOINT_FILE = "kvckpt_values.kv"
#: The actor's concurrency group for :meth:`ValueStore.checkpoint` (one at a time, beside data operations).
CHECKPOINT_GROUP = "checkpoint"

#: :class:`ValueStore` as a Ray actor on the node that calls ``tq.init``: data operations and loads one
#: at a time; call ``checkpoint`` with ``.options(concurrency_group=CHECKPOINT_GROUP)`` so puts keep
#: landing while it copies.
ValueStoreActor = ray.remote(num_cpus=0, concurrency_groups={CHECKPOINT_GROUP: 1})(ValueStore)
