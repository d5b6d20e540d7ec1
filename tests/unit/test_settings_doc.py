"""docs/settings.md names every ``CKPTD_*`` variable the code reads, and only
those; its server table is the server's settings (flag, default, meaning). An
auditor found variables documented nowhere and flags documented that did not
exist (``--ingest-wait``, ``--scrub-replica``). ``python -m
tests.unit.test_settings_doc`` prints the server table as it should read."""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner

from ckptd.knobs import TEST_ONLY_PREFIX

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "settings.md"
NAME = re.compile(r"CKPTD_[A-Z0-9_]*[A-Z0-9]")
# Read by the test suite only (docs/development.md says so).
TEST_ONLY = re.compile(re.escape(TEST_ONLY_PREFIX))


def _names_in_code() -> set[str]:
    from server.settings import Settings

    names = {f"CKPTD_{field.upper()}" for field in Settings.model_fields}
    for package in ("ckptd", "client", "server"):
        for path in (ROOT / package).rglob("*.py"):
            names |= {m.group(0) for m in re.finditer(r"[\"']" + NAME.pattern + r"[\"']",
                                                       path.read_text())}
    for path in [*(ROOT / "deploy").rglob("*"), ROOT / "Dockerfile"]:  # ${CKPTD_IMAGE}
        if path.is_file():
            names |= set(re.findall(r"\$\{?(" + NAME.pattern + ")", path.read_text()))
    return {n.strip("\"'") for n in names if not TEST_ONLY.match(n.strip("\"'"))}


def _default(value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        unit = f"{value >> 30} GiB" if value % (1 << 30) == 0 else f"{value >> 20} MiB"
        return f"{value} ({unit})"
    return str(value)


def server_rows() -> list[str]:
    """The server table's rows, from ``server.settings.Settings`` and the flags
    ``ckptd serve --help`` shows."""
    from ckptd.cli import app
    from server.settings import Settings

    shown = CliRunner().invoke(app, ["serve", "--help"], terminal_width=300).output
    flags = set(re.findall(r"--[a-z][a-z-]*", shown))
    rows = []
    for field, info in Settings.model_fields.items():
        flag = "--" + field.replace("_", "-")
        meaning = (info.description or "").replace("|", "\\|")
        rows.append(f"| `CKPTD_{field.upper()}` | {f'`{flag}`' if flag in flags else ''} | "
                    f"{_default(info.default)} | {meaning} |")
    return rows


def test_every_variable_the_code_reads_is_on_the_page_and_no_other() -> None:
    on_page = set(NAME.findall(PAGE.read_text()))
    in_code = _names_in_code()
    assert not in_code - on_page, f"read, not in docs/settings.md: {sorted(in_code - on_page)}"
    assert not on_page - in_code, f"in docs/settings.md, read nowhere: {sorted(on_page - in_code)}"


def test_the_known_variables_are_those_the_code_reads() -> None:
    """``ckptd`` warns of a ``CKPTD_*`` variable it does not know (``CKPTD_RETENTON``,
    found by a probe: ignored without a word); what it knows is the server's settings
    and ``knobs.CLIENT_VARIABLES``, which must name every other variable read."""
    from ckptd.knobs import CLIENT_VARIABLES
    from server.settings import Settings

    server = {f"CKPTD_{field.upper()}" for field in Settings.model_fields}
    known = server | {f"CKPTD_{name}" for name in CLIENT_VARIABLES}
    in_code = _names_in_code()
    assert not in_code - known, f"read, not in CLIENT_VARIABLES: {sorted(in_code - known)}"
    assert not known - in_code, f"in CLIENT_VARIABLES, read nowhere: {sorted(known - in_code)}"


def test_the_server_table_is_the_servers_settings() -> None:
    page = PAGE.read_text().splitlines()
    start = page.index("| variable | flag | default | meaning |") + 2
    table = page[start:page.index("", start)]
    assert table == server_rows(), "regenerate: python -m tests.unit.test_settings_doc"


def test_every_variable_named_in_the_docs_exists() -> None:
    """A variable a page tells users to set that nothing reads does nothing."""
    known = set(NAME.findall(PAGE.read_text()))
    stray = {}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for name in set(NAME.findall(path.read_text())) - known:
            if not TEST_ONLY.match(name):
                stray.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not stray, f"named in the docs, read nowhere: {stray}"


if __name__ == "__main__":
    print("\n".join(server_rows()))


def test_replica_urls_are_server_urls() -> None:
    """(Found by a probe.) ``--advertise-url ftp://x`` and ``--peers http://a,ftp://b``
    passed ``ckptd serve --check``; every routed call then failed far from its cause."""
    import pytest
    from pydantic import ValidationError

    from server.settings import Settings

    for bad in ({"advertise_url": "ftp://x"}, {"peers": "http://a:1,ftp://b"},
                {"advertise_url": "http://a:1,http://b:2"}, {"peers": "http://a:notaport"}):
        with pytest.raises(ValidationError, match="host:port"):
            Settings(**bad)  # type: ignore[arg-type]
    good = Settings(peers="http://a:1,,http://b:2", advertise_url="https://a:1")
    assert good.peers == "http://a:1,,http://b:2" and good.advertise_url == "https://a:1"
