"""Verify: a job's refs, commit records and manifests read back, and every chunk
of its steps re-hashed, each bad chunk named with what it breaks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ckptd.documents import parse_stored
from ckptd.errors import (
    CheckpointNotFound,
    ChunkHashMismatch,
    ChunkNotFound,
    ManifestHashMismatch,
    ManifestNotFound,
    NotFound,
    StoreCorrupt,
    UnsupportedStoredFormat,
)
from ckptd.format import MAX_STEP, CommitRecord, check_job, commit_key
from ckptd.hashing import chunk_spans
from ckptd.lifecycle.documents import Damage, damage_key, damage_prefix
from ckptd.lifecycle.tags import read_tags
from ckptd.repository.results import VerifyReport
from ckptd.repository.timelines import Timelines


class Verification(Timelines):
    """Checks a job at rest: refs, commit records, manifests and every chunk."""

    async def verify(
        self,
        job: str,
        step: int | None = None,
        *,
        progress: Callable[[int, int], None] | None = None,
        on_bytes: Callable[[int, int], None] | None = None,
    ) -> VerifyReport:
        """Checks a job's refs, commit records and manifests, and re-hashes every
        chunk of one committed step (or of all), naming for each bad chunk the
        steps, ranks and tensors it breaks. ``progress`` gets (chunks checked,
        chunks in all), ``on_bytes`` (bytes checked, bytes in all)."""
        check_job(job)
        report = VerifyReport(job=job, steps=[])
        records: dict[int, CommitRecord] = {}
        candidates = [step] if step is not None else await self.step_numbers(job)
        for s in candidates:
            try:
                record = await self._try_read_commit(job, s)
            except StoreCorrupt as exc:
                report.bad_commits.append(exc.message)
                continue
            except UnsupportedStoredFormat as exc:  # the other steps are still checked
                report.unreadable.append(exc.message)
                continue
            if record is not None:
                records[s] = record
        named = await self._verify_refs(job, report, set(candidates))
        await self._verify_job_documents(job, report, candidates, records)
        if step is not None and step not in records and not report.bad_commits \
                and not report.unreadable and not (
                    step in named and await self.record_lost(job, step)):
            # (a step a ref names that lost its record: the refs' check said so)
            await self.read_commit(job, step)  # NotCommitted / CheckpointNotFound
        if not records and not report.bad_commits and not report.bad_refs \
                and not report.unreadable and not report.bad_manifests:
            raise CheckpointNotFound(f"job {job} has no committed checkpoint", job=job)
        report.steps = sorted(records)
        sizes: dict[str, int] = {}
        users: dict[str, list[dict[str, Any]]] = {}
        for s, record in sorted(records.items()):
            for rank in range(record.world_size):
                try:
                    manifest = await self.read_manifest(job, s, rank)
                except (ManifestHashMismatch, ManifestNotFound, StoreCorrupt) as exc:
                    report.bad_manifests.append(f"step {s} rank {rank}: {exc}")
                    continue
                except UnsupportedStoredFormat as exc:
                    report.unreadable.append(exc.message)
                    continue
                for e in manifest.entries:
                    spans = chunk_spans(e.nbytes, manifest.chunk_size)
                    for cid, (a, b) in zip(e.chunks, spans, strict=True):
                        sizes[cid] = b - a
                        used = users.setdefault(cid, [])
                        if len(used) < 50:  # enough to say what breaks
                            used.append({"step": s, "rank": rank, "tensor": e.name})
        total = len(sizes)
        report.bytes_total = sum(sizes.values())
        sem = asyncio.Semaphore(4)

        async def check(cid: str) -> None:
            async with sem:
                try:
                    data = await self.get_chunk(cid, verify=True)
                except ChunkNotFound:
                    report.missing_chunks.append(cid)
                    report.damage.append({"chunk": cid, "problem": "missing",
                                          "breaks": users[cid]})
                except ChunkHashMismatch:
                    report.bytes_checked += sizes[cid]  # (read whole, as a good one)
                    report.bad_chunks.append(cid)
                    report.damage.append({"chunk": cid, "problem": "corrupt",
                                          "breaks": users[cid]})
                except StoreCorrupt:  # its object is there but does not read (a link loop)
                    report.bad_chunks.append(cid)
                    report.damage.append({"chunk": cid, "problem": "unreadable",
                                          "breaks": users[cid]})
                else:
                    report.bytes_checked += len(data)
                report.chunks_checked += 1
                if progress is not None:
                    progress(report.chunks_checked, total)
                if on_bytes is not None:
                    on_bytes(report.bytes_checked, report.bytes_total)

        await asyncio.gather(*(check(cid) for cid in sizes))
        report.bad_chunks.sort()
        report.missing_chunks.sort()
        report.damage.sort(key=lambda d: str(d["chunk"]))
        return report

    async def _verify_refs(self, job: str, report: VerifyReport, steps: set[int]) -> set[int]:
        """Every ref of the job parses (``latest``, ``rollback``, ``timeline``,
        ``tags``), and the first three each name a step whose commit record is there
        and is the one it names. (A tag, and the timeline of a rollback that ended,
        may name a step retention removed, but not one whose manifests are there
        without its record: that record is lost.)
        Returns the steps the refs name."""
        try:
            tags = await read_tags(self.store, job)
        except StoreCorrupt as exc:
            report.bad_refs.append(exc.message)
            tags = {}
        except UnsupportedStoredFormat as exc:
            report.unreadable.append(exc.message)
            tags = {}
        for name, step in sorted(tags.items()):
            if await self.record_lost(job, step):
                report.bad_refs.append(f"tag {name} of {job} names step {step}, whose commit "
                                       f"record {commit_key(job, step)} is missing (its "
                                       "manifests are there)")
        named: list[tuple[str, int, str]] = []
        for what, read in (("latest", self._latest_ref), ("rollback", self.read_rollback),
                           ("timeline", self.timeline)):
            try:
                ref = await read(job)
            except StoreCorrupt as exc:
                report.bad_refs.append(exc.message)
                continue
            except UnsupportedStoredFormat as exc:
                report.unreadable.append(exc.message)
                continue
            if ref is not None:
                named.append((what, ref.step, ref.commit))
        for what, step, digest in named:
            try:
                record = await self._try_read_commit(job, step)
            except StoreCorrupt:
                report.bad_refs.append(f"{what} of {job} names step {step}, whose commit "
                                       "record is damaged")
                continue
            except UnsupportedStoredFormat as exc:
                if step not in steps:  # (else said once already, with the commit records)
                    report.unreadable.append(f"{what} of {job} names step {step}: "
                                             f"{exc.message}")
                continue
            if record is None:
                if what == "timeline" and not await self.record_lost(job, step):
                    continue  # (its rollback ended and retention removed the step)
                report.bad_refs.append(f"{what} of {job} names step {step}, which has no "
                                       "commit record (deleted, or never complete)")
            elif record.digest() != digest:
                report.bad_refs.append(f"{what} of {job} names a commit of step {step} "
                                       "that is not the stored one")
        return {step for _, step, _ in named} | set(tags.values())

    async def _verify_job_documents(self, job: str, report: VerifyReport, steps: list[int],
                                    records: dict[int, CommitRecord]) -> None:
        """The job's other documents that stop a flow when they do not read: the
        manifests of pending steps (a collection refuses to guess past one) and scrub's
        damage markers (a restore of latest skips the step of one it cannot read).
        A damaged one is damage; one of a newer format is said as not checked."""
        for step in steps:
            if step in records:
                continue
            try:
                if await self._try_read_commit(job, step) is not None:
                    continue  # (committed since it was listed)
            except (StoreCorrupt, UnsupportedStoredFormat):
                continue  # (said with the commit records)
            for rank in await self._ranks_present(job, step):
                try:
                    await self._read_manifest_raw(job, step, rank)
                except ManifestNotFound:
                    continue  # (retention abandoned the step meanwhile)
                except StoreCorrupt as exc:
                    report.bad_manifests.append(
                        f"step {step} rank {rank} (pending): {exc.message}; a collection "
                        f"stops on it: `ckptd forget {job} --step {step}` forgets the step")
                except UnsupportedStoredFormat as exc:
                    report.unreadable.append(exc.message)
        for name in await self.store.list_dir(damage_prefix(job)):
            stem = name.removesuffix(".json")
            if not stem.isdigit() or int(stem) >= MAX_STEP or (int(stem) not in steps):
                continue
            key = damage_key(job, int(stem))
            try:
                doc = parse_stored(Damage.parse, await self.store.get(key), key)
            except NotFound:
                continue
            except StoreCorrupt as exc:
                report.bad_refs.append(
                    f"{exc.message}; which chunks of step {stem} scrub found bad is lost "
                    f"(restores of latest skip the step while it is there); if this verify "
                    "finds no bad chunk of the step, delete the marker")
                continue
            except UnsupportedStoredFormat as exc:
                report.unreadable.append(exc.message)
                continue
            if (doc.job, doc.step) != (job, int(stem)):
                report.bad_refs.append(f"damaged document {key}: it names step {doc.step} "
                                       f"of {doc.job}")
