"""The repository: the commit protocol over any Store.

Write order is chunks, rank manifests, commit record, ``latest`` ref; reads go
the other way. A crash anywhere leaves only unreferenced objects, never a torn
checkpoint: a step exists only once its commit record does, and the record is
written only after every rank's manifest validated together.

One class, ``Repository`` (``protocol``: the writes and their order), built on a
flow per module: ``reads`` (chunks, manifests, commit records, refs),
``timelines`` (rollback marker and epoch), ``listings`` (jobs, steps, the step a
restore gets), ``verify``; ``results`` holds what the calls answer. What is no
write of the repository's lives beside it: the document thread and the
parsed-manifest cache (``ckptd.documents``), dedup leases (``ckptd.chunk_claims``),
validation (``ckptd.validation``).
"""

from __future__ import annotations

from ckptd.repository.protocol import Repository
from ckptd.repository.results import (
    CommitStatus,
    KnownChunks,
    MissingResult,
    RestorableStep,
    RollbackSet,
    StepInfo,
    VerifyReport,
)

__all__ = [
    "PRESENCE_BATCH",
    "CommitStatus",
    "KnownChunks",
    "MissingResult",
    "Repository",
    "RestorableStep",
    "RollbackSet",
    "StepInfo",
    "VerifyReport",
]

# Chunk ids a manifest's put or commit asks the store about per call: read from
# here at each call (Repository._lacking), so setting it here takes effect.
PRESENCE_BATCH = 2_000
