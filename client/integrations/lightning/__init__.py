"""Lightning's ``CheckpointIO`` over ckptd: with
``Trainer(plugins=[CkptdCheckpointIO(...)])`` or ``Fabric(plugins=[...])`` a run
saves and resumes through a ``Checkpointer``.

    from ckptd.client.integrations.lightning import CkptdCheckpointIO
    trainer = L.Trainer(plugins=[CkptdCheckpointIO("http://ckptd:8470", job="mnist")], ...)
    trainer.fit(model, ckpt_path="last")

Paths. Lightning names checkpoints by path; ckptd by job and step. The job is the
plugin's; the step is the checkpoint's ``global_step`` (Fabric: its ``step`` or
``global_step``, a whole number, else the step after the last one); the path's
file name, without ``.ckpt``, becomes a ckptd tag of that step (retention keeps
tagged steps). Once the step commits, a small JSON pointer file is written at the
path, so that Lightning's own file logic works as with files where it goes
through the plugin: ``ckpt_path="last"`` and ``"best"``, ``ModelCheckpoint``'s
top-k, versions and removals. ``LightningModule.load_from_checkpoint`` reads the
file itself and cannot load a pointer: ``ckpt = io.load_checkpoint(path)``, then
build the module from ``ckpt["hyper_parameters"]`` and ``load_state_dict(
ckpt["state_dict"])`` (the pointer's ``about`` says so too). Loading a path
reads its pointer; where there is no file (another node, pointers off), the
path's name is looked up among the job's tags, and ``latest`` names the newest
committed step. Removing a path removes its pointer and its tag, never data.

Saves are asynchronous as ckptd's are: ``save_checkpoint`` returns once the state
is staged (copied into the staging pool); the upload, the commit, the tag and
the pointer follow in the background. A load waits for them, on every rank (it
reads what was just saved; ``rank_zero.py``). A failure there is raised, once, by
the next save, load or ``teardown`` (Lightning calls it when fitting ends), which
also waits for the last save, on every rank (what follows ``fit`` sees it); said
once, in Lightning's terms (``failures.py``). Lightning's ``AsyncCheckpointIO``
adds nothing but a thread and a clone of every tensor, and its ``teardown`` does
not call this plugin's: call it after ``fit``. One step saved under two names
is stored once (``same_step.py``); a pointer names its job and store, which a
load checks (``pointers.py``).

What is stored is what ckptd stores: tensors as raw bytes, every other leaf as
JSON (no pickle). A leaf ckptd cannot store (an ``argparse.Namespace`` in the
hyperparameters, a dataclass) fails the save with ``UnsupportedValue`` naming
its path. docs/integrations/lightning.md tells the rest.
"""

from .checkpoint_io import CkptdCheckpointIO
from .pointers import POINTER_FORMAT, read_pointer, tag_for_path

__all__ = ["POINTER_FORMAT", "CkptdCheckpointIO", "read_pointer", "tag_for_path"]
