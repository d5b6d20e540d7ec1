"""Hand-written tokens-file mistakes (found by a fresh-user probe: `ckptd serve
--tokens-file F --check` said "ok: would serve" for each): one line naming the file,
the entry and the problem, exit 2, from `serve --check` and `serve`; a running server
that reads such a file when it changes keeps its tokens and says so once."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from ckptd.tokens import create_token
from tests.conftest import ServerProcess
from tests.integration.test_cli_mistakes import assert_short_usage_error, ckptd

H0, H1 = "0" * 64, "1" * 64


def entry(id: str = "a1b2c3d4", sha256: str = H0, **more: Any) -> dict[str, Any]:
    return {"id": id, "job": "llm-a", "role": "read", "sha256": sha256, **more}


def document(*entries: dict[str, Any]) -> str:
    return json.dumps({"format": "ckptd.tokens", "version": 1, "tokens": list(entries)})


# (the file's text, what the one line must name besides the file)
MISTAKES = {
    "empty": ("", ["empty"]),
    "no-tokens": ('{"format": "ckptd.tokens", "version": 1}', ['no "tokens" list']),
    "same-id": (document(entry(), entry(sha256=H1)),
                ["token #1 (id 'a1b2c3d4')", "the id of token #0"]),
    "same-hash": (document(entry(), entry(id="e5f6a7b8")),
                  ["token #1 (id 'e5f6a7b8')", "the SHA-256 of token #0"]),
    "plaintext": (document(entry(token="ckptd_a1b2c3d4_secret")),
                  ["token #0 (id 'a1b2c3d4')", "plaintext", 'remove the "token" field']),
    "unknown-field": (document(entry(roles="admin")), ["token #0", "'roles'", "sha256"]),
    "not-an-object": (document("llm-a"), ["token #0", "not an object"]),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("check", [True, False], ids=["check", "serve"])
@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_hand_written_mistake_is_one_line(tmp_path: Path, mistake: str, check: bool) -> None:
    text, needles = MISTAKES[mistake]
    tokens = tmp_path / "tokens.json"
    tokens.write_text(text)
    done = ckptd("serve", "--store", str(tmp_path / "s"), "--port", "0", "--tokens-file",
                 str(tokens), *(["--check"] if check else []))
    assert_short_usage_error(done, str(tokens), *needles)
    assert "would serve" not in done.stdout
    assert " ".join(done.stderr.split()).count(str(tokens)) == 1, done.stderr  # (named once)


def test_a_pattern_with_a_star_inside_loads_with_a_warning(tmp_path: Path) -> None:
    """`ckptd token create` wrote such patterns before it refused them (309a337): a
    file with one still serves, and --check says how it matches."""
    tokens = tmp_path / "tokens.json"
    tokens.write_text(document(entry(job="x*y")))
    done = ckptd("serve", "--store", str(tmp_path / "s"), "--port", "0", "--tokens-file",
                 str(tokens), "--check")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    for needle in (str(tokens), "a1b2c3d4", "'x*y'", "glob", "revoke"):
        assert needle in lines[0], done.stderr


def test_token_create_into_a_file_touched_first(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.touch()
    _, made = create_token(tokens, "llm-*", "write")
    assert json.loads(tokens.read_text())["tokens"][0]["id"] == made.id


def test_token_create_says_the_directory_it_made(tmp_path: Path) -> None:
    """(Found by a probe: ``token create --file nodir/tokens`` made nodir without a
    word, so a mistyped directory went unseen.) Made, as ``serve --tokens-file``
    advises this command for a file not there, and said; not said when there."""
    done = ckptd("token", "create", "--job", "j", "--role", "read", "--file",
                 "nodir/sub/tokens", cwd=tmp_path)
    assert done.returncode == 0 and (tmp_path / "nodir" / "sub" / "tokens").is_file()
    assert "made directory nodir for nodir/sub/tokens (it was not there)" in done.stderr, \
        done.stderr
    done = ckptd("token", "create", "--job", "j", "--role", "read", "--file",
                 "nodir/sub/tokens", cwd=tmp_path)
    assert done.returncode == 0 and "made directory" not in done.stderr, done.stderr


def test_a_changed_file_with_a_mistake_keeps_the_tokens_and_says_so_once(
        tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.json"
    token, made = create_token(tokens, "llm-*", "read")
    srv = ServerProcess(store=tmp_path / "store", token="ADMIN",
                        extra_args=["--tokens-file", str(tokens)])
    srv.start()
    try:
        with httpx.Client(base_url=srv.url, timeout=10,
                          headers={"Authorization": f"Bearer {token}"}) as c:
            assert c.get("/v1/jobs/llm-a/steps").status_code == 200
            kept = json.loads(tokens.read_text())
            kept["tokens"][0]["token"] = token  # a plaintext written into the file
            tmp = tmp_path / "tokens.new"
            tmp.write_text(json.dumps(kept))
            os.replace(tmp, tokens)
            deadline = time.monotonic() + 10
            while "not reloaded" not in srv.log():
                assert time.monotonic() < deadline, srv.log()
                assert c.get("/v1/jobs/llm-a/steps").status_code == 200
                time.sleep(0.2)
            for _ in range(12):  # (the server looks at the file once a second)
                assert c.get("/v1/jobs/llm-a/steps").status_code == 200
                time.sleep(0.25)
    finally:
        srv.stop()
    said = [line for line in srv.log().splitlines() if "not reloaded" in line]
    assert len(said) == 1, srv.log()
    assert str(tokens) in said[0] and made.id in said[0] and "plaintext" in said[0]
    assert token not in srv.log()
