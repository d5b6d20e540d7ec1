"""Every call the client side makes to a ckptd server, once: its method and path,
what it sends, which answers are fine, and the core model (``ckptd.api``) its
answer is read with. The async ``HttpTransport`` and the sync ``SyncTransport``
(heartbeats, the health agent, the CLI) run the same ``Call``s, so a path or a
contract lives in one place and the server's own models read every answer: a
change to the contract breaks both sides at once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from types import EllipsisType
from typing import Any, Final, Generic, TypeVar

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from ckptd.api import (
    HEALTHZ,
    ChunkStored,
    ClusterView,
    CommitResponse,
    EventList,
    ForgetResult,
    GcResult,
    GcRunBody,
    GcStatus,
    Health,
    HeartbeatReply,
    JobList,
    Latest,
    ManifestStored,
    MissingResponse,
    Overview,
    RestorePlan,
    RollbackReply,
    ScrubResult,
    ScrubRunBody,
    ScrubStatus,
    SnapshotReply,
    SpaceResult,
    StepList,
    StepPlan,
    VerifyResult,
)
from ckptd.cluster import chunk_key
from ckptd.errors import InvalidDocument, InvalidRequest
from ckptd.format import (
    CommitRecord,
    RankManifest,
    canonical_json,
    check_chunk_id,
    check_job,
    check_step,
)
from ckptd.lifecycle.tags import check_tag

from .routing import ROUTE_HEADER

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

__all__ = ["Call", "Reads", "answer"]


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One request to a server and how its answer reads."""

    method: str
    path: str
    read: Callable[[httpx.Response], T]
    ok: tuple[int, ...] = (200,)
    params: dict[str, Any] | None = None
    json: Any = None
    content: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    # seconds; None waits as long as it takes (gc); ...: the transport's own
    timeout: float | None | EllipsisType = ...

    def arguments(self, connect: float | None = None) -> dict[str, Any]:
        """Keyword arguments of ``httpx.Client.request`` (and the async one's);
        ``connect``: the seconds a connection may take, within the call's own timeout."""
        args: dict[str, Any] = {}
        if self.params:
            args["params"] = self.params
        if self.json is not None:
            args["json"] = self.json
        if self.content is not None:
            args["content"] = self.content
        if self.headers:
            args["headers"] = self.headers
        if not isinstance(self.timeout, EllipsisType):
            args["timeout"] = request_timeout(self.timeout, connect)
        return args


def request_timeout(seconds: float | None, connect: float | None) -> httpx.Timeout:
    """httpx's timeouts of a request that may last ``seconds`` (None: no bound) and
    may take ``connect`` seconds to connect (None: as long as the request)."""
    if connect is None:
        return httpx.Timeout(seconds)
    return httpx.Timeout(seconds, connect=connect if seconds is None else min(connect, seconds))


# Answers are read ignoring fields this client does not know: a newer server may
# add one (as ``store_id`` was added to ``GET /v1/cluster``), and a rolling upgrade
# (servers first) must not fail every older client's parse of that answer. What a
# field means never changes within the API's version, so an unknown one is safe to
# skip; a missing or mistyped one is still an error. The format's documents are
# not read this way (the override reaches nested models): their own parsers refuse
# what they do not know, those inside an answer too (``_commit_response``,
# ``_step_plan``; a restore plan's manifest in ``restore/plan.py``).
ANSWER_EXTRA: Final = "ignore"


class Reads(Generic[M, T]):
    """Reads an answer with the core's ``model`` (the one the server's route answers
    with; ``parse``: the format's own reader of it), then ``pick``s what the caller
    wants of it. An answer that does not fit is a typed error."""

    def __init__(self, model: type[M], pick: Callable[[M, httpx.Response], T],
                 parse: Callable[[bytes], M] | None = None) -> None:
        self.model = model
        self.pick = pick
        self.parse = parse

    def __call__(self, resp: httpx.Response) -> T:
        try:
            if self.parse is not None:
                doc = self.parse(resp.content)
            else:
                doc = self.model.model_validate_json(resp.content, extra=ANSWER_EXTRA)
        except ValidationError as exc:
            if "json" not in resp.headers.get("content-type", ""):  # another program's page
                raise not_a_server(resp) from None
            first = exc.errors()[0] if exc.errors() else None
            where = f" ({'.'.join(map(str, first['loc']))}: {first['msg']})" if first else ""
            raise InvalidDocument(
                f"the answer of {resp.request.method} {resp.request.url.path} is not a "
                f"{self.model.__name__}{where}: are the client and the server of one ckptd "
                "version?"
            ) from None
        return self.pick(doc, resp)


def answer_excerpt(resp: httpx.Response) -> str:
    """The start of an answer's body on one line (an HTML page runs to dozens)."""
    text = " ".join(resp.text.split())
    return text if len(text) <= 80 else text[:80] + "..."


def not_a_server(resp: httpx.Response) -> InvalidRequest:
    """The error for an answer that no ckptd server gives (another program's)."""
    url = resp.request.url
    return InvalidRequest(
        f"{url.scheme}://{url.netloc.decode('ascii')} does not answer as a ckptd server "
        f"(HTTP {resp.status_code} to {resp.request.method} {url.path}: "
        f"{answer_excerpt(resp)}); check the URL and its port"
    )


def _itself(doc: M, resp: httpx.Response) -> M:
    return doc


def answer(model: type[M]) -> Reads[M, M]:
    """The answer as the core's ``model``."""
    return Reads(model, _itself)


_TAGS = TypeAdapter(dict[str, Any])


def _tags(resp: httpx.Response) -> dict[str, int]:
    """The tags of the answer: its entries whose value is a step (a newer server's
    answer may grow, docs/API.md; an entry that is no step is none of this client's
    tags)."""
    try:
        doc = _TAGS.validate_json(resp.content)
    except ValidationError as exc:
        raise InvalidDocument(f"the answer of {resp.request.url.path} is not a tag list: "
                              f"{exc}") from None
    return {name: step for name, step in doc.items() if type(step) is int}


def _nothing(resp: httpx.Response) -> None:
    return None


def _content(resp: httpx.Response) -> bytes:
    return resp.content


def _created(doc: ChunkStored, resp: httpx.Response) -> bool:
    return doc.created


def _as_sent(doc: RestorePlan, resp: httpx.Response) -> dict[str, Any]:
    # Checked against the model, returned as sent: the manifest in it is hashed as it
    # came (a model's dump need not give back the same bytes).
    sent: dict[str, Any] = json.loads(resp.content)
    return sent


def _job(job: str) -> str:
    return f"/v1/jobs/{check_job(job)}"


# -- chunks ---------------------------------------------------------------------------


def missing_chunks(ids: list[str], claimer: str | None = None) -> Call[MissingResponse]:
    """``POST /v1/chunks/missing``, at the home of the first id (the caller groups)."""
    body: dict[str, Any] = {"ids": ids}
    if claimer is not None:
        body["claimer"] = claimer
    route = {ROUTE_HEADER: chunk_key(ids[0])} if ids else {}
    return Call("POST", "/v1/chunks/missing", answer(MissingResponse), json=body, headers=route)


def put_chunk(cid: str, body: Any, size: int) -> Call[bool]:
    """``PUT /v1/chunks/{id}``; True when the store did not hold it yet. ``body``: the
    bytes, or an async iterable of them (async transport only)."""
    return Call("PUT", f"/v1/chunks/{check_chunk_id(cid)}", Reads(ChunkStored, _created),
                ok=(200, 201), content=body,
                headers={"Content-Type": "application/octet-stream",
                         "Content-Length": str(size)})


def get_chunk(cid: str) -> Call[bytes]:
    """``GET /v1/chunks/{id}``: the bytes, not yet verified."""
    return Call("GET", f"/v1/chunks/{check_chunk_id(cid)}", _content)


# -- manifests and commits ------------------------------------------------------------


def put_manifest(manifest: RankManifest) -> Call[ManifestStored]:
    return Call("PUT", f"{_job(manifest.job)}/steps/{manifest.step}/ranks/{manifest.rank}",
                answer(ManifestStored), ok=(200, 201), content=manifest.canonical(),
                headers={"Content-Type": "application/json"})


def get_manifest(job: str, step: int, rank: int) -> Call[bytes]:
    """A rank manifest's bytes as stored (the caller checks them against the commit)."""
    return Call("GET", f"{_job(job)}/steps/{check_step(step)}/ranks/{int(rank)}", _content)


def commit(job: str, step: int, meta: dict[str, Any] | None = None) -> Call[CommitResponse]:
    return Call("POST", f"{_job(job)}/steps/{check_step(step)}/commit",
                Reads(CommitResponse, _itself, parse=_commit_response),
                json={"meta": dict(meta or {})})


def _commit_response(data: bytes) -> CommitResponse:
    # The record inside is a document: read by the format's parser, which refuses a
    # field it does not know, where the answer around it may grow (ANSWER_EXTRA).
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise InvalidDocument(f"a commit answer that is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidDocument("a commit answer that is not a JSON object")
    record = doc.get("record")
    if record is not None:
        doc["record"] = CommitRecord.parse(canonical_json(record))
    return CommitResponse.model_validate(doc, extra=ANSWER_EXTRA)


def read_commit(job: str, step: int) -> Call[CommitRecord]:
    """A committed step's record (``not_committed`` while it is pending)."""
    return Call("GET", f"{_job(job)}/steps/{check_step(step)}",
                Reads(CommitRecord, _itself, parse=CommitRecord.parse))


def latest(job: str) -> Call[Latest]:
    return Call("GET", f"{_job(job)}/latest", answer(Latest))


def jobs() -> Call[JobList]:
    return Call("GET", "/v1/jobs", answer(JobList))


def steps(job: str) -> Call[StepList]:
    return Call("GET", f"{_job(job)}/steps", answer(StepList))


def verify(job: str, step: int | None, timeout: float) -> Call[VerifyResult]:
    params = {} if step is None else {"step": check_step(step)}
    return Call("POST", f"{_job(job)}/verify", answer(VerifyResult), params=params,
                timeout=timeout)


def verify_stream(job: str, step: int | None, timeout: float) -> Call[None]:
    """The streamed verify: progress lines, then ``{"report": VerifyResult}``."""
    params = {} if step is None else {"step": check_step(step)}
    return Call("POST", f"{_job(job)}/verify", _nothing, params=params,
                headers={"Accept": "application/x-ndjson"}, timeout=timeout)


def verify_report(item: Any) -> VerifyResult:
    """The report line of a streamed verify, read with the core's model."""
    try:
        return VerifyResult.model_validate(item, strict=False, extra=ANSWER_EXTRA)
    except ValidationError as exc:
        raise InvalidDocument(f"the verify report does not fit VerifyResult: {exc}") from None


# -- liveness, plans, coordination ----------------------------------------------------


def heartbeat(job: str, rank: int, body: dict[str, Any]) -> Call[HeartbeatReply]:
    return Call("POST", f"{_job(job)}/ranks/{int(rank)}/heartbeat", answer(HeartbeatReply),
                json=body)


def goodbye(job: str, rank: int, timeout: float) -> Call[None]:
    """The rank closed cleanly: it shows as ``left``, not ``dead``."""
    return Call("DELETE", f"{_job(job)}/ranks/{int(rank)}/heartbeat", _nothing, ok=(200, 204),
                timeout=timeout)


def restore_plan(job: str, rank: int, step: int) -> Call[dict[str, Any]]:
    """The job's home replica's restore plan for ``rank`` at ``step`` (its JSON,
    checked against ``RestorePlan``)."""
    return Call("GET", f"{_job(job)}/restore-plan", Reads(RestorePlan, _as_sent),
                params={"rank": int(rank), "step": check_step(step)})


def step_plan(job: str, rank: int, step: int | None) -> Call[StepPlan]:
    """Every rank's manifest of a committed step (the latest restorable one when
    ``step`` is None) and the live peers holding it, asked by ``rank``: one request."""
    params: dict[str, Any] = {"rank": int(rank)}
    if step is not None:
        params["step"] = check_step(step)
    return Call("GET", f"{_job(job)}/step-plan", Reads(StepPlan, _itself, parse=_step_plan),
                params=params)


def _step_plan(data: bytes) -> StepPlan:
    # The documents are read by the format's own parsers (each re-encoded as the
    # canonical bytes it came as, so that the caller can hash it against the commit).
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise InvalidDocument(f"a step plan that is not JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("manifests"), list):
        raise InvalidDocument("a step plan without its manifests")
    record = CommitRecord.parse(canonical_json(doc.get("commit")))
    manifests = [RankManifest.parse(canonical_json(m)) for m in doc["manifests"]]
    return StepPlan.model_validate({**doc, "commit": record, "manifests": manifests},
                                  extra=ANSWER_EXTRA)


def snapshot_request(job: str, rank: int, reason: str,
                     step_time_s: float | None = None) -> Call[SnapshotReply]:
    body: dict[str, Any] = {"rank": int(rank), "reason": reason}
    if step_time_s is not None and step_time_s > 0:
        body["step_time_s"] = float(step_time_s)
    return Call("POST", f"{_job(job)}/snapshot-requests", answer(SnapshotReply), json=body)


def rollback(job: str) -> Call[RollbackReply]:
    """The job's rollback marker and its epoch."""
    return Call("GET", f"{_job(job)}/rollback", answer(RollbackReply))


def set_rollback(job: str, step: int, reason: str,
                 from_epoch: int | None = None) -> Call[RollbackReply]:
    body: dict[str, Any] = {"step": step, "reason": reason}
    if from_epoch is not None:
        body["from_epoch"] = from_epoch
    return Call("POST", f"{_job(job)}/rollback", answer(RollbackReply), json=body)


def clear_rollback(job: str) -> Call[RollbackReply]:
    return Call("DELETE", f"{_job(job)}/rollback", answer(RollbackReply))


def events(job: str) -> Call[EventList]:
    return Call("GET", f"{_job(job)}/events", answer(EventList))


def overview(params: dict[str, Any], replica: str | None = None) -> Call[Overview]:
    """``GET /v1/overview``; ``replica``: ask that member (routing sends a call that
    names no job to the member it names)."""
    return Call("GET", f"{replica or ''}/v1/overview", answer(Overview), params=params)


def healthz() -> Call[Health]:
    return Call("GET", HEALTHZ, answer(Health))


def cluster() -> Call[ClusterView]:
    return Call("GET", "/v1/cluster", answer(ClusterView))


# -- the store's lifecycle ------------------------------------------------------------


def forget(job: str, dry_run: bool, keep_last: int | None,
           step: int | None = None) -> Call[ForgetResult]:
    """``step``: that one damaged step (not with ``keep_last``)."""
    params: dict[str, Any] = {"dry_run": dry_run}
    if keep_last is not None:  # 0 too: the server refuses it, it must not mean "none"
        params["keep_last"] = keep_last
    if step is not None:
        params["step"] = step
    return Call("POST", f"{_job(job)}/forget", answer(ForgetResult), params=params)


def gc(dry_run: bool, grace: float | None) -> Call[GcResult]:
    """A collection waits out its grace period (so saves in flight finish) before it
    sweeps: the request lasts that long, past any ordinary read timeout."""
    params: dict[str, Any] = {"dry_run": dry_run}
    if grace is not None:
        params["grace"] = grace
    return Call("POST", "/v1/gc", answer(GcResult), params=params, timeout=None)


def start_gc(grace: float | None) -> Call[GcRunBody]:
    """A collection started in the background: the answer comes at once, and
    ``gc_status`` follows it (no request lasts its grace period)."""
    params: dict[str, Any] = {} if grace is None else {"grace": grace}
    return Call("POST", "/v1/gc/runs", answer(GcRunBody), params=params, ok=(202,))


def gc_status() -> Call[GcStatus]:
    return Call("GET", "/v1/gc", answer(GcStatus))


def scrub(budget_bytes: int | None) -> Call[ScrubResult]:
    """A scrub re-reads the store at its rate (``CKPTD_SCRUB_RATE``, 64 MiB/s): the
    answer comes when the pass (or its budget) ends, past any ordinary read timeout."""
    params = {} if budget_bytes is None else {"budget_bytes": budget_bytes}
    return Call("POST", "/v1/scrub", answer(ScrubResult), params=params, timeout=None)


def start_scrub(budget_bytes: int | None) -> Call[ScrubRunBody]:
    """A scrub started in the background: the answer comes at once, and
    ``scrub_status`` follows it (no request lasts the pass)."""
    params = {} if budget_bytes is None else {"budget_bytes": budget_bytes}
    return Call("POST", "/v1/scrub/runs", answer(ScrubRunBody), params=params, ok=(202,))


def scrub_status() -> Call[ScrubStatus]:
    return Call("GET", "/v1/scrub", answer(ScrubStatus))


def tag(job: str, name: str, step: int) -> Call[dict[str, int]]:
    # Checked here as the store checks it: a name with a '/' or a space would reach
    # no route at all (a 404 that says nothing of the name).
    return Call("PUT", f"{_job(job)}/tags/{check_tag(name)}", _tags, json={"step": step})


def untag(job: str, name: str) -> Call[dict[str, int]]:
    return Call("DELETE", f"{_job(job)}/tags/{check_tag(name)}", _tags)


def tags(job: str) -> Call[dict[str, int]]:
    """A job's tags, name -> step (the Lightning plugin resolves paths with them)."""
    return Call("GET", f"{_job(job)}/tags", _tags)


def space() -> Call[SpaceResult]:
    return Call("GET", "/v1/space", answer(SpaceResult))
