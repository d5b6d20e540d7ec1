"""Tunables in one place: defaults, ``CKPTD_*`` environment overrides, and
explicit arguments (which always win, by being passed where these are read)."""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

from ckptd.errors import InvalidRequest

MiB = 1 << 20

# Every ``CKPTD_*`` variable ckptd reads besides the server's settings (those are
# ``ckptd.server.settings.Settings``' fields, ``CKPTD_<FIELD>``), named without the
# prefix: the clients' and the CLI's (the tunables below, where and who), and the
# image ``deploy/`` runs. ``ckptd`` says of any other ``CKPTD_*`` variable set that it is
# no setting (``ckptd/variables.py``): a misspelled one was ignored without a
# word. tests/unit/test_settings_doc.py keeps this, the code and docs/settings.md in step.
CLIENT_VARIABLES = frozenset({
    "ANSWER_WITHIN", "CACHE_DIR", "CA_BUNDLE", "CHUNK_SIZE", "CLAIM_LEASE", "CLUSTER_REFRESH",
    "CONNECT_TIMEOUT", "DIRECT_READS", "DIRECT_WRITES", "H2D_BLOCKING_EVENTS", "H2D_ONE_PASS",
    "H2D_PIECE", "H2D_SCRATCH", "H2D_THREADS", "HASH_THREADS_THRESHOLD", "HEARTBEAT_INTERVAL",
    "IMAGE", "INCARNATION", "MALLOC_MMAP_THRESHOLD", "MAX_MANIFEST_BYTES", "MISSING_BATCH",
    "ON_ERROR", "PEER_ADVERTISE_HOST", "PEER_CONCURRENCY", "PEER_HOST", "PEER_INTERFACE",
    "PEER_PORT", "PEER_TIMEOUT", "POOL_WAIT", "REQUEST_TIMEOUT", "RESTORE_CONCURRENCY",
    "RESTORE_HUGE_PAGES", "RETRIES", "RETRY_BACKOFF", "SERVER_WAIT", "SHM_DIR",
    "STALL_TIMEOUT", "SUSPECT_AFTER", "TOKEN", "TOKENS_FILE", "UPLOAD_CONCURRENCY", "URL",
})
# Read by the test suite only (docs/development.md): never said to be unknown.
TEST_ONLY_PREFIX = "CKPTD_TEST_"


def human_bytes(n: int) -> str:
    """``n`` bytes as people read them: 512 B, 16.0 KiB, 4.2 GiB."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def _env_int(name: str, default: int, low: int | None = None, high: int | None = None) -> int:
    """``name``'s value, a whole number in [``low``, ``high``] (``default`` when
    unset); ``InvalidRequest`` saying what to set for anything else."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise _bad(name, raw, "is not a whole number", default, low, high) from None
    if (low is not None and value < low) or (high is not None and value > high):
        raise _bad(name, raw, "is out of range", default, low, high)
    return value


def _env_float(name: str, default: float, low: float | None = None,
               above: float | None = None) -> float:
    """``name``'s value, a number of at least ``low`` or more than ``above``
    (``default`` when unset); ``InvalidRequest`` saying what to set for anything else."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if math.isnan(value) or (low is not None and value < low) or (
            above is not None and value <= above):
        wanted = (f"a number of seconds above {above:g}" if above is not None
                  else f"a number of at least {low:g}" if low is not None else "a number")
        raise InvalidRequest(f"{name}={raw!r} is not {wanted}; set one, or unset it for the "
                             f"default ({default:g})", knob=name)
    return value


def _env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """``name``'s value, one of ``choices`` in any case (``default`` when unset);
    ``InvalidRequest`` naming them for anything else: never a default taken
    silently for a word mistyped."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    if raw.strip().lower() not in choices:
        raise InvalidRequest(f"{name}={raw!r} is not one of {', '.join(choices)}; set one, "
                             f"or unset it for the default ({default})", knob=name)
    return raw.strip().lower()


_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _env_flag(name: str, default: bool) -> bool:
    """``name``'s value as on (1, true, yes, on) or off (0, false, no, off)."""
    value = _env_choice(name, "1" if default else "0", _ON + _OFF)
    return value in _ON


def _bad(name: str, raw: str, problem: str, default: int, low: int | None,
         high: int | None) -> InvalidRequest:
    span = (f"from {low} to {high}" if low is not None and high is not None
            else f"of at least {low}" if low is not None
            else f"of at most {high}" if high is not None else "")
    return InvalidRequest(f"{name}={raw!r} {problem}; set a whole number {span}, or unset it "
                          f"for the default ({default})".replace("  ", " "), knob=name)


def chunk_size() -> int:
    """Bytes per chunk of a tensor shard (the last chunk of a shard is shorter)."""
    return _env_int("CKPTD_CHUNK_SIZE", 4 * MiB, MIN_CHUNK_SIZE, MAX_CHUNK_SIZE)


# A chunk can never be larger than this, whatever a manifest says: the server holds
# at most one chunk body in memory, so this bounds its memory per request.
MAX_CHUNK_SIZE = 256 * MiB
MIN_CHUNK_SIZE = 4096


def hash_threads_threshold() -> int:
    """Buffers at least this large are hashed with blake3's own threads."""
    return _env_int("CKPTD_HASH_THREADS_THRESHOLD", 2 * MiB, 0)


def upload_concurrency() -> int:
    return _env_int("CKPTD_UPLOAD_CONCURRENCY", 8, 1)


def request_timeout() -> float:
    """Seconds for one HTTP request (each read and write; connecting has
    ``connect_timeout``)."""
    return _env_float("CKPTD_REQUEST_TIMEOUT", 60.0, above=0)


def connect_timeout() -> float:
    """Seconds to open a connection to a ckptd server (a replica whose host vanished
    answers nothing: its calls move to the next replica after this long, not after
    ``request_timeout``). A connection that waits for an answer sends keepalive
    probes after this long idle."""
    return _env_float("CKPTD_CONNECT_TIMEOUT", 3.0, above=0)


def answer_within() -> float:
    """Seconds each server a CLI command is given has to answer its first question
    (``GET /v1/cluster``, asked before the command's own calls) before the command
    says it does not answer (``ckptd/cli/servers.py``)."""
    return _env_float("CKPTD_ANSWER_WITHIN", 10.0, above=0)


def suspect_after() -> float:
    """Seconds a request waits on a ckptd replica, where there is another to go to,
    before that replica's ``/healthz`` is asked (on a connection of its own, 5 s at
    most) whether it is there at all: a live one answers within
    2 s whatever its store does; one that does not (stopped, wedged) is marked down,
    and the requests waiting on it go to the next replica. 0: never asked."""
    return _env_float("CKPTD_SUSPECT_AFTER", 5.0, low=0)


def stall_timeout() -> float:
    """Seconds a server's connection may leave data unacknowledged, or leave
    keepalive probes unanswered, before it counts as gone (TCP_USER_TIMEOUT; at
    least twice ``connect_timeout``): a host that vanished mid-request. Longer than
    a server's ``CKPTD_INGEST_WAIT`` (10 s), for which a busy server stops reading an
    upload's body: its kernel answers, but its window stays shut, and Linux ends a
    connection whose window stayed shut past TCP_USER_TIMEOUT too. A host that
    vanished is told apart sooner, by what TCP_INFO says (``client/stall.py``: nothing
    acknowledged for 1.5 s while data or probes go unanswered)."""
    return _env_float("CKPTD_STALL_TIMEOUT", 20.0, above=0)


def server_wait() -> float:
    """Seconds a new ``Checkpointer`` waits for its server to take a connection
    before it raises (a warning says what it waits for after 2 s): long enough for
    a server that restarts as a replacement rank starts (``ckptd serve`` takes ~2 s
    to listen on a loaded 2-core machine; a container restart takes longer)."""
    return _env_float("CKPTD_SERVER_WAIT", 20.0, low=0)


def pool_wait() -> float:
    """Seconds a restoring rank with no staging pool of its own (a replacement node's)
    waits for the other ranks of its launch to serve theirs before it plans: the
    survivors of a lost node serve their pools once their own restore verified them,
    moments after they start, and a plan made before that reads the store instead
    (``client/restore/meet.py``). 0: never wait. Long enough for a survivor that
    starts late on a loaded node (Python, torch, the group) and restores."""
    return _env_float("CKPTD_POOL_WAIT", 15.0, low=0)


def retries() -> int:
    """Attempts after the first for a request that failed on connection or 5xx."""
    return _env_int("CKPTD_RETRIES", 4, 0)


def retry_backoff() -> float:
    """Seconds before the first retry; doubles each time."""
    return _env_float("CKPTD_RETRY_BACKOFF", 0.2, low=0)


def missing_batch() -> int:
    """Most chunk ids in one missing-chunks call."""
    return _env_int("CKPTD_MISSING_BATCH", 50_000, 1)


def claim_lease() -> float:
    """Seconds a missing-chunks call reserves the ids it returns for its caller."""
    return _env_float("CKPTD_CLAIM_LEASE", 30.0, above=0)


def max_manifest_bytes() -> int:
    return _env_int("CKPTD_MAX_MANIFEST_BYTES", 64 * MiB, 1)


# -- restore tiers, peers and heartbeats (ckptd.client.restore, .peer, .heartbeat) -----


def restore_concurrency() -> int:
    """Chunks one restore fetches at once (over all its sources): at least one per
    core, since each verifies its chunk on a worker thread."""
    return _env_int("CKPTD_RESTORE_CONCURRENCY", max(8, os.cpu_count() or 1), 1)


def h2d_piece() -> int:
    """Bytes of one page-locked bounce buffer of a restore into CUDA tensors (two
    per copying thread)."""
    return max(64 * 1024, _env_int("CKPTD_H2D_PIECE", 8 * MiB))


def h2d_threads() -> int:
    """Threads that copy verified host bytes into one CUDA device's tensors: each
    copies into its bounce buffers (and, for ``atomic=False``, hashes there) while
    the device's copy engine reads the other one."""
    return max(1, _env_int("CKPTD_H2D_THREADS", max(2, min(8, (os.cpu_count() or 2) // 2))))


def h2d_one_pass() -> bool:
    """``atomic=False`` into CUDA tensors: hash each chunk from the bounce buffer the
    device reads, while it is sent (one read of the host bytes), rather than where
    it lies first and send it afterwards (two). On by default."""
    return _env_int("CKPTD_H2D_ONE_PASS", 1) != 0


def h2d_blocking_events() -> bool:
    """The copying threads wait for a bounce buffer's copy to end by blocking in the
    driver (``1``) rather than spinning on it (``0``, CUDA's default event). Up to
    eight threads spinning take as many cores from the hashing; not measured yet
    (``python -m bench.gpu --sweep``), so off by default."""
    return _env_int("CKPTD_H2D_BLOCKING_EVENTS", 0) != 0


def h2d_scratch() -> str:
    """An atomic restore into CUDA tensors may send each chunk, hashed on the way,
    into device memory beside the target, and copy it into the target (device to
    device) once every chunk verified: one read of the host bytes, as ``atomic=False``,
    for as much device memory again for the while. ``1``: always; ``auto``: when the
    device has that room free (and a tenth of it or 1 GiB to spare); ``0``, the
    default: every chunk hashed where it lies first, then sent (on one H200 with 16
    cores, 2 GiB: 210 ms against 234 ms through device memory, memory-bound either
    way; bench/RESULTS.md)."""
    return _env_choice("CKPTD_H2D_SCRATCH", "0", ("auto", "0", "1"))


def restore_huge_pages() -> bool:
    """Advise a restore's fresh memory (landing and assembly buffers) to use
    transparent huge pages. Off by default: on a host whose memory is fragmented
    (page cache, long uptime) the kernel compacts memory at the first touch, and a
    1 GiB restore from peers measured 3.2-4.7 s with the advice and 2.0 s without."""
    return _env_flag("CKPTD_RESTORE_HUGE_PAGES", False)


def direct_reads() -> bool:
    """A restore whose plan carries presigned URLs (a server over an S3-compatible
    store) reads those chunks straight from the object store; 0 sends every read
    through the server."""
    return _env_flag("CKPTD_DIRECT_READS", True)


def direct_writes() -> bool:
    """A local store with fsync writes objects of 1 MiB and more from page-aligned
    buffers around the page cache (``O_DIRECT``, ``ckptd/store/direct_io.py``): a
    third less server CPU under ingest. 0 writes everything through the cache."""
    return _env_flag("CKPTD_DIRECT_WRITES", True)


def on_error() -> str:
    """What a failed background save does when ``on_error`` is not given: raise
    at the next call (``raise``) or log and go on (``warn``)."""
    return _env_choice("CKPTD_ON_ERROR", "raise", ("raise", "warn"))


def peer_host() -> str | None:
    """Address the peer chunk server binds; None (unset): a ``Checkpointer``'s binds
    every interface, so replacement ranks on other hosts reach it (its token still
    guards it: ``client/peer/address.py``), a bare ``PeerServer`` 127.0.0.1."""
    return os.environ.get("CKPTD_PEER_HOST") or None


def peer_interface() -> str | None:
    """Network interface peers reach this rank at (its address is advertised and
    bound), e.g. a training network's, as ``NCCL_SOCKET_IFNAME`` names one."""
    return os.environ.get("CKPTD_PEER_INTERFACE") or None


def peer_port(local_rank: int | None = None) -> int:
    """Port of this rank's peer chunk server: ``CKPTD_PEER_PORT`` plus the rank's
    local rank (``local_rank``, else ``LOCAL_RANK``, torchrun's), so that the ranks
    of one host take a range from it rather than all the same port; 0 (the default)
    lets the OS choose."""
    base = _env_int("CKPTD_PEER_PORT", 0, 0, 65535)
    local = str(local_rank) if local_rank is not None else os.environ.get("LOCAL_RANK", "")
    local = local.strip()
    if base == 0 or not local.isdigit():
        return base
    if base + int(local) > 65535:
        raise InvalidRequest(f"CKPTD_PEER_PORT={base} leaves no port for local rank {local} "
                             f"(each takes CKPTD_PEER_PORT + LOCAL_RANK): choose a lower one")
    return base + int(local)


def peer_advertise_host() -> str | None:
    """Address peers should use to reach this one (default: the peer interface's, or
    the bound address, or, bound to every interface, this host's address on the
    route to the ckptd server). The server registers only the heartbeat's own
    source address or one in its ``CKPTD_PEER_NETWORKS``."""
    return os.environ.get("CKPTD_PEER_ADVERTISE_HOST") or None


def peer_concurrency() -> int:
    """Chunk requests the peer chunk server answers at once (more wait, then 503),
    so that serving peers cannot starve training of CPU and memory bandwidth."""
    return _env_int("CKPTD_PEER_CONCURRENCY", 4, 1)


def peer_timeout() -> float:
    """Seconds for one chunk request to a peer (connect and each read)."""
    return _env_float("CKPTD_PEER_TIMEOUT", 10.0, above=0)


def heartbeat_interval() -> float:
    """Seconds between heartbeats until the server's reply names its own interval."""
    return _env_float("CKPTD_HEARTBEAT_INTERVAL", 3.0, above=0)


def cache_dir() -> str | None:
    """A local directory store restores read chunks from before peers and the store
    (what ``ckptd restore --to DIR`` fills)."""
    return os.environ.get("CKPTD_CACHE_DIR") or None


def shm_dir() -> Path:
    """Where staging pools live: ``CKPTD_SHM_DIR``, else ``/dev/shm``, else the
    temporary directory."""
    raw = os.environ.get("CKPTD_SHM_DIR")
    if raw:
        return Path(raw)
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


def cluster_refresh() -> float:
    """Seconds between a client's re-reads of the replicas (``GET /v1/cluster``); 0:
    never, route over the URLs given only."""
    return _env_float("CKPTD_CLUSTER_REFRESH", 10.0, low=0)


def malloc_mmap_threshold() -> int:
    """Bytes from which a server's allocations are mapped apart and unmapped when
    freed (glibc's ``M_MMAP_THRESHOLD``, fixed); 0 leaves glibc's own threshold,
    which rises to the largest block freed so far (``server/native_heap.py``)."""
    return _env_int("CKPTD_MALLOC_MMAP_THRESHOLD", 128 * 1024, 0)
