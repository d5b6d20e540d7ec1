"""``ckptd serve --check`` over a store whose own documents or path are wrong (found
by an operator probe): a store id that does not read was "ok: would serve" with no
word (the server only logs it as it starts), and a store path that is a file was
"cannot create store directory ...: [Errno 17] File exists"."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.integration.test_cli_mistakes import assert_short_usage_error, ckptd

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden-v1"


def _checked_with_garbage_at(tmp_path: Path, key: str) -> tuple[Path, str]:
    """``serve --check`` of a copy of the golden store whose ``key`` holds garbage:
    the store, and what it said on stderr (it must still say it would serve)."""
    root = tmp_path / "store"
    shutil.copytree(GOLDEN, root)
    (root / key).parent.mkdir(parents=True, exist_ok=True)
    (root / key).write_text("garbage\n")
    done = ckptd("serve", "--check", "--store", str(root), "--port", "0")
    assert done.returncode == 0 and "ok: would serve" in done.stdout, done.stdout + done.stderr
    return root, " ".join(done.stderr.split())


def test_a_store_id_that_does_not_read_is_said_with_the_way_out(tmp_path: Path) -> None:
    root, said = _checked_with_garbage_at(tmp_path, "cluster/store-id")
    assert "warning" in said and "cluster/store-id does not parse" in said, said
    assert "remove cluster/store-id" in said and "Traceback" not in said, said
    # A store without an id yet (the first server writes it) is no warning.
    (root / "cluster" / "store-id").unlink()
    done = ckptd("serve", "--check", "--store", str(root), "--port", "0")
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_a_store_path_that_is_a_file_is_named_as_one(tmp_path: Path) -> None:
    file = tmp_path / "a-file"
    file.write_text("")
    for store in (str(file), f"file://{file}"):
        done = ckptd("serve", "--check", "--store", store, "--port", "0")
        assert_short_usage_error(done, f"the store {store} is a file, not a directory",
                                 "--store")


def test_a_damaged_gc_state_is_said_with_the_way_out(tmp_path: Path) -> None:
    """(Found by an operator probe: serve --check said ok while every save failed on
    it; helper-78 made `ckptd gc` through a server repair it.)"""
    _, said = _checked_with_garbage_at(tmp_path, "gc/state")
    assert "warning damaged document gc/state" in said and "`ckptd gc`" in said, said


@pytest.mark.parametrize("variable, value", [("CKPTD_MAX_MANIFEST_BYTES", "abc"),
                                             ("CKPTD_CLAIM_LEASE", "abc"),
                                             ("CKPTD_MALLOC_MMAP_THRESHOLD", "-1")])
def test_a_bad_variable_the_server_reads_as_it_serves_fails_the_check(
        tmp_path: Path, variable: str, value: str) -> None:
    """(Found by a probe of the docs.) ``serve --check`` said "ok: would serve", and
    the server then failed every save with a 400 naming the variable as the rank's
    (or refused to start after the check passed)."""
    done = ckptd("serve", "--check", "--store", str(tmp_path / "store"), "--port", "0",
                 env={variable: value})
    assert_short_usage_error(done, variable)



def test_a_store_not_there_yet_is_not_made_by_the_check(tmp_path: Path) -> None:
    """(Found by a probe: ``serve --check --store /mistyped/path`` said it would serve
    and left an empty store there, the check's own writes.)"""
    new = tmp_path / "typo" / "store"
    done = ckptd("serve", "--check", "--store", str(new), "--port", "0")
    assert done.returncode == 0, done.stderr
    said = " ".join(done.stdout.split())
    assert f"ok: would serve file://{new} (not there yet: serve makes it" in said, said
    assert list(tmp_path.iterdir()) == [], list(tmp_path.rglob("*"))
    file = tmp_path / "a-file"
    file.write_text("")
    done = ckptd("serve", "--check", "--store", str(file / "store"), "--port", "0")
    assert_short_usage_error(done, f"cannot create store directory {file / 'store'}",
                             f"{file} is not a directory")


def test_a_bad_network_is_named_once(tmp_path: Path) -> None:
    """(Found by a probe: the value was said twice, "'x' does not appear to be an IPv4
    or IPv6 network (got 'x')".)"""
    done = ckptd("serve", "--check", "--store", str(tmp_path / "store"), "--port", "0",
                 env={"CKPTD_PEER_NETWORKS": "10.0.0.0/33"})
    assert_short_usage_error(done, "CKPTD_PEER_NETWORKS", "10.0.0.0/33")
    assert done.stderr.count("10.0.0.0/33") == 1, done.stderr
