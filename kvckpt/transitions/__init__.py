"""Layer 4, transitions: each state transition of the buffer as a small function over
:class:`~kvckpt.tables.access.Tables`, run by the caller inside one write transaction, plus the
:class:`~kvckpt.transitions.config.BufferConfig` they run under.

A transition function either returns its result, returns a *blocker* string (admission only:
nothing was written and the caller waits outside the transaction), or raises a
:class:`~kvckpt.errors.KvckptError` (the caller's transaction is then aborted, so a refused
transition writes nothing). None of them commits, waits or holds state: the facade
(:class:`kvckpt.buffer.ReplayBuffer`) runs one per transaction, or several in one group commit.

==================== =============================== ===================================================
transition           function                        written atomically
==================== =============================== ===================================================
``admit``            :func:`admission.admit`         ``dispatch_index`` (gated samplers), dataloader
                                                     state, one ledger entry per prompt
``advance_dispatch`` :func:`admission.advance`       ``dispatch_index`` (gated samplers), dataloader state
``commit_*``         :func:`commit.commit`           rows, group ready with ``end_weight``, ledger entry
                                                     deleted (or one row and the entry's progress);
                                                     the rows' token progress checked and deleted
``record_progress``  :func:`progress.record`         one chunk of a sample's token progress appended
``select``           :func:`training.select`         chosen ready groups -> claimed by the current step
``claim``            :func:`training.claim`          the named ready groups -> claimed (all or none)
``release_claims``   :func:`training.release`        the named claims of the current step -> ready
``finish_step``      :func:`training.finish_step`    claimed -> consumed, ``trainer_version`` + 1, rows
                                                     of checkpointed steps dropped
``evict``            :func:`training.evict`          out-of-window ready groups -> evicted, rows deleted
``promote``          :func:`training.promote`        one ready group re-stamped onto an earlier step
``redispatch``       :func:`inflight.redispatch`     one ledger entry's ``attempt`` + 1 (and ``start_weight``)
``abort``            :func:`inflight.abort`          ledger entries -> aborted tombstones (rows and token
                                                     progress deleted), shortfall credited
``recover``          :mod:`kvckpt.durability`        (a durability transition: it verifies first)
==================== =============================== ===================================================
"""
