"""One contract for every server call (issue 13, item 4).

- Only the transport talks HTTP to a server: no module of the client or the CLI
  outside ``client/transport*.py``, ``client/calls.py`` and ``client/routing*.py``
  makes an httpx client or request, reaches into a transport's ``_request`` or
  ``_client``, or writes a server path (``/v1/...``, ``/healthz``) of its own. The
  peer-to-peer client and server (``client/peer/``) talk to peers, not the server.
- The client reads each answer with the very model the server's route answers with
  (``ckptd.api``, or the format's own documents).
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

from ckptd.client import calls
from ckptd.client.calls import Call, Reads
from ckptd.format import RankManifest

ROOT = Path(__file__).resolve().parents[2]
TRANSPORT = {"transport.py", "transport_http.py", "calls.py", "routing.py", "routing_sync.py"}
PEERS = ROOT / "client" / "peer"  # peer to peer: another protocol, another party
HTTPX_CALLS = {"Client", "AsyncClient", "get", "post", "put", "delete", "patch", "head",
               "request", "stream", "HTTPTransport", "AsyncHTTPTransport"}
PRIVATE = {"_request", "_client"}
SERVER_PATHS = ("/v1/", "/healthz")


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def hand_made_calls(source: str, name: str) -> list[str]:
    """What in ``source`` talks to a server behind the transport's back."""
    tree = ast.parse(source, name)
    docs = _docstrings(tree)
    out = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "httpx"
                and node.func.attr in HTTPX_CALLS):
            out.append(f"{name}:{line} calls httpx.{node.func.attr}")
        elif (isinstance(node, ast.ImportFrom) and node.module == "httpx"
              and any(a.name in HTTPX_CALLS for a in node.names)):
            out.append(f"{name}:{line} imports from httpx")
        elif isinstance(node, ast.Attribute) and node.attr in PRIVATE:
            if not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                out.append(f"{name}:{line} reaches into .{node.attr}")
            elif node.attr == "_request":
                out.append(f"{name}:{line} has a request method of its own")
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in docs and node.value.lstrip("^").startswith(SERVER_PATHS)):
            out.append(f"{name}:{line} writes the server path {node.value!r}")
    return out


def sources() -> list[Path]:
    client = [p for p in sorted((ROOT / "client").rglob("*.py"))
              if not (p.name in TRANSPORT and p.parent == ROOT / "client")
              and PEERS not in p.parents]
    return client + sorted((ROOT / "ckptd" / "cli").rglob("*.py"))


def test_only_the_transport_talks_http_to_the_server() -> None:
    found = [v for p in sources()
             for v in hand_made_calls(p.read_text(), str(p.relative_to(ROOT)))]
    assert found == []


@pytest.mark.parametrize("source", [
    "import httpx\nc = httpx.Client(base_url=u)\n",
    "import httpx\nr = httpx.get(u + '/healthz')\n",
    "from httpx import AsyncClient\n",
    "r = transport._request('GET', p)\n",
    "r = agent._client.get(p)\n",
    "class S:\n    def _request(self):\n        return self._request\n",
    "path = f'/v1/jobs/{job}/events'\n",
    "path = '/healthz'\n",
])
def test_the_checker_sees_each_way_around_the_transport(source: str) -> None:
    assert hand_made_calls(source, "x.py")


def test_the_checker_lets_docstrings_and_own_clients_be() -> None:
    source = ('"""Calls ``POST /v1/jobs/{job}/rollback``."""\n'
              "class A:\n    def f(self):\n        return self._client\n")
    assert hand_made_calls(source, "x.py") == []


# -- the client reads what the server answers, with the server's models --------------

_SAMPLES: dict[str, Any] = {
    "job": "j", "step": 3, "rank": 0, "ids": ["a" * 64], "claimer": None, "cid": "a" * 64,
    "body": {}, "size": 0, "meta": None, "timeout": 1.0, "reason": "r", "from_epoch": None,
    "params": {}, "replica": None, "dry_run": False, "keep_last": None, "grace": None,
    "budget_bytes": None, "name": "t", "step_time_s": 0.5,
    "manifest": RankManifest(job="j", step=3, rank=0, world_size=1, chunk_size=4096,
                             entries=[], tree=None),
}


def every_call() -> list[tuple[str, Call[Any]]]:
    out = []
    for name, fn in inspect.getmembers(calls, inspect.isfunction):
        if fn.__module__ != calls.__name__ or name.startswith("_"):
            continue
        if inspect.signature(fn).return_annotation.startswith("Call["):
            params = inspect.signature(fn).parameters
            out.append((name, fn(**{p: _SAMPLES[p] for p in params})))
    return out


@pytest.fixture(scope="module")
def openapi() -> dict[str, Any]:
    """The server's own account of its routes and the models they answer with."""
    from ckptd.server.app import create_app
    from ckptd.server.settings import Settings
    from ckptd.store.memory import MemoryStore

    doc: dict[str, Any] = create_app(Settings(), store=MemoryStore()).openapi()
    return doc


def operation(openapi: dict[str, Any], call: Call[Any]) -> dict[str, Any]:
    """The server's operation that answers ``call`` (the most literal path first)."""
    found = []
    for template, item in openapi["paths"].items():
        pattern = re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template))
        if re.fullmatch(pattern, call.path) and call.method.lower() in item:
            found.append((template.count("{"), item[call.method.lower()]))
    assert found, f"no route of the server answers {call.method} {call.path}"
    return min(found, key=lambda f: f[0])[1]


def answer_model(op: dict[str, Any]) -> str | None:
    """The name of the model the operation's success answer is, if one."""
    for status in ("200", "201", "202"):
        content = op["responses"].get(status, {}).get("content", {})
        ref = content.get("application/json", {}).get("schema", {}).get("$ref")
        if ref is not None:
            return str(ref.rsplit("/", 1)[1])
    return None


def test_every_call_of_the_client_is_a_route_of_the_server(openapi: dict[str, Any]) -> None:
    found = every_call()
    assert len(found) >= 29
    for _, call in found:
        operation(openapi, call)


# Read as bytes: the transport hashes a manifest against the commit record before
# the format's own reader (RankManifest.parse) sees it; a streamed verify is progress
# lines, then the report, read by calls.verify_report with VerifyResult.
RAW = {"get_manifest": "RankManifest", "verify_stream": "VerifyResult"}


def test_each_answer_is_read_with_the_routes_own_model(openapi: dict[str, Any]) -> None:
    import ckptd.api
    import ckptd.format

    checked = 0
    for name, call in every_call():
        declared = answer_model(operation(openapi, call))
        if declared is not None and RAW.get(name) == declared:
            continue
        if declared is None:
            assert not isinstance(call.read, Reads), name
            continue
        assert isinstance(call.read, Reads), f"{name} does not read the {declared} it gets"
        # The server's model of that name, in the core, is the one the client reads with.
        core = getattr(ckptd.api, declared, None) or getattr(ckptd.format, declared)
        assert call.read.model is core, (name, call.read.model, declared)
        checked += 1
    assert checked >= 20


def test_a_streamed_verify_report_is_read_with_the_routes_model() -> None:
    from ckptd.api import VerifyResult
    from ckptd.errors import InvalidDocument

    report = VerifyResult(job="j", steps=[1], chunks_checked=0, bytes_checked=0, bad_chunks=[],
                          missing_chunks=[], bad_manifests=[], ok=True)
    assert calls.verify_report(report.model_dump(mode="json")) == report
    with pytest.raises(InvalidDocument):
        calls.verify_report({"job": "j"})


def test_every_json_body_documents_its_refusals(openapi: dict[str, Any]) -> None:
    """A route that reads a JSON body refuses one sent as another media type (415)
    or over the limit (413), before it parses it (``server/routing.py``): its
    OpenAPI answers say so, for clients generated from the document."""
    bodies = 0
    for template, item in openapi["paths"].items():
        for method, op in item.items():
            if "application/json" not in op.get("requestBody", {}).get("content", {}):
                continue
            bodies += 1
            for status in ("413", "415"):
                assert status in op["responses"], f"{method.upper()} {template} lacks {status}"
                schema = op["responses"][status]["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/ErrorBody"}
    assert bodies >= 8
