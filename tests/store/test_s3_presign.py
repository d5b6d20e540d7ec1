"""The bulk SigV4 presigner (``ckptd.store.s3_presign``) signs exactly as botocore
does: same URL, same signature, for the same key, time and object."""

from __future__ import annotations

import datetime
from urllib.parse import parse_qs, urlsplit

import pytest

botocore_auth = pytest.importorskip("botocore.auth")

from botocore.awsrequest import AWSRequest  # noqa: E402
from botocore.credentials import Credentials  # noqa: E402

from ckptd.store.s3_presign import SigningKey, presign_get  # noqa: E402

NOW = datetime.datetime(2026, 11, 26, 22, 0, 26, tzinfo=datetime.UTC)
OBJECTS = [
    "http://127.0.0.1:9000/bucket/pre/fix/chunks/ab/" + "ab" * 32,
    "https://bucket.s3.eu-west-1.amazonaws.com/chunks/00/" + "0" * 64,
    "https://s3.example.com:8443/b/k~x/y.z_-",
    "http://minio.local/bucket/key",
]


def botocore_url(key: SigningKey, url: str, expires: int, monkeypatch: pytest.MonkeyPatch
                 ) -> str:
    monkeypatch.setattr(botocore_auth, "get_current_datetime",
                        lambda: NOW.replace(tzinfo=None))
    request = AWSRequest(method="GET", url=url)
    botocore_auth.S3SigV4QueryAuth(Credentials(key.access_key, key.secret_key, key.token),
                                   "s3", key.region, expires=expires).add_auth(request)
    return str(request.url)


@pytest.mark.parametrize("token", [None, "FwoGZXIvYXdzEB8aD/session+token="])
def test_presigned_urls_are_botocores(token: str | None, monkeypatch: pytest.MonkeyPatch
                                      ) -> None:
    key = SigningKey("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", "eu-west-1",
                     token)
    ours = presign_get(key, OBJECTS, 900, now=NOW)
    for url, signed in zip(OBJECTS, ours, strict=True):
        theirs = botocore_url(key, url, 900, monkeypatch)
        assert urlsplit(signed)._replace(query="") == urlsplit(theirs)._replace(query="")
        assert parse_qs(urlsplit(signed).query) == parse_qs(urlsplit(theirs).query)
        assert key.secret_key not in signed  # never the secret itself


def test_the_lifetime_is_bounded() -> None:
    key = SigningKey("a", "s", "us-east-1")
    for bad in (0, 7 * 24 * 3600 + 1):
        with pytest.raises(ValueError):
            presign_get(key, OBJECTS[:1], bad)
    (url,) = presign_get(key, OBJECTS[:1], 60)
    assert parse_qs(urlsplit(url).query)["X-Amz-Expires"] == ["60"]
