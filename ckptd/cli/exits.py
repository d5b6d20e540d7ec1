"""The exit codes of ``ckptd``'s commands (docs/operations.md): 0 done, 1 damage
found in the store, 2 the command could not run (a usage mistake, a server or a
store not reached, a newer ckptd's document)."""

from __future__ import annotations

from ckptd.errors import ChunkNotFound, CkptdError, IntegrityError, RestoreError, StoreCorrupt

OK = 0
DAMAGE = 1
COULD_NOT_RUN = 2

# A document that does not read or contradicts its key, a chunk whose bytes are not
# its id's, a chunk a committed step names that is gone: the store's state, not the
# user's mistake (what ``ls`` and ``verify`` already exit 1 on).
_DAMAGE = (StoreCorrupt, IntegrityError, ChunkNotFound)


def exit_code(exc: CkptdError) -> int:
    """The exit code of a command that stopped at ``exc``: 1 for damage, else 2."""
    if isinstance(exc, _DAMAGE):
        return DAMAGE
    # restore_failed is damage only when the store itself lacks or spoils a chunk of
    # the step (``detail["damaged"]``); a server gone mid-restore, a target that does
    # not fit: the command could not run.
    if isinstance(exc, RestoreError) and exc.detail.get("damaged") is True:
        return DAMAGE
    return COULD_NOT_RUN
