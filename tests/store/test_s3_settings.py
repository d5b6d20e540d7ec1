"""An S3 store's settings that a user got wrong (AWS_PROFILE, the AWS config file,
a CKPTD_* knob, credentials written into the store URL): one ``InvalidRequest`` that
says what to do, exit 2 from the CLI, never a traceback and never the secret; and
the URL a store prints, which opens the same store again. On moto's S3 server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("aiobotocore")
pytest.importorskip("moto.server")

from ckptd.errors import InvalidRequest, StoreError  # noqa: E402
from ckptd.store import S3Store, open_store  # noqa: E402
from tests.moto_server import s3_env  # noqa: E402
from tests.store import test_s3  # noqa: E402

BUCKET = test_s3.BUCKET
endpoint = test_s3.endpoint  # moto's S3 server, this module's own

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
SECRET = "supersecret123"


def ckptd(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptd", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=60,
                          env=s3_env(CKPTD_RETRIES="0", COLUMNS="200", **env))


def one_line(done: subprocess.CompletedProcess[str], *said: str) -> str:
    """The error a command printed: exit 2, no traceback, a line or two naming ``said``."""
    err = done.stderr.strip()
    assert done.returncode == 2, (done.returncode, err)
    assert "Traceback" not in err and len(err.splitlines()) <= 2, err
    for words in said:
        assert words in err, err
    return err


async def test_a_profile_that_is_not_there_is_one_invalid_request(
        endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_PROFILE", "nope")
    store = S3Store(BUCKET, "p", endpoint_url=endpoint)
    for _ in range(2):  # (the first store of a process reads the config apart)
        with pytest.raises(InvalidRequest) as info:
            await store.exists("k")
        assert "'nope' (AWS_PROFILE)" in str(info.value)
        assert info.value.detail == {"setting": "AWS_PROFILE"}
    await store.close()  # the open that failed is not raised again


async def test_a_config_file_that_does_not_parse_is_one_invalid_request(
        endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = tmp_path / "aws-config"
    config.write_text("[default\nregion = us-east-1\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    store = S3Store(BUCKET, "p", endpoint_url=endpoint)
    with pytest.raises(InvalidRequest) as info:
        await store.list_dir("")
    assert f"AWS config file {config} cannot be read" in str(info.value)
    await store.close()


async def test_a_ckptd_setting_out_of_range_is_named(
        endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """It read 'store_error: cannot open an S3 client'."""
    monkeypatch.setenv("CKPTD_RETRIES", "-1")
    store = S3Store(BUCKET, "p", endpoint_url=endpoint)
    with pytest.raises(InvalidRequest) as info:
        await store.exists("k")
    assert not isinstance(info.value, StoreError)
    assert info.value.detail == {"knob": "CKPTD_RETRIES"}
    await store.close()


def test_the_cli_says_a_wrong_profile_in_a_line_and_exits_2(endpoint: str) -> None:
    done = ckptd("ls", "--url", f"s3://{BUCKET}/prod?endpoint={endpoint}", AWS_PROFILE="nope")
    one_line(done, "AWS_PROFILE", "'nope'")


@pytest.mark.parametrize("url", [
    f"s3://AKIAXX:{SECRET}@{BUCKET}/prod",
    f"s3://{BUCKET}/prod?endpoint=http://admin:{SECRET}@127.0.0.1:9",
    f"s3://{BUCKET}/prod?region=x&endpoint=http://admin:{SECRET}@127.0.0.1:9&typo=1",
])
def test_credentials_in_the_url_are_refused_and_never_repeated(url: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        open_store(url)
    message = str(info.value)
    assert SECRET not in message and "admin" not in message and "AKIAXX" not in message
    assert "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE" in message
    with pytest.raises(InvalidRequest) as info:  # the class itself, given them
        S3Store(BUCKET, endpoint_url=f"http://admin:{SECRET}@127.0.0.1:9")
    assert SECRET not in str(info.value)


def test_the_cli_refuses_credentials_in_the_url_without_printing_them(endpoint: str) -> None:
    err = one_line(ckptd("ls", "--url", f"s3://AKIAXX:{SECRET}@{BUCKET}/prod?endpoint="
                         f"{endpoint}"), "AWS_PROFILE")
    assert SECRET not in err


def test_a_bad_bucket_name_says_what_a_bucket_name_is() -> None:
    """Not botocore's regexes at the first call."""
    with pytest.raises(InvalidRequest, match="letters, digits"):
        S3Store("my bucket!")
    S3Store("arn:aws:s3:us-east-1:123456789012:accesspoint:ckpt")  # access points pass


def test_the_url_a_store_prints_keeps_its_region(endpoint: str) -> None:
    """/healthz and the logs print describe(): a URL copied from there lost ?region=."""
    url = f"s3://{BUCKET}/a/b?endpoint={endpoint}&region=eu-west-1"
    store = open_store(url)
    assert store.describe() == url
    again = open_store(store.describe())
    assert isinstance(again, S3Store) and (again.endpoint_url, again.region) == (
        endpoint, "eu-west-1")
    only_region = open_store(f"s3://{BUCKET}/p?region=us-west-2")
    assert only_region.describe() == f"s3://{BUCKET}/p?region=us-west-2"
