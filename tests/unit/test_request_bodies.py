"""The server's request bodies are validated without a word in its log: FastAPI
wraps each body model in a field of its own, and a model built at its first use
(pydantic's ``defer_build``) made pydantic warn, at the first request, about the
alias FastAPI had set (found in the suite's warnings summary; a server printed it
to its log once per process)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

ROUTES = [  # every route that takes a JSON body
    "/v1/chunks/missing",
    "/v1/chunks/read",
    "/v1/jobs/j/steps/1/commit",
    "/v1/jobs/j/ranks/0/heartbeat",
    "/v1/jobs/j/snapshot-requests",
    "/v1/jobs/j/rollback",
    "/v1/jobs/j/tags/best",
]


def test_the_first_request_of_each_body_route_warns_of_nothing() -> None:
    # A fresh process: a body's field is built once per process, so a warning comes
    # once, and only where no other test built it first.
    code = textwrap.dedent("""
        import sys, warnings
        warnings.simplefilter("error")
        from fastapi.testclient import TestClient
        from ckptd.server.app import create_app
        from ckptd.store import MemoryStore
        with TestClient(create_app(store=MemoryStore())) as client:
            for path in sys.argv[1:]:
                method = client.put if path.endswith("/best") else client.post
                answer = method(path, json={"unexpected": True})
                assert answer.status_code in (400, 404, 422), (path, answer.text)
                print(path, answer.status_code)
    """)
    done = subprocess.run([sys.executable, "-c", code, *ROUTES], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(done.stdout.splitlines()) == len(ROUTES), done.stdout
