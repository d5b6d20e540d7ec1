"""The fetch engine: each wanted chunk from the first source whose bytes verify,
in place or landed in fresh memory, then delivered to its destinations."""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ckptd import knobs
from ckptd.errors import (
    ChunkHashMismatch,
    ChunkNotFound,
    ChunkSizeMismatch,
    CkptdError,
    StoreCorrupt,
)
from ckptd.knobs import MiB

from ..loop import bounded, in_thread, spread
from .devices import LANES, DeviceOrder, from_scratch, to_devices
from .memory import Landing, Prefault, Span, span_of
from .sources import ChunkProblem, ProblemKind, Source, copy_and_hash, copy_bytes, verify_hash

log = logging.getLogger(__name__)

COPY_PIECE_MIN = 16 * MiB  # delivery cuts its merged copies no smaller than this


class ChunkFetcher:
    """Finds each chunk in the first source whose bytes verify: in place for
    in-place sources (the pool, the cache), else fetched into a landing buffer."""

    def __init__(self, sources: Sequence[Source], concurrency: int | None = None) -> None:
        self.sources = list(sources)
        self.concurrency = concurrency or knobs.restore_concurrency()
        self.bytes_from: dict[str, int] = {s.tier: 0 for s in self.sources}
        self.problems: list[ChunkProblem] = []
        self.failed: dict[str, list[ChunkProblem]] = {}
        # problems that were a source not reached (refused, reset, timed out) -> the
        # URL it had, or "": a restore that failed only so says so (``failure``)
        self.unreached: dict[ChunkProblem, str] = {}
        self.tier_of: dict[str, str] = {}  # chunk id -> tier it came from
        self.holder_of: dict[str, str] = {}
        self.source_of: dict[str, Source] = {}
        self.landed_in_target = False
        # chunk id -> the destination it was copied to and verified in (this batch's:
        # ``locate_all`` starts each batch without the last one's)
        self.prefilled: dict[str, memoryview] = {}
        # chunk ids already in their device tensor, hashed as they were sent
        # (``atomic=False``: ``_send_mapped``); delivery leaves them alone
        self.sent: set[str] = set()
        # chunk id -> device memory beside the target it was sent to and verified in
        # (atomic, ``_send_mapped``); delivery copies it into the target
        self.on_device: dict[str, torch.Tensor] = {}
        self.prefault: Prefault | None = None

    async def locate(
        self, cid: str, size: int, land: Callable[[], memoryview],
        fill: memoryview | None = None, fill_in_target: bool = False,
        tried: _Tried | None = None,
    ) -> memoryview | None:
        """Verified bytes of chunk ``cid`` (a view where an in-place source holds
        them, or ``land()`` filled by a fetch), or None when no source had them
        right; every failed try is recorded. ``fill``: copy what an in-place source
        holds into it and hash it there, in one pass (``prefilled`` records it;
        ``fill_in_target``: it is the target's memory, which is then touched
        whatever the hash says). ``tried``: a holder that failed already (not
        asked again) and the problems recorded so far."""
        mine: list[ChunkProblem] = list(tried.problems) if tried is not None else []
        for source in self.sources:
            for holder in list(source.holders(cid)):
                if tried is not None and source is tried.source and holder == tried.holder:
                    continue
                problem: ChunkProblem | None = None
                data: memoryview | None = None
                hashed: str | None = None
                try:
                    if source.in_place:
                        data = await source.view(holder, cid)
                        if len(data) != size:
                            raise ChunkSizeMismatch(f"{holder} holds {len(data)} bytes, the "
                                                    f"chunk has {size}", id=cid)
                        if fill is not None:
                            self.landed_in_target = self.landed_in_target or fill_in_target
                            hashed = await in_thread(copy_and_hash, fill, data)
                    else:
                        data = land()
                        hashed = await source.fetch_into(holder, cid, data)
                except ChunkNotFound as exc:
                    problem = ChunkProblem(cid, source.tier, holder, "missing", str(exc))
                except ChunkSizeMismatch as exc:
                    problem = ChunkProblem(cid, source.tier, holder, "size", str(exc))
                except ChunkHashMismatch as exc:  # a source that checks and says so
                    actual = exc.detail.get("actual")
                    problem = ChunkProblem(cid, source.tier, holder, "mismatch",
                                           f"bytes hash to {actual}" if actual else str(exc))
                except StoreCorrupt as exc:  # its copy is there but does not read
                    problem = ChunkProblem(cid, source.tier, holder, "damaged", str(exc))
                except (CkptdError, OSError) as exc:
                    reason = exc.detail.get("reason") if isinstance(exc, CkptdError) else None
                    text = f"{type(exc).__name__}: {exc}" + (f" ({reason})" if reason else "")
                    problem = ChunkProblem(cid, source.tier, holder, "failed", text)
                    if isinstance(exc, ConnectionError | TimeoutError):  # (Unavailable, Timeout)
                        url = exc.detail.get("url") if isinstance(exc, CkptdError) else None
                        self.unreached[problem] = url if isinstance(url, str) else ""
                else:
                    assert data is not None
                    actual = hashed or await in_thread(verify_hash, data)
                    if actual != cid:
                        kind: ProblemKind = "stale" if source.tier == "local" else "mismatch"
                        problem = ChunkProblem(cid, source.tier, holder, kind,
                                               f"bytes hash to {actual}")
                source.outcome(holder, problem)
                if problem is None:
                    assert data is not None
                    self._took(cid, source, holder, size, fill)
                    self.problems.extend(mine)
                    return data
                if problem.kind != "missing" or source.tier in ("peer", "store"):
                    mine.append(problem)
        self.problems.extend(mine)
        self.failed[cid] = mine
        return None

    def _took(self, cid: str, source: Source, holder: str, size: int,
              fill: memoryview | None) -> None:
        """Records that ``holder`` of ``source`` gave chunk ``cid`` right."""
        if fill is not None and source.in_place:
            self.prefilled[cid] = fill
        self.bytes_from[source.tier] = self.bytes_from.get(source.tier, 0) + size
        self.tier_of[cid] = source.tier
        self.holder_of[cid] = holder
        self.source_of[cid] = source

    def _mapped_first(self, wanted: WantedChunks, atomic: bool) -> list[_InPlace]:
        """The chunks whose first holder (in tier order) holds them mapped already,
        the right size: what ``locate_all`` hashes in batches."""
        out: list[_InPlace] = []
        # Only the sources in front that may map bytes are asked (a cache's holders
        # cost a stat each).
        front = list(itertools.takewhile(_maps_bytes, self.sources))
        if not front:
            return out
        for pos, (cid, dests) in enumerate(wanted.chunks.items()):
            for source in front:
                holders = source.holders(cid)
                if not holders:
                    continue
                data = source.mapped(holders[0])
                if data is not None and len(data) == wanted.size(cid):
                    fill = dests[0] if dests and not atomic else None
                    out.append(_InPlace(cid, pos, source, holders[0], data,
                                        fill[0] if fill else None, bool(fill and fill[1])))
                break
        return out

    async def _hash_mapped(self, items: Sequence[_InPlace], reached: list[int],
                           found: dict[str, memoryview]) -> dict[str, _Tried]:
        """Hashes ``items`` where they lie (not atomic: copied into their first
        destination and hashed there) on one worker thread per core, each taking
        the next chunk itself; records those that verify in ``found``. Returns the
        others with their problem, for ``locate`` to take from other holders."""
        if any(item.fill_in_target for item in items):
            self.landed_in_target = True  # (touched whatever the hashes say)

        def check(item: _InPlace) -> str | CkptdError | OSError:
            reached[0] = max(reached[0], item.position + 1)
            try:
                if item.fill is not None:
                    return copy_and_hash(item.fill, item.data)
                return verify_hash(item.data)
            except (CkptdError, OSError) as exc:  # as ``locate`` treats them
                return exc

        workers = max(1, min(self.concurrency, os.cpu_count() or 1))
        outcomes = await spread(items, check, workers)
        again: dict[str, _Tried] = {}
        for item, actual in zip(items, outcomes, strict=True):
            source, holder, cid = item.source, item.holder, item.cid
            problem: ChunkProblem | None = None
            if isinstance(actual, BaseException):
                reason = actual.detail.get("reason") if isinstance(actual, CkptdError) else None
                text = f"{type(actual).__name__}: {actual}" + (f" ({reason})" if reason else "")
                problem = ChunkProblem(cid, source.tier, holder, "failed", text)
            elif actual != cid:
                kind: ProblemKind = "stale" if source.tier == "local" else "mismatch"
                problem = ChunkProblem(cid, source.tier, holder, kind, f"bytes hash to {actual}")
            source.outcome(holder, problem)
            if problem is None:
                self._took(cid, source, holder, len(item.data), item.fill)
                keep_fill = item.fill is not None and source.tier != "local"
                found[cid] = item.fill if keep_fill and item.fill is not None else item.data
            else:
                again[cid] = _Tried(source, holder, (problem,))
        return again

    async def _send_mapped(self, items: Sequence[_InPlace], wanted: WantedChunks,
                           reached: list[int], found: dict[str, memoryview],
                           scratch: Mapping[torch.device, torch.Tensor] | None = None,
                           ) -> dict[str, _Tried]:
        """Sends ``items`` (chunks whose one destination is a slice of a device
        tensor) to the device where they lie, and hashes each from the bounce buffer
        the device read it from: one pass over the host bytes instead of a hash
        where they lie and a copy later (``devices.copy_to_device``). Not atomic
        (no ``scratch``): into their slices of the target. Atomic: into
        ``scratch``, device memory beside the target, one run of it per device,
        cut in the items' order; ``on_device`` records them for delivery to copy
        into the target. Those that verify are recorded in ``found`` (and ``sent``
        or ``on_device``); the others are returned with their problem, for
        ``locate`` to take from other holders (a slice of the target they reached
        is written again then)."""
        if not scratch:
            self.landed_in_target = True  # (touched whatever the hashes say)
        reached[0] = max(reached[0], max(item.position for item in items) + 1)
        jobs = {item.cid: item.data for item in items}
        into: dict[str, list[torch.Tensor]] = {}
        used: dict[torch.device, int] = {}
        for item in items:
            slice_ = wanted.devices[item.cid][0]
            if scratch:
                at, n = used.get(slice_.device, 0), len(item.data)
                used[slice_.device] = at + n
                slice_ = scratch[slice_.device][at : at + n]
            into[item.cid] = [slice_]
        digests = await in_thread(to_devices, jobs, into, wanted.device_order, None, True)
        again: dict[str, _Tried] = {}
        for item in items:
            source, holder, cid = item.source, item.holder, item.cid
            actual = digests[cid]
            problem: ChunkProblem | None = None
            if actual != cid:
                kind: ProblemKind = "stale" if source.tier == "local" else "mismatch"
                problem = ChunkProblem(cid, source.tier, holder, kind, f"bytes hash to {actual}")
            source.outcome(holder, problem)
            if problem is None:
                self._took(cid, source, holder, len(item.data), None)
                found[cid] = item.data
                if scratch:
                    self.on_device[cid] = into[cid][0]
                else:
                    self.sent.add(cid)
            else:
                again[cid] = _Tried(source, holder, (problem,))
        return again

    async def fetch(self, cid: str, dest: memoryview) -> str | None:
        """Fills ``dest`` with verified chunk ``cid``; the tier it came from, or None.
        What an in-place source holds is copied into ``dest`` and hashed there: the
        bytes verified are the bytes ``dest`` holds (a live pool may change between
        a hash where they lie and a copy)."""
        data = await self.locate(cid, len(dest), lambda: dest, fill=dest)
        if data is None:
            return None
        copied = self.prefilled.pop(cid, None) is not None
        if not copied and (data.obj is not dest.obj or _address(data) != _address(dest)):
            await in_thread(copy_bytes, dest, data)
        return self.tier_of[cid]

    async def locate_all(self, wanted: WantedChunks, atomic: bool = True) -> dict[str, memoryview]:
        """Verified bytes of every wanted chunk (failures are left in ``failed``).

        ``atomic``: nothing is written into the target; a chunk fetched over the
        network lands in a fresh buffer it fills anyway, or in landing memory.
        Otherwise it lands in its first destination, the target's own tensor
        included (``landed_in_target`` records that)."""
        self.stop_prefault()  # (a fetcher that locates batches: the last one's)
        # What the last batch copied into its destinations is no source for this one:
        # those are the caller's again (a DCP planner post-processes them, training
        # changes them), and holding them would keep every batch's memory alive.
        self.prefilled.clear()
        self.sent.clear()
        self.on_device.clear()
        in_place = [s for s in self.sources if s.in_place]
        held = {cid for cid in wanted.chunks if any(s.holders(cid) for s in in_place)}
        landing = Landing(expect=sum(
            wanted.size(cid) for cid, dests in wanted.chunks.items()
            if atomic and cid not in held and all(in_target for _, in_target in dests)))
        reached = [0]
        first, then = _fresh_spans(wanted, atomic, held, landing)
        self.prefault = Prefault.start(first, then, lambda: reached[0], [wanted, landing])
        found: dict[str, memoryview] = {}
        try:
            mapped = self._mapped_first(wanted, atomic)
            sendable = [m for m in mapped if _one_device_slice(wanted, m.cid)]
            scratch: dict[torch.device, torch.Tensor] = {}
            if atomic and sendable:
                scratch = _scratch_for(sendable, wanted)
                sendable = [m for m in sendable if wanted.devices[m.cid][0].device in scratch]
            elif not knobs.h2d_one_pass():
                sendable = []
            if sendable:
                chosen = {m.cid for m in sendable}
                mapped = [m for m in mapped if m.cid not in chosen]
            again = await self._hash_mapped(mapped, reached, found) if mapped else {}
            if sendable:
                again.update(await self._send_mapped(sendable, wanted, reached, found,
                                                     scratch))
        except BaseException:
            self.stop_prefault()
            raise

        async def one(cid: str) -> None:
            reached[0] += 1
            dests = wanted.chunks[cid]
            size = wanted.size(cid)
            spot: list[memoryview] = []

            def land() -> memoryview:
                if not spot:
                    fresh = next((d for d, in_target in dests if not in_target), None)
                    if fresh is None and not atomic and dests:
                        fresh = dests[0][0]
                        self.landed_in_target = True
                    spot.append(fresh if fresh is not None else landing.take(size))
                return spot[0]

            # Not atomic: an in-place source's bytes are copied into the first
            # destination and hashed there, one pass (a network chunk lands there).
            first = dests[0] if dests and not atomic else None
            data = await self.locate(cid, size, land, first[0] if first else None,
                                     first is not None and first[1], again.get(cid))
            if data is None:
                return
            source = self.source_of[cid]
            if first is not None and source.in_place and source.tier != "local":
                data = first[0]  # (the pool's views are kept: an adopted pool serves them)
            found[cid] = data

        try:
            await bounded([cid for cid in wanted.chunks if cid not in found], one,
                          self.concurrency)
        except BaseException:
            self.stop_prefault()
            raise
        if self.failed:
            self.stop_prefault()
        return found

    def stop_prefault(self) -> None:
        """Stops faulting in fresh memory ahead (a restore that ends; what was
        faulted in stays valid). Left alone, the worker ends when it is done."""
        if self.prefault is not None:
            self.prefault.stop()
            self.prefault = None

    def close(self) -> None:
        self.stop_prefault()
        for s in self.sources:
            s.close()


def _one_device_slice(wanted: WantedChunks, cid: str) -> bool:
    """Whether chunk ``cid`` fills one slice of a device tensor copied through lanes
    (a CUDA tensor) and nothing else."""
    slices = wanted.devices.get(cid, ())
    return not wanted.chunks.get(cid) and len(slices) == 1 and slices[0].device.type in LANES


def _scratch_for(items: Sequence[_InPlace], wanted: WantedChunks
                 ) -> dict[torch.device, torch.Tensor]:
    """Device memory for an atomic restore to send ``items`` into, per device whose
    bytes fit (``knobs.h2d_scratch``); none where they do not."""
    setting = knobs.h2d_scratch()
    need: dict[torch.device, int] = {}
    for item in items:
        device = wanted.devices[item.cid][0].device
        need[device] = need.get(device, 0) + len(item.data)
    out: dict[torch.device, torch.Tensor] = {}
    for device, n in need.items():
        if setting == "0" or (setting == "auto" and not _room_on(device, n)):
            continue
        try:
            scratch = torch.empty(n, dtype=torch.uint8, device=device)
        except (RuntimeError, MemoryError) as exc:  # (torch.OutOfMemoryError is one)
            log.info("restore: no room for %d bytes beside the target on %s (%s); "
                     "verifying first, then sending", n, device, exc)
            continue
        if device.type == "cuda":
            # Allocated on this thread's stream, written on the lanes': a block that
            # work still queued here reads must be free before they write. (Outside
            # the allocation's try: an earlier device error surfaces here, and is no
            # lack of room.)
            torch.cuda.current_stream(device).synchronize()
        out[device] = scratch
    return out


def _room_on(device: torch.device, nbytes: int) -> bool:
    """Whether CUDA ``device`` has ``nbytes`` free, and a tenth of it (or 1 GiB,
    the less) to spare besides."""
    if device.type != "cuda":
        return False
    free, total = torch.cuda.mem_get_info(device)
    return free - nbytes >= min(total // 10, 1 << 30)


def _maps_bytes(source: Source) -> bool:
    """Whether ``source`` may hold chunks mapped already (``Source.mapped``)."""
    return source.in_place and type(source).mapped is not Source.mapped


@dataclass(frozen=True, slots=True)
class _InPlace:
    """A chunk that its first holder holds mapped: hashed in a batch."""

    cid: str
    position: int  # in the wanted order (what a ``Prefault`` counts)
    source: Source
    holder: str
    data: memoryview
    fill: memoryview | None  # not atomic: copied there and hashed there
    fill_in_target: bool


@dataclass(frozen=True, slots=True)
class _Tried:
    """A holder that did not give a chunk right, and the problems so far."""

    source: Source
    holder: str
    problems: tuple[ChunkProblem, ...]


def _fresh_spans(wanted: WantedChunks, atomic: bool, held: set[str], landing: Landing
                 ) -> tuple[list[Span], list[Span]]:
    """Where ``locate_all`` will land each chunk in fresh memory, in the order it
    fetches them ((0, 0) for one that lands in none: it is held in place, or lands
    in the target), and the fresh memory that delivery fills afterwards: the
    plan of a ``Prefault``. ``held``: the chunks an in-place source holds."""
    first: list[Span] = []
    then: list[Span] = []
    ahead = landing.ahead()
    base, room = span_of(ahead) if ahead is not None else (0, 0)
    used = 0
    for cid, dests in wanted.chunks.items():
        size = wanted.size(cid)
        fresh = [d for d, in_target in dests if not in_target]
        spot: Span = (0, 0)
        if not atomic and dests:
            if not dests[0][1]:
                spot = span_of(dests[0][0])
                fresh = fresh[1:]
        elif cid not in held and fresh:
            spot = span_of(fresh[0])
            fresh = fresh[1:]
        elif cid not in held and atomic and used + size <= room:
            spot = (base + used, size)
            used += size
        first.append(spot)
        then.extend(span_of(d) for d in fresh)
    return first, then


def _address(view: memoryview) -> int:
    """Where a writable or read-only buffer's bytes start (to tell if two views
    are the same memory)."""
    return span_of(view)[0]


async def deliver(
    found: Mapping[str, memoryview], wanted: WantedChunks, concurrency: int | None = None,
    prefilled: Mapping[str, memoryview] | None = None,
    sent: frozenset[str] | set[str] = frozenset(),
    on_device: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Copies every verified chunk to each of its destinations (the target's own
    tensors where they fit, on the host or a device), then the slices of elastic
    boxes; ``concurrency`` host copies at once (by default one per core, up to 8:
    more only fight over memory bandwidth). A chunk in ``prefilled`` was copied
    into one destination and verified there: the others are copied from that
    copy, not from where it lies (a live pool may have changed since). A chunk in
    ``sent`` is in its device slice already, verified as it was sent; one in
    ``on_device`` was sent and verified into device memory beside the target, and
    is copied from there (device to device)."""
    concurrency = concurrency or max(2, min(8, os.cpu_count() or 1))
    spans: list[tuple[int, int, int]] = []  # (destination, source, length): addresses
    prefilled = prefilled or {}
    sources = {cid: prefilled.get(cid, data) for cid, data in found.items()}
    for cid, dests in wanted.chunks.items():
        source = sources[cid]
        here = _address(source)
        done = {here} if source is found[cid] else {here, _address(found[cid])}
        for dest, _ in dests:
            there = _address(dest)
            if len(dest) and there not in done:
                spans.append((there, here, len(dest)))

    # ``sources`` and ``wanted`` keep every view alive until the copies are done.
    await spread(copy_runs(spans, concurrency), _memmove, concurrency)
    on_device = on_device or {}
    devices = {cid: d for cid, d in wanted.devices.items()
               if cid not in sent and cid not in on_device}
    if devices:
        await in_thread(to_devices, sources, devices, wanted.device_order)
    if on_device:
        await in_thread(from_scratch, on_device, wanted.devices, wanted.device_order)
    with torch.no_grad():
        for dst, src in wanted.copies:
            dst.copy_(src)


def _memmove(run: tuple[int, int, int]) -> None:
    ctypes.memmove(*run)  # (ctypes lets the GIL go during the call)


def copy_runs(spans: Iterable[tuple[int, int, int]], parts: int
              ) -> list[tuple[int, int, int]]:
    """The copies (destination, source, length) to make for ``spans``: a chunk that
    follows its neighbour both in the target and where it lies (a tensor's chunks
    in the pool or a landing block) joins it into one copy, since large copies run
    faster (memcpy streams them past the cache); then runs are cut so that
    ``parts`` threads share the bytes."""
    runs: list[list[int]] = []
    for d, s, n in sorted(spans):
        last = runs[-1] if runs else None
        if last is not None and last[0] + last[2] == d and last[1] + last[2] == s:
            last[2] += n
        else:
            runs.append([d, s, n])
    total = sum(r[2] for r in runs)
    piece = max(COPY_PIECE_MIN, -(-total // max(1, parts)))
    out: list[tuple[int, int, int]] = []
    for d, s, n in runs:
        for off in range(0, n, piece):
            out.append((d + off, s + off, min(piece, n - off)))
    return out


@dataclass(slots=True)
class WantedChunks:
    """Chunk id -> the buffers it fills, and the slice copies to make afterwards."""

    # chunk id -> (destination, whether it is the target's own memory)
    chunks: dict[str, list[tuple[memoryview, bool]]] = field(default_factory=dict)
    names: dict[str, set[str]] = field(default_factory=dict)  # chunk id -> entry names
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # dst, src
    elastic: bool = False
    # chunk id -> uint8 slices of the target's own device tensors (filled by
    # ``to_devices`` from the verified host bytes; never before every chunk verified)
    devices: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    device_order: DeviceOrder | None = None  # taken on the caller's thread
    sizes: dict[str, int] = field(default_factory=dict)

    def add(self, cid: str, dest: memoryview, name: str, in_target: bool = False) -> None:
        self.chunks.setdefault(cid, []).append((dest, in_target))
        self.names.setdefault(cid, set()).add(name)
        self.sizes.setdefault(cid, len(dest))

    def add_device(self, cid: str, dest: torch.Tensor, name: str) -> None:
        """A slice of a device tensor that chunk ``cid`` fills (its bytes, as uint8)."""
        self.chunks.setdefault(cid, [])
        self.devices.setdefault(cid, []).append(dest)
        self.names.setdefault(cid, set()).add(name)
        self.sizes.setdefault(cid, dest.numel())

    def size(self, cid: str) -> int:
        return self.sizes[cid]
