"""The job's timeline this rank is in: how many rollbacks the job had when the
checkpointer started or last restored (its *epoch*), stamped on every manifest
so that saves of a timeline a rollback ended are refused; and joining the
current timeline after a restore."""

from __future__ import annotations

import concurrent.futures
import logging
import threading

from ckptd.format import EPOCH_META

from .session import Session
from .transport import Transport

log = logging.getLogger("ckptd.client.checkpointer")


async def starting_epoch(transport: Transport, job: str) -> int:
    """The epoch a rank starts in: the job's, unless the job is marked for a
    rollback. Then the rank is on the current timeline only once it restored the
    rollback's step (``Timeline.join``; a restore of "latest" does); until then it
    is in the timeline the rollback ended, and its saves are refused: one that
    took the new epoch at start committed steps of the abandoned path, and its
    commit past the rollback's step ended the rollback."""
    marker, epoch = await transport.rollback_state(job)
    return epoch - 1 if marker is not None and epoch > 0 else epoch


class Timeline:
    """This rank's epoch: asked for at start, in the background, and again after a
    failed question (the server may be back); joined anew after a restore."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._epoch: int | None = None
        self._lock = threading.Lock()
        self._call = self._ask()

    def _ask(self) -> concurrent.futures.Future[int]:
        s = self.session
        return s.loop.submit(starting_epoch(s.transport, s.config.job))

    @property
    def epoch(self) -> int | None:
        """The epoch this rank saves in, or None while not known."""
        return self.current()[0]

    def current(self) -> tuple[int | None, concurrent.futures.Future[int] | None]:
        """(the epoch this rank saves in, or None and the question still out). A
        question that failed is asked again (the server may be back)."""
        s = self.session
        with self._lock:
            if self._epoch is not None:
                return self._epoch, None
            call = self._call
            if not call.done():
                return None, call
            try:
                self._epoch = call.result()
            except Exception as exc:
                log.warning("%s/%d: cannot learn the job's timeline: %s", s.config.job,
                            s.config.rank, exc)
                self._call = self._ask()
                return None, self._call
            return self._epoch, None

    def rollback_state(self) -> tuple[int | None, int] | None:
        s = self.session
        try:
            return s.loop.run(s.transport.rollback_state(s.config.job), s.timeout)
        except Exception as exc:
            log.warning("%s/%d: cannot read the job's rollback state: %s", s.config.job,
                        s.config.rank, exc)
            return None

    def step_to_restore(self, step: int | None, state: tuple[int | None, int] | None
                        ) -> int | None:
        """``step``; for latest (None) while the job is marked for a rollback, the
        rollback's step: the steps after it were abandoned."""
        if step is not None or state is None or state[0] is None:
            return step
        s = self.session
        log.info("%s/%d: the job is marked for rollback to step %d: restoring it",
                 s.config.job, s.config.rank, state[0])
        return state[0]

    def join(self, step: int, before: tuple[int | None, int] | None) -> int | None:
        """After restoring committed ``step``, this rank's saves belong to the job's
        current timeline, if that step is on it: the job is not marked for a
        rollback elsewhere, or is marked for this step, or the step was committed
        in the current timeline; and no rollback began while it restored. Otherwise
        the rank keeps its epoch, and its saves stay refused until it restores the
        rollback's step. Returns the epoch joined, or None when it did not join."""
        s = self.session
        job, rank = s.config.job, s.config.rank
        after = self.rollback_state()
        if after is None:
            return None
        marker, epoch = after
        if before is not None and before[1] != epoch:
            log.warning("%s/%d: a rollback began while step %d was restored; saves stay "
                        "refused until the rollback's step is restored", job, rank, step)
            return None
        joins = marker is None or marker == step
        if not joins:
            try:
                record = s.loop.run(s.transport.read_commit(job, step), s.timeout)
                joins = record.meta.get(EPOCH_META, 0) == epoch
            except Exception as exc:
                log.warning("%s/%d: cannot read the commit record of step %d: %s",
                            job, rank, step, exc)
        if not joins:
            log.warning("%s/%d: step %d is not on the job's current timeline (it is marked "
                        "for rollback to step %d); saves stay refused until that step is "
                        "restored", job, rank, step, marker)
            return None
        with self._lock:
            self._epoch = epoch
        return epoch
