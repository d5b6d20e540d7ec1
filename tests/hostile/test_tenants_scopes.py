"""Issue 10, item 12: a token reaches only its jobs, in its role, on every route.

The routes are taken from the application itself, so a route added later is
covered at once: it must declare a scope (``ckptd.server.auth.Needs``) or this
test fails, and until it does only the server's own token may call it."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.routing import BaseRoute

from ckptd.hashing import chunk_id
from ckptd.server.app import create_app
from ckptd.server.auth import UNDECLARED, Needs
from ckptd.server.routing import ApiRoute
from ckptd.server.settings import Settings
from ckptd.tokens import Grant, create_token
from tests.conftest import ServerProcess

# Routes that answer without a scope, each for a reason (docs/SECURITY.md).
OPEN = {
    "/healthz",  # ok/not ok and the version; details need a token
    "/livez",  # the process answers, and the version
    "/metrics",  # a global read token when CKPTD_METRICS_TOKEN_REQUIRED
    "/",  # the dashboard page holds no data
    "/static",
    "/openapi.json",
    "/docs",
    "/docs/oauth2-redirect",
    "/redoc",
}
ROOT_TOKEN = "root-admin-token"
JOB = "alpha"
OTHER = "beta"
# (job pattern, role) of each scoped token the server gets.
SCOPES = [
    ("alpha", "read"), ("alpha", "write"), ("alpha", "admin"),
    ("beta", "read"), ("beta", "write"), ("beta", "admin"),
    ("alp*", "write"), ("*", "read"),
]


def flat_routes(routes: list[BaseRoute]) -> Iterator[BaseRoute]:
    for route in routes:
        inner = getattr(route, "original_router", None)  # FastAPI's included routers
        if inner is not None:
            yield from flat_routes(inner.routes)
        else:
            yield route


def app_routes() -> list[tuple[str, str, Needs | None]]:
    """(method, path, declared scope) of every route of the application."""
    app = create_app(Settings(store="memory://"))
    found = []
    for route in flat_routes(app.routes):
        path = getattr(route, "path", "")
        if isinstance(route, ApiRoute):
            for method in sorted(route.methods or ()):
                found.append((method, path, route.scope))
        else:
            assert path in OPEN, f"{path} is not an ApiRoute and not a known open route"
    return found


def test_every_route_declares_a_scope() -> None:
    routes = app_routes()
    assert len(routes) >= 21
    undeclared = [(m, p) for m, p, needs in routes if needs is None]
    assert not undeclared, f"routes without a scope (add dependencies=scope(...)): {undeclared}"


@pytest.fixture(scope="module")
def scoped_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[
    tuple[ServerProcess, dict[tuple[str, str], str]]
]:
    tmp = tmp_path_factory.mktemp("scopes")
    tokens_file = tmp / "tokens.json"
    tokens = {scope: create_token(tokens_file, *scope)[0] for scope in SCOPES}
    srv = ServerProcess(store=tmp / "store", token=ROOT_TOKEN,
                        extra_args=["--tokens-file", str(tokens_file)])
    srv.start()
    try:
        yield srv, tokens
    finally:
        srv.stop()


def _concrete(path: str) -> str:
    values = {"{job}": JOB, "{step}": "1", "{rank}": "0", "{id}": chunk_id(b"x")}
    for k, v in values.items():
        path = path.replace(k, v)
    return path


def test_every_route_refuses_every_token_without_its_scope(
    scoped_server: tuple[ServerProcess, dict[tuple[str, str], str]],
) -> None:
    srv, tokens = scoped_server
    routes = app_routes()
    checked = 0
    with httpx.Client(base_url=srv.url, timeout=30.0) as client:
        for method, path, declared in routes:
            needs = declared or UNDECLARED
            url = _concrete(path)
            # The job a request acts for: the path's, or for chunks the X-Ckptd-Job
            # header's (chunks belong to no job in the URL).
            acts_for_job = ("{job}" in path and needs.on_path_job) or path.startswith("/v1/chunks")
            job = JOB if acts_for_job else None
            for (pattern, role), token in tokens.items():
                grant = Grant(id="t", job=pattern, role=role)  # type: ignore[arg-type]
                allowed = grant.may(needs.role, job) and (not needs.every_job or grant.every_job)
                r = client.request(
                    method, url,
                    headers={"Authorization": f"Bearer {token}", "X-Ckptd-Job": JOB,
                             "content-type": "application/json"},
                    content=b"{not json" if method in ("PUT", "POST") else None,
                )
                if allowed:
                    assert r.status_code not in (401, 403), (method, path, pattern, role,
                                                             r.status_code, r.text[:200])
                else:
                    assert r.status_code == 403, (method, path, pattern, role, r.status_code)
                    if method != "HEAD":
                        assert r.json()["code"] == "forbidden"
                checked += 1
            # No token, and a token nobody issued: 401 everywhere.
            for auth in ({}, {"Authorization": "Bearer ckptd_00000000_forged"}):
                r = client.request(method, url, headers=auth)
                assert r.status_code == 401, (method, path, auth, r.status_code)
            # The server's own token is admin of every job.
            # (A collection asked for here lists only, with no grace period to wait out;
            # other routes ignore the query.)
            r = client.request(method, url, headers=srv.headers(),
                               params={"dry_run": "true", "grace": "0"})
            assert r.status_code not in (401, 403), (method, path, r.status_code)
    assert checked == len(routes) * len(tokens)


def _client(srv: ServerProcess, token: str, job: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"}
    if job is not None:
        headers["X-Ckptd-Job"] = job
    return httpx.Client(base_url=srv.url, headers=headers, timeout=30.0)


def test_a_glob_token_must_name_its_job_for_chunks_and_only_within_its_pattern(
    scoped_server: tuple[ServerProcess, dict[tuple[str, str], str]],
) -> None:
    srv, tokens = scoped_server
    data = b"glob scoped chunk"
    cid = chunk_id(data)
    with _client(srv, tokens[("alp*", "write")]) as c:
        r = c.put(f"/v1/chunks/{cid}", content=data)
        assert r.status_code == 400 and "X-Ckptd-Job" in r.json()["message"]
        r = c.put(f"/v1/chunks/{cid}", content=data, headers={"X-Ckptd-Job": OTHER})
        assert r.status_code == 403
        r = c.put(f"/v1/chunks/{cid}", content=data, headers={"X-Ckptd-Job": "alpine"})
        assert r.status_code == 201


def test_job_listings_show_only_the_callers_jobs(
    scoped_server: tuple[ServerProcess, dict[tuple[str, str], str]],
) -> None:
    srv, tokens = scoped_server
    with _client(srv, ROOT_TOKEN) as root:
        for job in (JOB, OTHER):
            r = root.post(f"/v1/jobs/{job}/ranks/0/heartbeat", json={"world_size": 1})
            assert r.status_code == 200, r.text
    with _client(srv, tokens[("alpha", "read")]) as c:
        overview = c.get("/v1/overview").json()
        assert [j["job"] for j in overview["jobs"]] == [JOB]
        assert overview["store"] == ""  # where the store is: the operator's business
        assert c.get("/v1/overview", params={"job": OTHER}).status_code == 403
    with _client(srv, tokens[("*", "read")]) as c:
        names = [j["job"] for j in c.get("/v1/overview").json()["jobs"]]
        assert JOB in names and OTHER in names


def test_tokens_file_changes_count_while_the_server_runs(
    scoped_server: tuple[ServerProcess, dict[tuple[str, str], str]],
) -> None:
    import time

    from ckptd.tokens import list_tokens, revoke_token

    srv, _ = scoped_server
    tokens_file = Path(srv.extra_args[-1])
    token, entry = create_token(tokens_file, "gamma", "read")
    deadline = time.monotonic() + 10
    with _client(srv, token) as c:
        while c.get("/v1/jobs/gamma/steps").status_code != 200:
            assert time.monotonic() < deadline, "a new token was not accepted"
            time.sleep(0.2)
        assert revoke_token(tokens_file, entry.id)
        assert entry.id not in {e.id for e in list_tokens(tokens_file)}
        while c.get("/v1/jobs/gamma/steps").status_code != 401:
            assert time.monotonic() < deadline, "a revoked token still works"
            time.sleep(0.2)


def test_the_tokens_file_keeps_no_token(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    token, entry = create_token(path, "llm-*", "write")
    text = path.read_text()
    assert token not in text and token.split("_")[-1] not in text
    assert re.search(entry.sha256, text)
    assert path.stat().st_mode & 0o077 == 0


def test_ckptd_token_create_list_revoke(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from ckptd.cli import app
    from ckptd.tokens import TokenFile

    runner = CliRunner()
    path = tmp_path / "tokens.json"
    made = runner.invoke(app, ["token", "create", "--job", "llm-*", "--role", "write",
                               "--file", str(path)])
    assert made.exit_code == 0, made.output
    token = made.stdout.strip().splitlines()[0]
    assert token.startswith("ckptd_")
    grant = TokenFile(path).lookup(token)
    assert grant is not None and (grant.job, grant.role) == ("llm-*", "write")
    listed = runner.invoke(app, ["token", "list", "--file", str(path)])
    assert grant.id in listed.stdout and token not in listed.stdout
    # A user's mistake: one or two lines saying what to do, no traceback.
    for bad in (["--job", "llm/*", "--role", "write"], ["--job", "x", "--role", "owner"]):
        r = runner.invoke(app, ["token", "create", *bad, "--file", str(path)])
        assert r.exit_code == 2 and "Traceback" not in r.output
        assert len(r.output.strip().splitlines()) <= 3
    # (found by a probe: a file that is not there said "no token X in FILE")
    missing = runner.invoke(app, ["token", "revoke", grant.id, "--file",
                                  str(tmp_path / "elsewhere.json")])
    assert missing.exit_code == 2 and "no tokens file" in missing.output, missing.output
    assert TokenFile(path).lookup(token) is not None
    assert runner.invoke(app, ["token", "revoke", grant.id, "--file", str(path)]).exit_code == 0
    assert TokenFile(path).lookup(token) is None


# Words of ``ckptd token create --role``'s help, and the routes each one stands for.
ROLE_HELP_WORDS = {
    "rollback": [("POST", "/v1/jobs/{job}/rollback"), ("DELETE", "/v1/jobs/{job}/rollback")],
    "verify": [("POST", "/v1/jobs/{job}/verify")],
    "retention": [("POST", "/v1/jobs/{job}/forget")],
    "gc": [("POST", "/v1/gc"), ("POST", "/v1/gc/runs")],
    "scrub": [("POST", "/v1/scrub")],
    "heartbeats": [("POST", "/v1/jobs/{job}/ranks/{rank}/heartbeat")],
    "commits": [("POST", "/v1/jobs/{job}/steps/{step}/commit")],
}


def test_token_create_help_puts_each_operation_under_the_role_it_needs() -> None:
    """(found by a probe: --role's help put rollback under admin, where a write token
    may set and clear the marker: docs/SECURITY.md, "Tokens and scopes")"""
    from typer.testing import CliRunner

    from ckptd.cli import app

    out = " ".join(CliRunner().invoke(app, ["token", "create", "--help"]).output.split())
    role_help = out.split("--role", 1)[1].split(" --", 1)[0]
    said = dict(re.findall(r"\b(read|write|admin) \(([^)]*)\)", role_help))
    assert set(said) == {"read", "write", "admin"}, role_help
    needs = {(m, p): scope.role for m, p, scope in app_routes() if scope is not None}
    assert "rollback" in said["write"], role_help
    for word, routes in ROLE_HELP_WORDS.items():
        roles = {needs[route] for route in routes}
        assert len(roles) == 1, (word, roles)
        for role, text in said.items():
            assert (re.search(rf"\b{word}\b", text) is not None) <= (role in roles), (
                word, role, roles, role_help)
