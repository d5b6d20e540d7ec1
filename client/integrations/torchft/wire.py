"""What a heal moves between replica groups: torchft's metadata string (the
sender's URL and token), the wait for the step the sender stages, and each chunk
fetched and checked against its id; and the arguments' checks."""

from __future__ import annotations

import json
import logging
import math
import operator
import time
from datetime import timedelta

from ckptd.errors import (
    ChunkHashMismatch,
    CkptdError,
    Conflict,
    InvalidRequest,
    Timeout,
)
from ckptd.hashing import chunk_id

from ...peer import PeerClient

log = logging.getLogger(__name__)

# The metadata's format: torchft hands this string from the healthy group to the
# recovering one (through its manager servers); a receiver refuses another.
_METADATA_FORMAT = "ckptd.torchft/1"
_POLL_FIRST, _POLL_MAX = 0.01, 0.2  # seconds between asks for a step not staged yet


def _whole(name: str, value: object, low: int, high: int) -> int:
    """``value`` when it is a whole number in [``low``, ``high``]; ``InvalidRequest``
    naming the argument and the range for anything else."""
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        number = None
    if isinstance(value, bool) or number is None or not low <= number <= high:
        raise InvalidRequest(f"{name} must be a whole number from {low} to {high}, "
                             f"not {value!r}")
    return int(number)


def _seconds(timeout: timedelta | float) -> float:
    """A timeout given as torchft's ``timedelta`` or as seconds, in seconds."""
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if (isinstance(seconds, bool) or not isinstance(seconds, int | float)
            or not math.isfinite(seconds) or seconds <= 0):
        raise InvalidRequest(f"timeout must be a timedelta or seconds above 0, not {timeout!r}")
    return float(seconds)


def _parse_metadata(metadata: str, own_token: str) -> tuple[str, str]:
    """The sender's URL and token from torchft's metadata string."""
    try:
        doc = json.loads(metadata)
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or doc.get("format") != _METADATA_FORMAT:
        raise InvalidRequest(
            f"torchft heal: the healthy group's checkpoint metadata {metadata[:120]!r} is not "
            "a CkptdTransport's: every replica group must use CkptdTransport")
    url, token = doc.get("url"), doc.get("token", own_token)
    if not isinstance(url, str) or not isinstance(token, str):
        raise InvalidRequest(f"torchft heal: malformed metadata {metadata[:120]!r}")
    return url, token


def _wait_for_step(client: PeerClient, url: str, step: int, deadline: float
                   ) -> tuple[str, int]:
    """Asks the sender what it serves until it serves ``step`` (torchft may ask
    before the healthy group has staged it): the manifest's id and length."""
    wait = _POLL_FIRST
    while True:
        doc = client.describe(url)
        served = doc.get("step")
        if served == step and isinstance(doc.get("manifest"), str):
            size = doc.get("manifest_bytes")
            if not isinstance(size, int) or size <= 0:
                raise Conflict(f"torchft heal: {url} gave no manifest length", peer=url)
            return str(doc["manifest"]), size
        if isinstance(served, int) and served > step:
            raise Conflict(f"torchft heal: {url} serves step {served}, past step {step}",
                           peer=url, step=step, served=served)
        if time.monotonic() + wait > deadline:
            raise Timeout(f"torchft heal: {url} did not serve step {step} in time (it serves "
                          f"{served})", peer=url, step=step)
        time.sleep(wait)
        wait = min(wait * 2, _POLL_MAX)


def _served_step(client: PeerClient, url: str) -> object:
    """The step the sender at ``url`` serves now (None when it serves none, or
    cannot say)."""
    try:
        return client.describe(url).get("step")
    except CkptdError:
        return None


def _fetch_verified(client: PeerClient, url: str, cid: str, dest: memoryview, step: int,
                    what: str) -> None:
    """Fetches chunk ``cid`` into ``dest`` and checks it hashes to ``cid``."""
    try:
        client.fetch_into(url, cid, dest)
    except CkptdError as exc:
        exc.detail.setdefault("step", step)
        raise
    if chunk_id(dest) != cid:
        raise ChunkHashMismatch(
            f"torchft heal of step {step}: a chunk of {what} from {url} does not hash to its "
            f"id {cid}; the heal is refused (nothing was loaded)",
            id=cid, peer=url, step=step)
