"""Who is calling, and whether they may (docs/SECURITY.md, "Tokens and scopes").

A caller is a ``Grant``: the server's own token (``settings.token``) is ``ROOT``,
admin of every job; a token from the tokens file (``settings.tokens_file``) has
one role on the jobs its pattern matches. With neither configured the server is
open (one user on a trusted network) and every caller is ``ROOT``.

Every ``/v1`` route declares what it needs with a ``Needs`` dependency
(``READ``, ``WRITE``, ``ADMIN``: a role on the job of the path, or on some job
when the path names none). ``ApiRoute`` checks it before the body is read; a
route that declares nothing needs ``ROOT``. No token or an unknown one is 401,
a known token without the scope is 403."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.params import Depends as DependsParam
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from ckptd.errors import Forbidden, InvalidRequest, Unauthorized
from ckptd.format import check_job
from ckptd.server.settings import Settings
from ckptd.tokens import ROOT, Grant, Role, TokenFile

# auto_error=False: a missing or malformed header is ours to answer (401 with a
# code), not FastAPI's (403 with its own body). The scheme also documents the
# token in the OpenAPI document.
bearer_scheme = HTTPBearer(
    auto_error=False,
    scheme_name="token",
    description="The server's token (ckptd serve --token, or CKPTD_TOKEN), or a scoped "
    "token from the tokens file (ckptd token create).",
)


def _bearer(authorization: str | None) -> str | None:
    scheme, _, credentials = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not credentials.strip():
        return None
    return credentials.strip()


def auth_configured(settings: Settings) -> bool:
    """Whether callers must present a token at all."""
    return settings.token is not None or settings.tokens_file is not None


def identify(request: Request) -> Grant | None:
    """The caller's grant: ROOT on an open server, None for no or an unknown token."""
    settings: Settings = request.app.state.settings
    if not auth_configured(settings):
        return ROOT
    token = _bearer(request.headers.get("authorization"))
    if token is None:
        return None
    # compare_digest on bytes: constant time, and no TypeError on non-ASCII input.
    if settings.token is not None and hmac.compare_digest(
        token.encode("utf-8"), settings.token.encode("utf-8")
    ):
        return ROOT
    tokens: TokenFile | None = getattr(request.app.state, "tokens", None)
    return tokens.lookup(token) if tokens is not None else None


def authenticate(request: Request) -> Grant:
    """The caller's grant, or ``Unauthorized``."""
    grant = identify(request)
    if grant is None:
        raise Unauthorized("missing or wrong bearer token")
    return grant


def check_token(settings: Settings, authorization: str | None) -> None:
    """Raises ``Unauthorized`` unless ``authorization`` carries the server's own token
    (or the server has no token)."""
    if settings.token is None:
        return
    token = _bearer(authorization) or ""
    if not hmac.compare_digest(token.encode("utf-8"), settings.token.encode("utf-8")):
        raise Unauthorized("missing or wrong bearer token")


JOB_HEADER = "X-Ckptd-Job"


def acting_job(request: Request, grant: Grant, role: str) -> str | None:
    """The job a chunk request acts for: None for a caller that sees every job, else
    the ``X-Ckptd-Job`` header's (which the grant must cover) or the grant's own job."""
    if grant.every_job and grant.may(role, None):
        return None
    named = request.headers.get(JOB_HEADER)
    if named is None and "*" not in grant.job:
        named = grant.job
    if named is None:
        raise InvalidRequest(
            f"this token covers the jobs {grant.job!r}: name the job in the {JOB_HEADER} header"
        )
    job = check_job(named)
    if not grant.may(role, job):
        raise Forbidden(f"this token ({grant.role} on {grant.job!r}) may not {role} job {job!r}",
                        needs=role, job=job)
    return job


@dataclass(frozen=True, slots=True)
class Needs:
    """A route's scope: ``role`` on the path's job (``on_path_job``), or on at least
    one job (then the route itself limits what it shows to the caller's jobs), or on
    the job a chunk request acts for (``acts_for_job``: see ``acting_job``)."""

    role: Role
    on_path_job: bool = True
    acts_for_job: bool = False
    # Store-wide routes (GC, scrub, space): the role on every job ("*" or the root).
    every_job: bool = False

    async def __call__(self) -> None:
        # The check itself runs in ApiRoute, before the body is read; as a
        # dependency this only marks the route (and documents the bearer scheme).
        return None

    def check(self, grant: Grant, job: str | None) -> None:
        if self.every_job and not (grant.every_job and grant.may(self.role, None)):
            # What it lacks: the jobs (a token of some), or the role (one on '*' of a
            # lesser role was told it needed a token for every job: it had one).
            lacks = (f"a token of role {self.role} on every job ('*', or the server's token)"
                     if grant.every_job else "a token for every job ('*')")
            raise Forbidden(
                f"this token ({grant.role} on {grant.job!r}) may not {self.role} the whole "
                f"store: that needs {lacks}",
                needs=self.role, job=None,
            )
        job = job if self.on_path_job else None
        if not grant.may(self.role, job):
            where = f"job {job!r}" if job is not None else "any job"
            raise Forbidden(
                f"this token ({grant.role} on {grant.job!r}) may not {self.role} {where}",
                needs=self.role, job=job,
            )


READ = Needs("read")
WRITE = Needs("write")
ADMIN = Needs("admin")
# Routes without a job in the path: the caller must hold the role on some job, and
# the route answers only about the jobs (or chunks) the caller may see.
READ_ANY = Needs("read", on_path_job=False)
# Chunk routes: the role on the job the request acts for (request.state.acting_job).
CHUNK_READ = Needs("read", on_path_job=False, acts_for_job=True)
CHUNK_WRITE = Needs("write", on_path_job=False, acts_for_job=True)
# The whole store at once (GC, scrub, capacity): the role on every job.
STORE_READ = Needs("read", on_path_job=False, every_job=True)
STORE_ADMIN = Needs("admin", on_path_job=False, every_job=True)
# A route with no declared scope is treated as this: only the server's own token.
UNDECLARED = ADMIN


def route_scope(dependencies: list[DependsParam]) -> Needs | None:
    """The strongest ``Needs`` among a route's dependencies (router and route level)."""
    found = [d.dependency for d in dependencies if isinstance(d.dependency, Needs)]
    if not found:
        return None
    order = {"read": 0, "write": 1, "admin": 2}
    return max(found, key=lambda n: (n.every_job, order[n.role], n.acts_for_job, n.on_path_job))


def scope(needs: Needs) -> list[DependsParam]:
    """``dependencies=scope(WRITE)``: a route's (or router's) scope, with the bearer
    scheme in the OpenAPI document."""
    return [Depends(needs), Depends(bearer_scheme)]


async def require_token(
    request: Request,
    _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
) -> None:
    authenticate(request)


async def get_caller(request: Request) -> Grant:
    """The grant ApiRoute found (or, outside ApiRoute, the request's own)."""
    grant = getattr(request.state, "caller", None)
    if isinstance(grant, Grant):
        return grant
    return authenticate(request)


CallerDep = Annotated[Grant, Depends(get_caller)]


def peer_token(secret: bytes, job: str) -> str:
    """The job's peer token: what ranks of ``job`` present to each other's peer chunk
    servers. Derived, so every replica with the same secret gives the same one."""
    return hmac.new(secret, b"ckptd-peer\0" + job.encode("utf-8"), hashlib.sha256).hexdigest()
