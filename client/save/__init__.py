"""The save flow: ``flatten`` (a state dict into the format's tree and named
tensors), staging (``ckptd.client.staging``: one host copy in shared memory),
``chunks`` (hash each staged chunk in place, upload what the store lacks) and
``snapshot`` (a snapshot's upload: manifest, commit, ``SaveResult``)."""

from .flatten import FlatState, flatten
from .snapshot import SaveResult, SnapshotUpload

__all__ = ["FlatState", "SaveResult", "SnapshotUpload", "flatten"]
