"""``CkptdCheckpointIO``: Lightning's ``CheckpointIO`` over a ``Checkpointer`` (the
package docstring tells how paths map to steps and what a save guarantees)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ckptd import knobs
from ckptd.errors import (
    CheckpointNotFound,
    CkptdError,
    Conflict,
    Forbidden,
    InvalidName,
    InvalidRequest,
    Timeout,
)
from ckptd.format import RankManifest, check_job

from ...checkpointer import Checkpointer
from ...endpoint import endpoint
from ...launch import group_initialized
from ...loop import EventLoopThread, run_private
from ...reach import reach
from ...restore import RestoreOptions, restore_into
from ...save.handle import SaveHandle
from ...step_import import load_torch_save, looks_like_torch_save
from ...transport import HttpTransport, Transport, open_transport
from .arguments import check_checkpointer_kwargs, check_timeout, check_url, step_value
from .failures import QuietSaveFailures, in_lightning_terms
from .pointers import (
    LATEST,
    apply_callbacks,
    callbacks_patch,
    check_pointer,
    plain_callbacks,
    read_pointer,
    stem_of,
    tag_for_path,
    write_pointer,
)
from .rank_zero import RankZeroSaves
from .same_step import Saved
from .tags import JobTags

try:  # the unified package; the standalone one where it is all there is
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
except ImportError:  # pragma: no cover
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO  # type: ignore[assignment,unused-ignore]

__all__ = ["CkptdCheckpointIO"]

log = logging.getLogger(__name__)


class CkptdCheckpointIO(CheckpointIO):
    """Lightning's checkpoint storage through ckptd (see the module docstring).

    ``url`` and ``token`` default to ``CKPTD_URL`` and ``CKPTD_TOKEN``; ``job``
    names the run (required). ``pointers``: write the pointer files Lightning's path logic
    reads (default on). ``timeout`` bounds each load and the wait for the last save
    at teardown. Other keyword arguments go to the ``Checkpointer`` (``shm_dir``,
    ``staging_budget``, ``cache_dir``, ``serve_peers``...). ``load_only``: the plugin
    only loads (an evaluation's, with a token that may only read); it never makes a
    ``Checkpointer`` and refuses a save.

    An ``http(s)://`` server that cannot be reached (or refuses the token, or, unless
    ``load_only``, lets it only read) is said
    here, as a ``Checkpointer``'s construction says it: Lightning calls a
    ``CheckpointIO`` at no earlier point than its first save or load, which come
    after setup and, for a save, after training. Every rank builds the plugin and
    every rank needs the server (rank 0 saves, all load), so each asks it; the
    ``Checkpointer`` itself is made at the first save, once the process group says
    which rank is global rank 0.

    Lightning hands ``CheckpointIO`` the whole checkpoint on global rank 0 only
    (DDP, a single device, FSDP with a full state dict), so it is stored as a
    one-rank step of ``job``; every rank loads it back (rank 0 through its
    ``Checkpointer``, the others read it from this node's pool, the cache
    directory or the store, every chunk verified)."""

    def __init__(self, url: str | None = None, job: str = "", token: str | None = None, *,
                 pointers: bool = True, timeout: float | None = 600.0,
                 load_only: bool = False, **checkpointer_kwargs: Any) -> None:
        self.url, self.token = endpoint(url, token)
        check_url(self.url)
        if not job:
            raise InvalidName("CkptdCheckpointIO needs the run's name: pass job= (e.g. "
                              "CkptdCheckpointIO(url, job='mnist'))")
        self.job = check_job(job)
        self.pointers = pointers
        self.load_only = load_only
        self.timeout = check_timeout(timeout)
        check_checkpointer_kwargs(checkpointer_kwargs)
        self._kwargs = checkpointer_kwargs
        self._ckpt: Checkpointer | None = None
        self._tags: JobTags | None = None
        self._after: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: list[concurrent.futures.Future[None]] = []
        self._error: BaseException | None = None
        # The failures raised to the caller already (a save's Checkpointer.save can
        # raise the one our background thread then finds too): teardown only logs them.
        self._told: weakref.WeakSet[BaseException] = weakref.WeakSet()
        self._last: Saved | None = None
        self._lock = threading.Lock()
        self._counts: RankZeroSaves | None = None  # (once the group exists)
        # Paths removed before their save reached this plugin (a wrapping
        # AsyncCheckpointIO queues saves, not removals), each with the thread that
        # removed it: that save, when it comes from another thread (the wrapper's),
        # keeps neither a pointer nor a tag; one from the remover's own thread is a
        # new save. Cleared at teardown. (Touched on the background thread only.)
        self._removed_early: dict[str, int] = {}
        self._save_threads: set[int] = set()  # the threads saves came from
        self._arrived: dict[str, int] = {}  # path -> its saves whose pointer is to come
        self._said_untag = False  # a token that may not remove tags: said once
        self._counts_known = False
        self._store_id: str | None = None
        self._store_id_known = False
        self._quiet: QuietSaveFailures | None = None  # (with the Checkpointer)
        self._reach_server()

    # -- Lightning's interface ----------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        """Stages ``checkpoint`` as a step of the job and returns; the upload, commit,
        tag and pointer follow in the background."""
        if storage_options is not None:
            raise TypeError("CkptdCheckpointIO takes no storage_options; pass Checkpointer "
                            "settings to CkptdCheckpointIO(...) instead")
        self._raise_failure()
        path = os.fspath(path)
        if self.load_only:
            raise InvalidRequest(f"{path}: this CkptdCheckpointIO was built with load_only=True "
                                 "and only loads: build it without load_only to save",
                                 job=self.job, path=path)
        with self._lock:
            self._save_threads.add(threading.get_ident())
        if not self._saves_here():
            raise InvalidRequest(
                f"{path}: this strategy hands the checkpoint to a rank other than 0 (sharded "
                "state); CkptdCheckpointIO stores the whole checkpoint that global rank 0 "
                "gets: save sharded state with ckptd.client.dcp (docs/dcp.md)")
        tag = tag_for_path(path)
        step = self._step_of(checkpoint)
        last = self._last
        callbacks = plain_callbacks(checkpoint)
        if last is not None and last.step == step:
            # Lightning saves one step under several names (a top-k file and last.ckpt):
            # a step is stored once, so the next names tag it. Its tensors must hold the
            # stored bytes (a training step between would have changed them); its
            # callbacks' bookkeeping goes into its pointer (pointers.py).
            changed = last.changed(checkpoint, lambda: self._read_back(last),
                                   lambda: self._stored_manifest(last))
            if changed:
                how = "saved" if last.handle is not None else "loaded"
                raise Conflict(
                    f"{path}: step {step} of {self.job} was {how} already (as {last.path}) "
                    f"and this checkpoint's tensor {changed[0]!r} holds other bytes; a ckptd "
                    "step is stored once: save the new state under a new step",
                    job=self.job, step=step, path=path)
            self._queue(last.handle, step, path, tag, callbacks_patch(last.callbacks, callbacks))
            last.path = path
            return
        ckpt = self._checkpointer()
        if last is None or last.handle is None:  # (the run's first save)
            self._check_resumed(ckpt, step, path, last)
        try:
            handle = ckpt.save(step, checkpoint, tag=tag)
        except CkptdError as exc:  # (an earlier save's failure, surfaced here)
            self._tell(exc)
            in_lightning_terms(exc, self.job, self.url)  # (its message, in place)
            raise
        self._last = Saved.stored(step, path, handle, checkpoint, callbacks)
        self._queue(handle, step, path, None, None)

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint ``path`` names (its pointer, else its name as a tag of the
        job, or ``latest``), restored bitwise from ckptd. Nothing is unpickled, so
        ``weights_only`` is always honoured. A path holding a ``torch.save`` file
        instead is loaded with ``torch.load(weights_only=True)``; any other file is
        refused with ``InvalidRequest``."""
        self._raise_failure()
        path = os.fspath(path)
        self._wait_saves(path)
        step, patch = self._resolve(path)
        if step is None:  # an ordinary checkpoint file: a run that moves to ckptd
            return _torch_load(path, map_location)
        state: dict[str, Any] = {}
        if self._saves_here() and not self.load_only:
            self._checkpointer().restore(state, step, timeout=self.timeout)
            self._last = Saved(step, path, None, None, callbacks=plain_callbacks(state))
        else:
            self._read(state, step)
        apply_callbacks(state, patch)
        if isinstance(map_location, str | torch.device):
            state = _to_device(state, torch.device(map_location))
        return state

    def remove_checkpoint(self, path: Any) -> None:
        """Removes the pointer at ``path`` and the tag of its name (after the saves
        queued before); the step's data stays for ckptd's retention."""
        self._raise_failure()
        path = os.fspath(path)
        if self.load_only:
            raise InvalidRequest(f"{path}: this CkptdCheckpointIO was built with load_only=True "
                                 "and removes nothing", job=self.job, path=path)
        # Its save may still wait in a wrapper's queue when saves come from another
        # thread than this one (or none came yet): the removal then waits for it.
        me = threading.get_ident()
        with self._lock:
            queued = not self._save_threads or bool(self._save_threads - {me})
        self._submit(self._remove, path, me if queued else None)

    def teardown(self) -> None:
        """Waits for the saves in flight and their pointers (on another rank, for
        those rank 0 queued: ``rank_zero.py``), then closes the checkpointer; raises
        what failed in the background, unless a save or load raised it already (then
        it is logged)."""
        closing: CkptdError | None = None
        try:
            counts = None if self._saves_here() else self._rank_zero_saves()
            if counts is not None:  # (what follows fit there sees rank 0's pointers)
                counts.wait_at_teardown(self.timeout)
            for fut in list(self._pending):
                fut.result()
        finally:
            with self._lock:
                after, self._after = self._after, None
                ckpt, self._ckpt = self._ckpt, None
                tags, self._tags = self._tags, None
                quiet, self._quiet = self._quiet, None
            if quiet is not None:
                quiet.remove()
            if after is not None:
                after.shutdown(wait=True)
            if self._removed_early:  # (their saves never came: a later one is new)
                log.debug("%s: removed, never saved: %s", self.job, sorted(self._removed_early))
                self._removed_early.clear()
            if tags is not None:
                tags.close()
            if ckpt is not None:
                try:
                    ckpt.close(self.timeout)
                except CkptdError as exc:  # (raised below, after the background's)
                    closing = exc
        self._raise_failure()
        if closing is not None and self._tell(closing):
            raise in_lightning_terms(closing, self.job, self.url)

    # -- the background ---------------------------------------------------------------

    def _queue(self, handle: SaveHandle | None, step: int, path: str, tag: str | None,
               callbacks: dict[str, Any] | None) -> None:
        with self._lock:
            self._arrived[path] = self._arrived.get(path, 0) + 1
        self._submit(self._after_commit, handle, step, path, tag, callbacks,
                     threading.get_ident())

    def _submit(self, fn: Any, *args: Any) -> None:
        counts = self._rank_zero_saves()
        if counts is not None:  # (before Lightning's barrier after the save)
            counts.queued()
        with self._lock:
            if self._after is None:
                self._after = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix=f"ckptd-lightning-{self.job}")
            fut = self._after.submit(self._guarded, fn, *args)
        self._pending = [f for f in self._pending if not f.done()] + [fut]

    def _guarded(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as exc:  # (raised by the next call: said there, once)
            log.debug("%s: %s", self.job, exc)
            if self._error is None:
                self._error = exc
        finally:
            counts = self._rank_zero_saves()
            if counts is not None:
                counts.done()

    def _after_commit(self, handle: SaveHandle | None, step: int, path: str,
                      tag: str | None, callbacks: dict[str, Any] | None,
                      saved_on: int) -> None:
        """Once ``step`` committed: tags it (a second name of one step) and writes
        the pointer at ``path`` (none when ``path`` was removed before this save,
        queued on another thread, came)."""
        with self._lock:
            left = self._arrived.pop(path) - 1
            if left:
                self._arrived[path] = left
        if handle is not None:
            handle.wait(self.timeout)
        removed_on = self._removed_early.pop(path, None)
        if removed_on is not None and removed_on != saved_on:
            log.info("%s: removed before its save of step %d came (top-k, through a "
                     "wrapper that queues saves): the step is stored, with no pointer or tag "
                     "by that name", path, step)
            self._untag(path, step)
            return
        if tag is not None:
            self._job_tags().set(tag, step)
        if self.pointers:
            write_pointer(path, self.job, step, self.url, self._store(), callbacks)

    def _remove(self, path: str, queued_from: int | None) -> None:
        try:
            doc = read_pointer(path)
        except InvalidRequest as exc:  # (a damaged pointer: a load says so)
            log.warning("%s: left alone", exc.message)
            return
        if doc is None and os.path.exists(path):
            log.warning("%s is not a ckptd pointer: left alone", path)
            return
        if doc is None:  # no pointer: still to come, pointers=False, or another node's
            with self._lock:
                coming = path in self._arrived  # (a save that came after this removal)
            step = None if coming else self._job_tags().get(tag_for_path(path))
            if step is not None:
                self._untag(path, step)
            elif queued_from is not None:  # (its save came, or waits in a wrapper's queue)
                self._removed_early[path] = queued_from
            return
        if doc["job"] == self.job:
            self._untag(path, doc["step"])
        os.remove(path)

    def _untag(self, path: str, step: int) -> None:
        """Removes the tag of ``path``'s name from ``step``. A token that may not
        remove tags (that needs admin on the job) leaves it: said once, not a failure
        of the run (the tag keeps its step from retention)."""
        try:
            self._job_tags().remove(tag_for_path(path), step)
        except Forbidden as exc:
            if not self._said_untag:
                self._said_untag = True
                log.warning("%s: the tag %r of step %d stays, and keeps the step from "
                            "retention: %s; to let top-k steps go, pass CkptdCheckpointIO a "
                            "token of role admin on job %s (ckptd token create --job %s "
                            "--role admin)", path, tag_for_path(path), step, exc.message,
                            self.job, self.job)

    def _raise_failure(self) -> None:
        error, self._error = self._error, None
        if error is not None and self._tell(error):
            raise in_lightning_terms(error, self.job, self.url)

    def _tell(self, error: BaseException) -> bool:
        """Notes that ``error`` reaches the caller: False (and a log line) when it
        did already."""
        try:
            if error in self._told:
                log.info("%s: %s (raised already)", self.job, error)
                return False
            self._told.add(error)
        except TypeError:  # (an exception type without weak references: never told)
            pass
        return True

    def _wait_saves(self, path: str) -> None:
        """Waits for the saves in flight, their commits and pointers: a load after
        a save reads what it saved (as ``torch.load`` after ``torch.save``), not the
        pointer's older step, nor nothing at a new path. Their failure is raised.
        On another rank, for those rank 0 had queued (``rank_zero.py``)."""
        if not self._saves_here():
            counts = self._rank_zero_saves()
            if counts is not None:
                counts.wait(path, self.timeout)
        pending = [f for f in self._pending if not f.done()]
        if pending and concurrent.futures.wait(pending, self.timeout).not_done:
            raise Timeout(f"{path}: the saves before this load did not commit within "
                          f"{self.timeout} s; loading now would read an older checkpoint "
                          "(pass a larger timeout= to CkptdCheckpointIO)",
                          job=self.job, path=path)
        self._raise_failure()

    # -- parts ------------------------------------------------------------------------

    def _reach_server(self) -> None:
        """Raises, typed, when the ckptd server cannot be reached or refuses the
        token, within ``CKPTD_SERVER_WAIT`` seconds (``reach.py``); nothing to ask
        of a directory store."""
        if not self.url.startswith(("http://", "https://")):
            return
        within = knobs.server_wait()

        async def ask() -> str | None:
            transport = open_transport(self.url, self.token, job=self.job)
            try:
                assert isinstance(transport, HttpTransport)
                return await reach(transport, self.job, within)
            finally:
                await transport.close()

        refused = run_private(ask(), within + 3 * knobs.connect_timeout() + 10.0,
                              what=f"reaching the ckptd server at {self.url}")
        if refused is not None and not self.load_only:
            raise Forbidden(
                f"CkptdCheckpointIO: the token given may read job {self.job} but not write "
                f"it, so no checkpoint of this run could be saved: pass a token of role write "
                f"(ckptd token create --job {self.job} --role write) as token= or "
                "CKPTD_TOKEN, or load_only=True to only load", job=self.job, needs="write")

    def _rank_zero_saves(self) -> RankZeroSaves | None:
        """Rank 0's counts of this job's saves (None: nothing to count through)."""
        if not self._counts_known and group_initialized():
            self._counts, self._counts_known = RankZeroSaves.here(self.job), True
        return self._counts

    def _checkpointer(self) -> Checkpointer:
        with self._lock:
            if self._ckpt is None:
                kwargs = {"timeout": self.timeout, **self._kwargs}
                self._quiet = QuietSaveFailures(self.job)
                self._quiet.install()
                self._ckpt = Checkpointer(self.url, self.job, 0, 1, self.token, **kwargs)
            return self._ckpt

    def _check_resumed(self, ckpt: Checkpointer, step: int, path: str,
                       loaded: Saved | None) -> None:
        """The first save of a run: at a step the job committed already, after a
        run that loaded nothing or an older step than the newest, it would fail
        (``AlreadyCommitted``) only after the steps it trained, at that step or a
        later one. ``ckpt_path="last"`` finds only pointer files, and a node that
        never held them (a replacement node) finds none: Lightning then warns and
        trains from scratch. A save at the step loaded is a second name of it; one
        below it is left to its commit to refuse."""
        if loaded is not None and step <= loaded.step:
            return
        latest = ckpt.latest()
        if latest is None or step > latest:
            return
        if loaded is not None:  # (loaded.step < step <= latest)
            raise InvalidRequest(
                f"{path}: job {self.job} has committed steps up to {latest}, but this run "
                f"resumed from step {loaded.step} ({loaded.path}) and is saving step {step}: "
                "a ckptd step is stored once, so its saves would fail at the steps stored "
                "already. Resume from the newest step (ckpt_path='latest', or the "
                "checkpoint directory's last.ckpt), or give this run a new job= to go on "
                f"from step {loaded.step} apart", job=self.job, step=step, latest=latest)
        raise InvalidRequest(
            f"{path}: job {self.job} has committed steps up to {latest}, but this run "
            f"loaded none of them and is saving step {step}. With ckpt_path='last' on a "
            "node whose checkpoint directory holds no ckptd pointer file (not shared, or a "
            "replacement node), Lightning starts over: resume with ckpt_path='latest' (or "
            "the checkpoint's path: its name is looked up among the job's tags), or give "
            "this run a new job=", job=self.job, step=step, latest=latest)

    def _read_back(self, last: Saved) -> dict[str, Any]:
        """Step ``last.step`` as stored, once it committed (``same_step.py``)."""
        self._committed(last)
        stored: dict[str, Any] = {}
        self._read(stored, last.step)
        return stored

    def _stored_manifest(self, last: Saved) -> RankManifest:
        """Rank 0's manifest of step ``last.step``, once it committed: the chunk ids
        a second save's tensors are hashed against (``same_step.py``)."""
        self._committed(last)
        with self._reader() as (transport, loop):
            return loop.run(transport.read_manifest(self.job, last.step, 0), self.timeout)

    def _committed(self, last: Saved) -> None:
        """Waits for ``last``'s save to commit (its failure said in Lightning's terms)."""
        if last.handle is not None:
            try:
                last.handle.wait(self.timeout)
            except CkptdError as exc:
                self._tell(exc)
                in_lightning_terms(exc, self.job, self.url)
                raise

    def _store(self) -> str | None:
        """The id of the plugin's store (None: not known), asked once."""
        if not self._store_id_known:
            self._store_id, self._store_id_known = self._job_tags().store_id(), True
        return self._store_id

    def _job_tags(self) -> JobTags:
        with self._lock:
            if self._tags is None:
                self._tags = JobTags(self.url, self.token, self.job)
            return self._tags

    def _step_of(self, checkpoint: Mapping[str, Any]) -> int:
        for key in ("global_step", "step"):
            if key in checkpoint:
                return step_value(key, checkpoint[key])
        # Fabric with no step in its state: the step after the last one of this job.
        last = self._last.step if self._last is not None else self._checkpointer().latest()
        return 0 if last is None else last + 1

    def _resolve(self, path: str) -> tuple[int | None, dict[str, Any]]:
        """The committed step ``path`` names (None for a file that is no pointer),
        and the callbacks' values its pointer holds (``pointers.py``)."""
        doc = read_pointer(path)
        if doc is not None:
            check_pointer(path, doc, self.job, self.url, self._store())
            return int(doc["step"]), doc.get("callbacks", {})
        if os.path.isfile(path):
            return None, {}
        if Path(path).name == LATEST:  # (ckpt_path='latest': the newest step, not a tag)
            latest = self._job_tags().latest()
            if latest is not None:
                return latest, {}
        tag = tag_for_path(path)
        step = self._job_tags().get(tag)
        if step is not None:
            return step, {}
        if stem_of(path) == LATEST:
            latest = self._job_tags().latest()
            if latest is not None:
                return latest, {}
            raise CheckpointNotFound(
                f"{path}: job {self.job} has no committed checkpoint yet (a first run "
                "passes no ckpt_path)", job=self.job, path=path)
        there = (f"{path} is a directory, not a checkpoint file" if os.path.isdir(path)
                 else f"{path}: no such file")
        raise CheckpointNotFound(
            f"{there}, and job {self.job} has no tag {tag!r} (pass ckpt_path='latest' for "
            "its newest step)", job=self.job, path=path)

    def _saves_here(self) -> bool:
        """True on the rank Lightning hands saves to (global rank 0)."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank() == 0
        return int(os.environ.get("RANK", "0")) == 0

    def _read(self, state: dict[str, Any], step: int) -> None:
        """Restores rank 0's step ``step`` into ``state`` without a checkpointer of
        our own (no heartbeats, no pool): this node's pool, the cache, the store."""
        cache = self._kwargs.get("cache_dir") or os.environ.get("CKPTD_CACHE_DIR") or ""
        with self._reader() as (transport, loop):
            restore_into(
                lambda coro: loop.run(coro, self.timeout), transport, state, job=self.job,
                rank=0, world_size=1, step=step, adopt=False,
                opts=RestoreOptions(pool_root=self._kwargs.get("shm_dir"), cache_dir=cache,
                                    token=self.token),
            )

    @contextlib.contextmanager
    def _reader(self) -> Iterator[tuple[Transport, EventLoopThread]]:
        """A transport and a loop of the plugin's own reads (no checkpointer's), both
        closed after."""
        transport = open_transport(self.url, self.token, job=self.job)
        loop = EventLoopThread(f"ckptd-lightning-read-{self.job}")
        try:
            yield transport, loop
        finally:
            try:
                loop.run(transport.close(), 10.0)
            except CkptdError as exc:  # closing must not hide the read's result
                log.debug("closing the read transport: %s", exc)
            loop.stop()


def _torch_load(path: str, map_location: Any) -> dict[str, Any]:
    """The ``torch.save`` checkpoint at ``path``, loaded with ``weights_only=True``;
    ``InvalidRequest`` in one line for a file that is none (torch's unpickler said
    so only in a traceback: EOFError, KeyError 101, advice to unpickle it)."""
    if not looks_like_torch_save(Path(path)):
        raise InvalidRequest(f"{path} is neither a ckptd pointer nor a torch.save checkpoint: "
                             "pass the path of a checkpoint (or the name of a tag of the job)",
                             path=path)
    state = load_torch_save(Path(path), map_location,
                            "load it with torch.load yourself if you trust it")
    if not isinstance(state, dict):
        raise InvalidRequest(f"{path} holds a torch.save {type(state).__name__}, not a "
                             "checkpoint dict", path=path)
    return state


def _to_device(state: Any, device: torch.device) -> Any:
    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, dict):
        return {k: _to_device(v, device) for k, v in state.items()}
    if isinstance(state, list):
        return [_to_device(v, device) for v in state]
    if isinstance(state, tuple):
        return tuple(_to_device(v, device) for v in state)
    return state

