"""Presigned S3 GET URLs (AWS Signature Version 4, query-string authentication),
made in bulk: a restore plan carries one per chunk of a rank's manifest, so that
the rank reads its chunks straight from the object store.

botocore signs one URL in 0.2-0.3 ms (its request pipeline, per URL); this
derives the signing key once per batch and costs one SHA-256 and one HMAC per
URL (~15 us). ``tests/store/test_s3_presign.py`` checks it against botocore's
own ``S3SigV4QueryAuth``. What the URL carries: the access key id, the scope
(date, region, service), the expiry and the signature, plus the session token
for temporary credentials (useless without the secret, which never leaves)."""

from __future__ import annotations

import datetime
import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

ALGORITHM = "AWS4-HMAC-SHA256"
MAX_EXPIRES = 7 * 24 * 3600  # SigV4's own limit on X-Amz-Expires


@dataclass(frozen=True, slots=True)
class SigningKey:
    """What signs: an access key and its secret (and session token), for a region."""

    access_key: str
    secret_key: str
    region: str
    token: str | None = None
    service: str = "s3"


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode("utf-8"), hashlib.sha256).digest()


def _q(text: str, safe: str = "-_.~") -> str:
    return quote(text, safe=safe)


def presign_get(
    key: SigningKey,
    urls: Iterable[str],
    expires_in: int,
    now: datetime.datetime | None = None,
) -> list[str]:
    """Each of ``urls`` (an object's plain URL: scheme, host, path) signed for a
    ``GET`` that works for ``expires_in`` seconds from ``now`` (default: the
    current UTC time)."""
    if not 1 <= expires_in <= MAX_EXPIRES:
        raise ValueError(f"expires_in {expires_in} must be in [1, {MAX_EXPIRES}]")
    now = now or datetime.datetime.now(datetime.UTC)
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    day = amz_date[:8]
    scope = f"{day}/{key.region}/{key.service}/aws4_request"
    signing = _hmac(_hmac(_hmac(_hmac(f"AWS4{key.secret_key}".encode(), day), key.region),
                          key.service), "aws4_request")
    params = {
        "X-Amz-Algorithm": ALGORITHM,
        "X-Amz-Credential": f"{key.access_key}/{scope}",
        "X-Amz-Date": amz_date,
        "X-Amz-Expires": str(int(expires_in)),
        "X-Amz-SignedHeaders": "host",
    }
    if key.token:
        params["X-Amz-Security-Token"] = key.token
    query = "&".join(f"{_q(k)}={_q(v)}" for k, v in sorted(params.items()))
    head = f"{ALGORITHM}\n{amz_date}\n{scope}\n"
    out = []
    for url in urls:
        parts = urlsplit(url)
        host = _canonical_host(parts.scheme, parts.hostname or "", parts.port)
        path = _q(parts.path or "/", safe="/~")  # S3: encoded once, never normalized
        canonical = f"GET\n{path}\n{query}\nhost:{host}\n\nhost\nUNSIGNED-PAYLOAD"
        digest = hashlib.sha256(canonical.encode("utf-8")).hexdigest()
        signature = hmac.new(signing, (head + digest).encode("utf-8"), hashlib.sha256).hexdigest()
        out.append(f"{parts.scheme}://{host}{path}?{query}&X-Amz-Signature={signature}")
    return out


def _canonical_host(scheme: str, host: str, port: int | None) -> str:
    """The Host header as signed: the port only when it is not the scheme's own."""
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    if port is None or (scheme, port) in (("http", 80), ("https", 443)):
        return host
    return f"{host}:{port}"
