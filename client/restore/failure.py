"""The typed error of a fetch whose chunks no source had right: ``Unavailable``
when the store could not be reached (run it again), else what is wrong with the
checkpoint's bytes, the step they belong to, and the way out."""

from __future__ import annotations

from ckptd.errors import ChunkHashMismatch, CkptdError, RestoreError, Unavailable

from .fetch import ChunkFetcher, WantedChunks
from .sources import ChunkProblem

# Tiers whose lack of a chunk says nothing of the checkpoint: a restore falls back
# from them to the store, whose answer decides.
_BESIDE_THE_STORE = frozenset({"local", "cache", "peer"})


def failure(fetcher: ChunkFetcher, wanted: WantedChunks, step: int) -> CkptdError:
    """The typed error for chunks no source had right: ``Unavailable`` when the
    store could not be reached for each of them (run it again), else what is
    wrong with the checkpoint's bytes, the step they belong to and the way out."""
    ids = sorted(fetcher.failed)
    names = sorted({n for cid in ids for n in wanted.names.get(cid, ())})
    problems = [p.to_json() for cid in ids[:20] for p in fetcher.failed[cid]]
    where = ", ".join(map(repr, names[:5])) + (" ..." if len(names) > 5 else "")
    of_step = f" of step {step}" if step >= 0 else ""

    def store_unreached(p: ChunkProblem) -> bool:
        return p in fetcher.unreached and p.tier not in _BESIDE_THE_STORE

    def unreached_only(problems: list[ChunkProblem]) -> bool:
        # (a peer that went away too is no news: the store's answer decides)
        return any(map(store_unreached, problems)) and all(
            store_unreached(p) or p.tier in _BESIDE_THE_STORE for p in problems)

    if ids and all(unreached_only(fetcher.failed[cid]) for cid in ids):
        lost = next(filter(store_unreached, fetcher.failed[ids[0]]))
        url = next((fetcher.unreached[p] for cid in ids for p in fetcher.failed[cid]
                    if store_unreached(p) and fetcher.unreached[p]), "")
        whom = f"the server {url}" if url else "the store"
        return Unavailable(
            f"lost {whom} mid-restore: {len(ids)} chunks of {where}{of_step} could not be "
            f"fetched ({lost.message}); the checkpoint is not known to be damaged: run the "
            "restore again",
            ids=ids[:100], entries=names[:50], problems=problems, step=step, url=url or None,
        )

    def corrupt_only(problems: list[ChunkProblem]) -> bool:
        seen = [p for p in problems if p.kind != "stale"]
        return bool(seen) and all(p.kind == "mismatch" for p in seen)

    corrupt = [cid for cid in ids if corrupt_only(fetcher.failed[cid])]
    if corrupt and len(corrupt) == len(ids):
        first = corrupt[0]
        actual = [p for p in fetcher.failed[first] if p.kind == "mismatch"][-1].message
        actual = actual.removeprefix("bytes hash to ")
        return ChunkHashMismatch(
            f"chunk {first} of {where}{of_step} arrived corrupt from every source (its bytes "
            f"hash to {actual}; {len(ids)} chunks in all); {_way_out(step, True)}",
            id=first, actual=actual, ids=ids[:100], entries=names[:50], problems=problems,
            step=step,
        )
    first_problems = fetcher.failed[ids[0]]
    decisive = [p for p in first_problems if p.tier not in _BESIDE_THE_STORE] or first_problems
    cause = "; ".join(_cause(p) for p in decisive) or "no source holds it"
    kinds = {p.kind for cid in ids for p in fetcher.failed[cid] if p.tier not in _BESIDE_THE_STORE}
    damaged = bool(kinds & {"mismatch", "size", "damaged"})  # (damaged: does not read)
    # The store itself lacks a chunk the committed step names, or holds it wrong:
    # damage of the checkpoint (``detail["damaged"]``, the command line's exit 1),
    # where a chunk the store could not be asked for (a server gone) says nothing of it.
    lacking = damaged or "missing" in kinds
    way_out = f"; {_way_out(step, damaged)}" if lacking else ""
    return RestoreError(
        f"{len(ids)} chunks of {where}{of_step} could not be restored from any source "
        f"(first: {ids[0]}: {cause}){way_out}",
        ids=ids[:100], entries=names[:50], problems=problems, step=step, damaged=lacking,
    )


def _cause(problem: ChunkProblem) -> str:
    """What one source's problem with a chunk was, in words."""
    what = {"mismatch": "corrupt", "size": "of the wrong size", "missing": "missing",
            "stale": "overwritten", "damaged": "damaged"}.get(problem.kind)
    if what is None:  # failed: the error says it
        return f"{problem.tier}: {problem.message}"
    return f"{problem.tier} copy {what}: {problem.message}"


def _way_out(step: int, damaged: bool) -> str:
    """What to do about a checkpoint's chunks no source has right."""
    earlier = ("use an earlier step (the command's STEP or --step S, step=S in Python; "
               "`ckptd ls JOB` lists the steps)")
    if not damaged:
        return earlier
    marked = f"step {step}" if step >= 0 else "the step"
    return (f"{earlier}, or run `ckptd scrub`: it repairs a chunk from a replica or a live "
            f"peer, else marks {marked} damaged so that a restore of latest skips it")
