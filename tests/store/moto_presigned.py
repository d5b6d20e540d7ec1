"""moto's S3 server behind what S3 does with a presigned URL and moto does not: it
checks the URL's SigV4 signature (recomputed with botocore's own signer, not
ckptd's) and its expiry, and refuses with S3's 403 ``SignatureDoesNotMatch`` /
``AccessDenied: Request has expired``. One request at a time (as
``tests.cluster.moto_s3``), one bucket. Prints its URL.

    python -m tests.store.moto_presigned PORT BUCKET

Test controls: ``POST /__front/clock?skew=S`` moves the front's clock S seconds
ahead (a skewed or late object store: the URLs look expired); ``POST
/__front/tamper?key=K`` flips a byte of what a presigned GET of an object whose
key ends in K answers (bytes bad on the way, not at rest: the server's own reads
get the stored ones); ``GET /__front/count`` answers how many presigned GETs it
let through, as JSON."""

from __future__ import annotations

import datetime
import json
import logging
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qs

import boto3
from botocore.auth import S3SigV4QueryAuth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from moto import server as moto_server

from tests.store.test_s3 import _OneRequestAtATime

# Access key ids and their secrets (moto takes any; the front checks these).
SECRETS = {"testing": "testing", "ckptdpresignkey": "ckptd-presign-secret-0123456789"}


def expected_signature(method: str, host: str, path: str, query: str, secret: str
                       ) -> tuple[str | None, str]:
    """The signature S3 computes for a presigned request (botocore's signer), and
    the error code when the URL is not even well formed."""
    params = parse_qs(query, keep_blank_values=True)
    try:
        access, day, region, service, _ = params["X-Amz-Credential"][0].split("/")
        date, expires = params["X-Amz-Date"][0], int(params["X-Amz-Expires"][0])
    except (KeyError, ValueError):
        return "AuthorizationQueryParametersError", ""
    unsigned = "&".join(p for p in query.split("&") if not p.startswith("X-Amz-Signature="))
    request = AWSRequest(method=method, url=f"http://{host}{path}?{unsigned}",
                         headers={"host": host})
    request.context["timestamp"] = date
    token = params.get("X-Amz-Security-Token", [None])[0]
    auth = S3SigV4QueryAuth(Credentials(access, secret, token), service, region,
                            expires=expires)
    canonical = auth.canonical_request(request)
    return None, str(auth.signature(auth.string_to_sign(request, canonical), request))


class PresignedChecks:
    """WSGI middleware in front of moto: presigned requests are checked as S3 does."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app
        self.skew = 0.0
        self.passed = 0
        self.tamper: set[str] = set()
        self.lock = threading.Lock()

    def _answer(self, start_response: Any, status: str, body: bytes,
                kind: str = "application/xml") -> list[bytes]:
        start_response(status, [("Content-Type", kind), ("Content-Length", str(len(body)))])
        return [body]

    def _refuse(self, start_response: Any, code: str, message: str) -> list[bytes]:
        body = (f"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code>"
                f"<Message>{message}</Message></Error>").encode()
        return self._answer(start_response, "403 Forbidden", body)

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        query = environ.get("QUERY_STRING", "")
        if path == "/__front/clock":
            self.skew = float(parse_qs(query)["skew"][0])
            return self._answer(start_response, "200 OK", b"{}", "application/json")
        if path == "/__front/tamper":
            self.tamper.add(parse_qs(query)["key"][0])
            return self._answer(start_response, "200 OK", b"{}", "application/json")
        if path == "/__front/count":
            body = json.dumps({"presigned_gets": self.passed}).encode()
            return self._answer(start_response, "200 OK", body, "application/json")
        if "X-Amz-Signature=" not in query:
            return self.app(environ, start_response)
        params = parse_qs(query, keep_blank_values=True)
        try:
            date = datetime.datetime.strptime(params["X-Amz-Date"][0], "%Y%m%dT%H%M%SZ")
            expires = int(params["X-Amz-Expires"][0])
            access = params["X-Amz-Credential"][0].split("/")[0]
        except (KeyError, ValueError, IndexError):
            return self._refuse(start_response, "AuthorizationQueryParametersError",
                                "Query-string authentication version 4 requires ...")
        now = datetime.datetime.now(datetime.UTC).replace(tzinfo=None)
        if now + datetime.timedelta(seconds=self.skew) > date + datetime.timedelta(
                seconds=expires):
            return self._refuse(start_response, "AccessDenied", "Request has expired")
        secret = SECRETS.get(access)
        if secret is None:
            return self._refuse(start_response, "InvalidAccessKeyId",
                                "The AWS Access Key Id you provided does not exist")
        raw = environ.get("RAW_URI") or environ.get("REQUEST_URI") or path
        error, signature = expected_signature(environ["REQUEST_METHOD"], environ["HTTP_HOST"],
                                              raw.split("?", 1)[0], query, secret)
        if error is not None or signature != params["X-Amz-Signature"][0]:
            return self._refuse(start_response, error or "SignatureDoesNotMatch",
                                "The request signature we calculated does not match")
        with self.lock:
            self.passed += 1
        parts = list(self.app(environ, start_response))
        if any(path.endswith(k) for k in self.tamper) and parts and parts[0]:
            parts[0] = bytes([parts[0][0] ^ 0xFF]) + parts[0][1:]
        return parts


def main() -> None:
    port, bucket = int(sys.argv[1]), sys.argv[2]
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = moto_server.ThreadedMotoServer("127.0.0.1", port, verbose=False)
    server.start()
    inner = server._server.app  # type: ignore[union-attr]
    server._server.app = PresignedChecks(_OneRequestAtATime(inner))  # type: ignore[union-attr]
    url = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=url).create_bucket(Bucket=bucket)
    print(url, flush=True)
    threading.Event().wait()  # until killed


if __name__ == "__main__":
    main()
