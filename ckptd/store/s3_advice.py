"""What an S3 store's failures mean to whoever runs ckptd, and what to do: botocore's
errors (an AWS setting it cannot read, an endpoint that does not answer as S3) turned
into one line each, and the failures no retry can mend, failed at once."""

from __future__ import annotations

import os
import socket
from typing import Any
from urllib.parse import urlsplit

from botocore.exceptions import (
    ConfigNotFound,
    ConfigParseError,
    EndpointConnectionError,
    InvalidConfigError,
    NoCredentialsError,
    PartialCredentialsError,
    ProfileNotFound,
)
from botocore.exceptions import ConnectionError as BotoConnectionError
from botocore.exceptions import SSLError as BotoSSLError

from ckptd.errors import InvalidRequest

# An expired or refused session token (STS, SSO): 400 on AWS, not 403.
_BAD_TOKEN = frozenset({"ExpiredToken", "InvalidToken", "TokenRefreshRequired"})
_NO_SUCH_NAME = frozenset({socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)})


def aws_setting(exc: BaseException) -> InvalidRequest | None:
    """The AWS setting of this process that botocore could not read (``AWS_PROFILE``,
    the config files) and what to do, or None for any other failure."""
    if isinstance(exc, ProfileNotFound):
        files = (os.environ.get("AWS_CONFIG_FILE", "~/.aws/config") + ", "
                 + os.environ.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"))
        return InvalidRequest(
            f"AWS profile {exc.kwargs.get('profile')!r} (AWS_PROFILE) is in no AWS config "
            f"file ({files}): name a profile they hold, or unset AWS_PROFILE and give "
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY", setting="AWS_PROFILE")
    if isinstance(exc, ConfigParseError | ConfigNotFound):
        return InvalidRequest(
            f"AWS config file {exc.kwargs.get('path')} cannot be read ({exc}): fix it, or "
            "point AWS_CONFIG_FILE / AWS_SHARED_CREDENTIALS_FILE at one that reads",
            setting="AWS_CONFIG_FILE")
    if isinstance(exc, InvalidConfigError):
        return InvalidRequest(f"AWS configuration: {exc}", setting="AWS_CONFIG_FILE")
    return None


def unresolved_host(exc: BaseException) -> str | None:
    """The host of an endpoint whose name does not exist in DNS (not a resolver that
    failed for now: that may pass), else None."""
    if not isinstance(exc, EndpointConnectionError):
        return None
    os_error = getattr(exc.kwargs.get("error"), "os_error", None)
    if isinstance(os_error, socket.gaierror) and os_error.errno in _NO_SUCH_NAME:
        return urlsplit(str(exc.kwargs.get("endpoint_url", ""))).hostname
    return None


# What a TLS handshake says when it will fail the same way again: a plain-HTTP
# endpoint (OpenSSL 1.1 and 3 word it differently), a certificate not trusted. A
# handshake cut short (an EOF, a reset: a load balancer's) may pass on the next try.
_TLS_FOR_GOOD = ("wrong version number", "record layer failure", "packet length too long",
                 "unsupported protocol", "protocol version", "http request",
                 "certificate verify failed", "hostname mismatch")


def tls_for_good(exc: BaseException) -> bool:
    """Whether ``exc`` is a TLS handshake that failed for good (see above)."""
    if not isinstance(exc, BotoSSLError):
        return False
    inner = exc.kwargs.get("error")
    if getattr(inner, "certificate_error", None) is not None:
        return True
    said = f"{exc} {inner}".lower().replace("_", " ")
    return any(words in said for words in _TLS_FOR_GOOD)


def never_retried(caught_exception: BaseException | None = None, **_: Any) -> None:
    """A ``needs-retry`` handler run before botocore's own: a TLS handshake that
    failed for good (https:// at a plain-HTTP endpoint, an untrusted certificate) or a
    host name that does not exist fails the same way on every attempt, so the call
    fails now, not after them."""
    if caught_exception is not None and (
            tls_for_good(caught_exception) or unresolved_host(caught_exception)):
        raise caught_exception


def answer_hint(op: str, code: str, status: int, bucket: str, endpoint: str | None) -> str:
    """What to do about an error an endpoint answered to ``op`` (S3's code and HTTP
    status), in parentheses; empty when there is nothing to add."""
    if code == "NoSuchBucket":
        return f" (bucket {bucket!r} does not exist)"
    if code in _BAD_TOKEN:
        return (" (the session token, AWS_SESSION_TOKEN or the profile's, has expired or "
                "is not valid: refresh the credentials and run again)")
    if status == 403:
        return " (check the credentials and the bucket policy)"
    if status == 404 and op.startswith("List"):  # (S3 says NoSuchBucket, above)
        return (f" (a listing of bucket {bucket!r} answered 404 with no S3 error: "
                f"{endpoint or 'the endpoint'} does not look like an S3 API; check "
                "?endpoint= in the store URL)")
    return ""


def connection_hint(exc: Exception, endpoint: str | None) -> str:
    """What to do about a failure botocore had before any S3 answered."""
    if isinstance(exc, NoCredentialsError | PartialCredentialsError):
        return ("; give this process credentials (AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or an instance role)")
    if isinstance(exc, BotoSSLError) and endpoint and endpoint.startswith("https://") and (
            getattr(exc.kwargs.get("error"), "certificate_error", None) is None):
        return (f"; no TLS handshake with {endpoint}: if that S3 speaks plain HTTP, give "
                f"?endpoint=http://{endpoint.removeprefix('https://')}")
    if (host := unresolved_host(exc)) is not None:
        return (f"; host name {host!r} does not resolve (no such name in DNS): check "
                "?endpoint= in the store URL")
    if isinstance(exc, BotoConnectionError):
        where = endpoint or "AWS's S3 (no ?endpoint= in the store URL)"
        return (f"; nothing answered at {where}: check that this host reaches it, and "
                "for an S3 other than AWS's give its address as "
                "s3://bucket/prefix?endpoint=http://host:port")
    return ""
