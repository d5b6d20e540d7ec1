"""One checkpointer's settings, as one frozen value (``CheckpointerConfig``): the
``Checkpointer`` keyword arguments build it, ``Checkpointer.from_config`` takes it,
and the saver, the restorer and the failover agent each read what they need."""

from __future__ import annotations

import dataclasses
import logging
import operator
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ckptd import knobs
from ckptd.errors import InvalidPolicy, InvalidRequest
from ckptd.format import check_job, check_rank
from ckptd.knobs import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE

from .endpoint import cache_root, check_url, endpoint
from .launch import check_incarnation, launch_incarnation
from .staging.layout import PAGE

if TYPE_CHECKING:
    from .health.heartbeat import HealthFn
    from .health.policy import Policy
    from .health.readings import ReadingSource

log = logging.getLogger(__name__)

OnBusy = Literal["wait", "skip"]
OnError = Literal["raise", "warn"]
DefaultPlacement = Literal["replicated", "local"]


@dataclass(frozen=True, slots=True)
class CheckpointerConfig:
    """What a ``Checkpointer`` is made of (see its docstring for each setting).

    Built by ``CheckpointerConfig.of(...)`` (the ``Checkpointer`` keyword arguments,
    with the environment's defaults filled in and every value checked) or directly
    with resolved values; ``replace`` gives a changed copy, checked again."""

    url: str
    job: str
    rank: int = 0
    world_size: int = 1
    token: str | None = None
    chunk_size: int = field(default_factory=knobs.chunk_size)
    default_placement: DefaultPlacement = "replicated"
    on_busy: OnBusy = "wait"
    on_error: OnError = "raise"
    timeout: float | None = None
    staging_budget: int | None = None
    shm_dir: str | os.PathLike[str] | None = None
    serve_peers: bool | None = None
    peer_host: str | None = None
    peer_port: int | None = None
    heartbeat_interval: float | None = None
    health: HealthFn | None = None
    cache_dir: str | os.PathLike[str] | None = None
    health_policy: Policy | str | os.PathLike[str] | None = None
    health_sources: Iterable[ReadingSource] | None = None
    incarnation: str | None = None
    local_rank: int | None = None

    def __post_init__(self) -> None:
        check_url(self.url)  # (as ``of`` did, for a config made directly)
        check_job(self.job)
        if self.incarnation is not None:
            check_incarnation(self.incarnation)
        check_rank(self.rank, self.world_size, job=self.job)
        if self.local_rank is not None and (
                isinstance(self.local_rank, bool) or not isinstance(self.local_rank, int)
                or self.local_rank < 0):
            raise InvalidRequest(f"local_rank must be a device index (0, 1, ...), not "
                                 f"{self.local_rank!r}")
        if not MIN_CHUNK_SIZE <= self.chunk_size <= MAX_CHUNK_SIZE:
            raise InvalidRequest(
                f"chunk_size {self.chunk_size} is outside [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]"
            )
        if self.peer_port is not None and (
                isinstance(self.peer_port, bool) or not isinstance(self.peer_port, int)
                or not 0 <= self.peer_port <= 65535):
            raise InvalidRequest(f"peer_port must be a port from 0 (any) to 65535, not "
                                 f"{self.peer_port!r}")
        if self.shm_dir is not None and os.path.exists(self.shm_dir) and not os.path.isdir(
                self.shm_dir):
            raise InvalidRequest(f"shm_dir {os.fspath(self.shm_dir)!r} is a file, not a "
                                 "directory: name a directory (e.g. /dev/shm) for staging")
        if self.default_placement not in ("replicated", "local"):
            raise InvalidRequest(
                f"default_placement must be 'replicated' or 'local', not "
                f"{self.default_placement!r}"
            )
        if self.on_busy not in ("wait", "skip"):
            raise InvalidRequest(f"on_busy must be 'wait' or 'skip', not {self.on_busy!r}")
        if self.on_error not in ("raise", "warn"):
            raise InvalidRequest(f"on_error must be 'raise' or 'warn', not {self.on_error!r}")
        if self.health_policy is not None:
            _check_policy_file(self.health_policy)
        if self.cache_dir is not None:
            cache_root(self.cache_dir)
        if self.staging_budget is not None and self.staging_budget < self.chunk_size + PAGE:
            raise InvalidRequest(
                f"staging_budget {self.staging_budget} cannot hold one chunk of "
                f"{self.chunk_size} bytes; it needs at least {self.chunk_size + PAGE}"
            )

    @classmethod
    def of(
        cls,
        url: str | None = None,
        job: str = "",
        rank: int | None = None,
        world_size: int | None = None,
        token: str | None = None,
        *,
        chunk_size: int | None = None,
        on_error: OnError | None = None,
        incarnation: str | None = None,
        local_rank: int | None = None,
        **settings: Any,
    ) -> CheckpointerConfig:
        """The config of ``Checkpointer(url, job, rank, world_size, token, ...)``:
        ``url`` and ``token`` default to ``CKPTD_URL`` / ``CKPTD_TOKEN``; ``rank``,
        ``world_size`` and ``local_rank`` to the launcher's ``RANK``, ``WORLD_SIZE``
        and ``LOCAL_RANK`` (torchrun sets them; 0, 1 and none without them); the
        chunk size to ``CKPTD_CHUNK_SIZE``, ``on_error`` to ``CKPTD_ON_ERROR`` or
        "raise", ``incarnation`` to the launch the environment names
        (``launch_incarnation``)."""
        url, token = endpoint(url, token)
        rank, world_size, local_rank = rank_context(rank, world_size, local_rank)
        if rank == 0:  # (one rank says it: every rank has the launcher's environment)
            _say_unknown_variables()
        if incarnation is None:
            incarnation = launch_incarnation()
        if on_error is None:
            on_error = "warn" if knobs.on_error() == "warn" else "raise"
        try:
            size = knobs.chunk_size() if chunk_size is None else operator.index(chunk_size)
        except TypeError:  # ("4MB", 4.0: int() took the float and refused the text)
            raise InvalidRequest(f"chunk_size is a whole number of bytes (e.g. 4 << 20 for "
                                 f"4 MiB), not {chunk_size!r}") from None
        if settings.get("peer_port") is None:
            # Checked now, as the argument is: the peer server reads it as it starts,
            # and a checkpointer over a file:// store starts none.
            knobs.peer_port()
        return cls(url, job, rank, world_size, token, chunk_size=size, on_error=on_error,
                   incarnation=incarnation, local_rank=local_rank, **settings)

    def replace(self, **changes: Any) -> CheckpointerConfig:
        """A copy with ``changes`` (checked like a new one)."""
        return dataclasses.replace(self, **changes)


_said_unknown: set[str] = set()  # (each said once a process)


def _say_unknown_variables() -> None:
    """Logs each ``CKPTD_*`` variable set that is no ckptd setting, once."""
    from ckptd.variables import unknown_variables

    for line in unknown_variables(os.environ):
        if line not in _said_unknown:
            _said_unknown.add(line)
            log.warning("%s", line)


def _check_policy_file(policy: Policy | str | os.PathLike[str]) -> None:
    """A policy file read as the health agent reads it at the first step, refused now
    (missing, unreadable or invalid) in a line naming it; a ``Policy`` passes."""
    from .health.policy import Policy
    from .health.policy_file import load_policy

    if isinstance(policy, Policy):
        return
    if not isinstance(policy, (str, os.PathLike)):
        raise InvalidRequest(f"health_policy must be a Policy or a TOML file's path, not "
                             f"{type(policy).__name__} {policy!r}")
    try:
        load_policy(os.fspath(policy))
    except InvalidPolicy as exc:
        raise InvalidPolicy(f"health_policy {exc.message}; `ckptd policy check FILE` "
                            "checks one", **exc.detail) from None


def rank_context(rank: int | None, world_size: int | None, local_rank: int | None,
                 environ: Mapping[str, str] | None = None) -> tuple[int, int, int | None]:
    """``(rank, world_size, local_rank)``: each argument, or when None the launcher's
    ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (torchrun, torch's env:// convention),
    else 0, 1 and None. A variable that is not a whole number is a mistake named here."""
    env = os.environ if environ is None else environ
    if rank is None:
        rank = _env_index(env, "RANK")
    if world_size is None:
        world_size = _env_index(env, "WORLD_SIZE")
    if local_rank is None:
        local_rank = _env_index(env, "LOCAL_RANK")
    return (0 if rank is None else rank), (1 if world_size is None else world_size), local_rank


def _env_index(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise InvalidRequest(f"{name}={raw!r} in the environment is not a whole number (the "
                             f"launcher sets it; or pass {name.lower()}= to Checkpointer)"
                             ) from None
