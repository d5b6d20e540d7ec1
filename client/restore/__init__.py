"""Tiered, verified, elastic restore.

A restore takes each chunk of the committed state from the first source that has
it right, in tier order:

``local``
    this rank's staging pool in shared memory, left by the process that died (or
    held by this one): ``StagingPool.open_existing``. Its index is only a hint: a
    pool that a crash left half overwritten still gives its unchanged chunks, and
    only those.
``cache``
    a local directory store (``cache_dir``, ``CKPTD_CACHE_DIR``), e.g. what
    ``ckptd restore --to DIR`` fetched ahead of time in an init container.
``peer``
    live peers holding the step in their pools, from the server's restore plan,
    spread across them and fetched in parallel (``PeerClient``).
``store``
    the repository, through the checkpointer's transport; when that is a directory
    on this host (``file://``), its chunk files are mapped and hashed in place.

Every chunk is hashed and compared with its id before it is used; a source that
fails, lacks the chunk or has other bytes is recorded as a ``ChunkProblem`` and the
next one is tried (a peer that sent bad bytes or went away is not asked again
during that restore). The result is bitwise the committed state, or
``RestoreError`` / ``ChunkHashMismatch`` naming the entries and chunk ids that no
source had right. ``RestoreResult.bytes_from`` says how many bytes each tier gave.

Two phases. First every chunk is verified somewhere: the in-place tiers (pool,
cache) are hashed where they lie, without a copy; chunks from peers or the store
land in fresh memory (an assembly buffer they fill anyway, else landing memory,
faulted in ahead of them by a worker thread).
Then, only when all verified, they are copied into
place: straight into the target's own tensors where those fit (contiguous CPU
tensors of the right dtype and shape), so a restore into a constructed model
allocates nothing for it. A failed restore leaves the target as it was.
``atomic=False`` lets chunks from peers and the store land in the target as they
verify: no landing memory and no second copy, but a restore that fails then leaves
the target partly restored (the error's ``partial`` detail says so). A live pool that a stage
overwrites during a restore (the seqlock generation changed) is not trusted: what
it gave is verified again or taken from the other tiers.

Elastic restore. The box each target tensor needs in its global tensor comes from
the target: a ``Shard`` passed to ``restore``, a ``DTensor``'s placements, or a
plain tensor (its own box when the world size is unchanged, the whole tensor when
its shape is the global shape). When that box is a stored entry's box, the entry's
chunks fill it directly. Otherwise (another world size, another sharding) every
committed rank manifest is read, the distinct stored boxes overlapping the needed
box are found, only the chunks covering the overlap's bytes are fetched, and the
slices are copied into place. Rank-local entries are never resharded.

``restore_command`` is ``ckptd restore --to DIR``: it pre-fetches one rank's
chunks (same tiers, same verification) into a local directory store, with the
rank's manifest and the commit record, so that a later restore can read them as
its ``cache`` tier (``cache_dir=DIR``).

The package, by flow: ``plan`` (the committed step and its manifests),
``layout`` (the boxes the target needs and where they are assembled),
``geometry`` (pure box and chunk arithmetic), ``sources`` (the tiers),
``fetch`` (verify each chunk from the first source that has it right, then
deliver), ``fill`` (the tree back into the target), ``restorer`` (a whole
restore, in two phases) and ``prefetch`` (``ckptd restore --to DIR``). This
package never writes a store: ``prefetch`` lands chunks and documents through a
``Repository`` (``tests/unit/test_import_rules.py``).
"""

from .prefetch import PrefetchResult, restore_command
from .restorer import RestoreOptions, RestoreResult, adopt_pool, restore_into
from .sources import TIERS, ChunkProblem, Source

__all__ = [
    "TIERS",
    "ChunkProblem",
    "PrefetchResult",
    "RestoreOptions",
    "RestoreResult",
    "Source",
    "adopt_pool",
    "restore_command",
    "restore_into",
]
