"""``ckptd restore --to DIR``: one rank's chunks of a committed step, fetched
through the same tiers and verification into a local directory store, whose
documents only the repository writes (``Repository.import_step``)."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ckptd import knobs
from ckptd.errors import InvalidRequest, StoreError
from ckptd.format import check_job, check_rank
from ckptd.hashing import chunk_spans

from ..loop import bounded, run_private
from ..transport import open_transport
from .failure import failure
from .fetch import ChunkFetcher, WantedChunks
from .plan import fallback_problems, load_plan
from .restorer import RestoreOptions, make_sources
from .sources import ChunkProblem, PeerSource


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    """What ``restore_command`` put into its directory."""

    job: str
    rank: int
    step: int
    directory: str
    chunks: int
    bytes: int
    seconds: float
    bytes_from: dict[str, int]
    problems: list[ChunkProblem]


def restore_command(
    url: str,
    job: str,
    rank: int,
    to: str | os.PathLike[str],
    *,
    step: int | None = None,
    token: str | None = None,
    local: bool = True,
    peers: bool = True,
    progress: bool = True,
    console: Any | None = None,
    timeout: float | None = None,
) -> PrefetchResult:
    """``ckptd restore --job J --rank R [--step S] --to DIR``: fetches every chunk of
    rank ``rank``'s manifest of a committed step (the latest by default) from this
    host's staging pool, peers or the store, verifies each, and writes it into
    the local directory store ``DIR`` with the manifest, the commit record and a
    ``latest`` ref, so that a restore can use ``DIR`` as its cache tier
    (``cache_dir=DIR`` beside the server's URL; ``file://DIR`` alone only for a job
    of one rank: the other ranks' manifests are not there, and the step reads as
    damaged without them). Chunks already in ``DIR``
    are verified and kept. A rich progress bar shows bytes as they arrive."""
    check_job(job)
    rank = int(rank)
    if rank < 0:
        raise InvalidRequest(f"rank {rank} is negative")
    root = _directory(to)
    existed = root.exists()
    try:
        return run_private(_prefetch(url, token, job, rank, root, step, local, peers, progress,
                                     console), timeout, what="ckptd restore --to",
                           name="ckptd-restore")
    except BaseException:
        if not existed:  # (a failed restore leaves no empty store behind)
            _remove_empty(root)
        raise


def _directory(to: str | os.PathLike[str]) -> Path:
    """``--to`` as a directory: a path, or ``file:///path`` (what ``--url`` takes);
    ``InvalidRequest`` for another URL (it was a directory named ``http:`` here)."""
    text = os.fspath(to)
    if "://" not in text:
        return Path(text)
    parsed = urlparse(text)
    if parsed.scheme == "file" and parsed.netloc in ("", "localhost") and parsed.path:
        return Path(parsed.path)
    raise InvalidRequest(f"--to takes a local directory (a path, or file:///path), not "
                         f"{text!r}")


def _remove_empty(root: Path) -> None:
    """Removes ``root`` and the directories under it while they hold no file."""
    for here, _, _ in os.walk(root, topdown=False):
        with contextlib.suppress(OSError):
            os.rmdir(here)


async def _prefetch(
    url: str, token: str | None, job: str, rank: int, root: Path, step: int | None,
    local: bool, peers: bool, show: bool, console: Any | None,
) -> PrefetchResult:
    from ckptd.repository import Repository
    from ckptd.store.local import LocalStore

    t0 = time.perf_counter()
    transport = open_transport(url, token, job=job, create=False)  # (reads it)
    # Only the repository writes a store (in the documented order); fsync off: a
    # prefetched cache is rebuilt, not recovered, after a crash.
    target = Repository(LocalStore(root, fsync=False))
    try:
        # (The server's plan also carries the object store's presigned URLs.)
        plan = await load_plan(transport, job, rank, step,
                               with_peers=peers or knobs.direct_reads())
        check_rank(rank, plan.world_size, job=job)
        manifest = plan.manifest
        sizes: dict[str, int] = {}
        for e in manifest.entries:
            for cid, (a, b) in zip(e.chunks, chunk_spans(e.nbytes, manifest.chunk_size),
                                   strict=True):
                sizes.setdefault(cid, b - a)
        opts = RestoreOptions(local=local, peers=peers, token=token, cache_dir=root)
        entries = [(e, manifest.chunk_size) for e in manifest.entries]
        sources, pool = make_sources(transport, plan, entries, opts, rank)
        fetcher = ChunkFetcher(sources)
        total = sum(sizes.values())
        bar, task = _progress(show, console, f"{job} step {plan.step} rank {rank}", total)
        done = {"bytes": 0}

        async def one(cid: str) -> None:
            buf = bytearray(sizes[cid])
            tier = await fetcher.fetch(cid, memoryview(buf))
            if tier is not None and tier != "cache":
                try:
                    await target.put_chunk(cid, memoryview(buf), digest=cid)  # verified
                except StoreError as exc:  # DIR's own: a full disk, a quota, ulimit -f
                    raise type(exc)(f"cannot write into {root}: {exc.message}; free space "
                                    "there or restore elsewhere", **exc.detail) from None
            if tier is None:
                return  # (the bar counts verified bytes only: it never ends full on a failure)
            done["bytes"] += sizes[cid]
            if bar is not None:
                bar.update(task, completed=done["bytes"])

        try:
            if bar is not None:
                bar.start()
            await bounded(sizes, one, fetcher.concurrency)
        finally:
            if bar is not None:
                if fetcher.failed:
                    bar.update(task, description=f"{job} step {plan.step} rank {rank} "
                               f"[red]failed[/]: {len(fetcher.failed)} chunks")
                bar.stop()
            for s in sources:
                s.close()
                if isinstance(s, PeerSource):
                    s.client.close()
        if fetcher.failed:
            wanted = WantedChunks()
            for e in manifest.entries:
                for cid in e.chunks:
                    wanted.names.setdefault(cid, set()).add(e.name)
            raise failure(fetcher, wanted, plan.step)
        # The documents, as committed: the manifest, the commit record, the ref.
        await target.import_step(plan.record, [manifest])
        return PrefetchResult(
            job=job, rank=rank, step=plan.step, directory=str(root), chunks=len(sizes),
            bytes=total, seconds=time.perf_counter() - t0,
            bytes_from=dict(fetcher.bytes_from),
            problems=[*fallback_problems(plan), *fetcher.problems],
        )
    finally:
        await transport.close()
        await target.close()


def _progress(show: bool, console: Any | None, label: str, total: int) -> tuple[Any, Any]:
    if not show:
        return None, None
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    kwargs = {"console": console} if console is not None else {}
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
                   TransferSpeedColumn(), TimeRemainingColumn(), **kwargs)
    task = bar.add_task(label, total=total)
    return bar, task
