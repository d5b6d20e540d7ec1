"""``ckptd healthcheck``: the container image's HEALTHCHECK. Asks the ``ckptd serve``
of this host for ``/healthz`` at the address, port and scheme its own settings give
(``CKPTD_HOST``, ``CKPTD_PORT``, ``CKPTD_TLS_CERT``), so a server moved to another
port or to https stays healthy; exit 0 when it answers ok, else 1 (Docker's
"unhealthy"; 2 is reserved there) with one line that says why."""

from __future__ import annotations

import ipaddress
import json
import ssl
import urllib.error
import urllib.request
from typing import Annotated

import typer

from ckptd.api import HEALTHZ
from ckptd.cli import app, console, err_console

WILDCARDS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


def probe_url(host: str, port: int, tls: bool) -> str:
    """The URL of the /healthz of a server bound to ``host``:``port`` (a wildcard
    address is reached on loopback)."""
    host = WILDCARDS.get(host, host)
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass  # a name
    return f"{'https' if tls else 'http'}://{host}:{port}{HEALTHZ}"


def _tls_context(cert: str) -> ssl.SSLContext:
    """Trusts the certificate the server serves: its own file is the anchor (a leaf
    too, through partial chains); the name is not checked, since loopback is not the
    name a certificate is issued for."""
    ctx = ssl.create_default_context(cafile=cert)
    ctx.check_hostname = False
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return ctx


def _unhealthy(url: str, why: str) -> None:
    err_console.print(f"unhealthy: {url}: {why}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(code=1)


@app.command("healthcheck")
def healthcheck(
    timeout: Annotated[float, typer.Option(min=0.1, help="Seconds to wait for the answer.")]
    = 3.0,
) -> None:
    """Exit 0 when this host's ckptd serve answers /healthz ok (its CKPTD_HOST,
    CKPTD_PORT and CKPTD_TLS_CERT say where): the container's HEALTHCHECK."""
    from pydantic import ValidationError

    from ckptd.server.settings import Settings

    try:
        settings = Settings()
    except ValidationError as exc:
        from ckptd.cli.mistakes import name_settings

        first = exc.errors()[0]
        where = "_".join(str(p) for p in first["loc"]).upper()
        # (A rule over several settings names none: its message names them.)
        what = f"CKPTD_{where}: " if where else ""
        message = name_settings(str(first["msg"]), ())
        _unhealthy("(no URL)", f"the server's settings are invalid: {what}{message}")
        return
    url = probe_url(settings.host, settings.port, settings.tls_cert is not None)
    context = None
    if settings.tls_cert is not None:
        try:
            context = _tls_context(settings.tls_cert)
        except (OSError, ssl.SSLError) as exc:
            _unhealthy(url, f"cannot read the certificate {settings.tls_cert}: {exc}")
    # No proxy: an image given HTTPS_PROXY for its object store sent this check for
    # its own loopback to the proxy (urllib bypasses only what NO_PROXY names).
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                         urllib.request.HTTPSHandler(context=context))
    try:
        with opener.open(url, timeout=timeout) as answer:
            body = json.loads(answer.read() or b"{}")
    except urllib.error.HTTPError as exc:
        _unhealthy(url, f"HTTP {exc.code} {exc.read()[:200].decode(errors='replace')}")
        return
    except (OSError, ValueError) as exc:  # refused, timed out, TLS refused, not JSON
        reason = getattr(exc, "reason", exc)
        _unhealthy(url, str(reason))
        return
    if body.get("status") != "ok":
        _unhealthy(url, f"status {body.get('status')!r}")
    console.print(f"healthy: {url} (ckptd {body.get('version', '?')})", markup=False,
                  highlight=False, soft_wrap=True)
