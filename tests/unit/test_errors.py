"""The typed error tree: stable codes, one HTTP status each, JSON round trips."""

from __future__ import annotations

import builtins

import pytest

from ckptd import errors
from ckptd.errors import (
    ERRORS_BY_CODE,
    HTTP_STATUS,
    CkptdError,
    NotFound,
    from_json,
    http_status,
)


def all_error_classes() -> list[type[CkptdError]]:
    found: list[type[CkptdError]] = []
    pending: list[type[CkptdError]] = [CkptdError]
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return [c for c in found if c.__module__ == "ckptd.errors"]


def test_every_code_has_a_class_and_every_class_a_status() -> None:
    classes = all_error_classes()
    codes = [c.code for c in classes]
    assert len(codes) == len(set(codes)), "two classes share a code"
    assert set(codes) == set(HTTP_STATUS)
    for code in HTTP_STATUS:
        assert ERRORS_BY_CODE[code].code == code


def test_codes_are_snake_case_and_statuses_are_http() -> None:
    for code, status in HTTP_STATUS.items():
        assert code.replace("_", "").isalpha() and code == code.lower()
        assert 400 <= status < 600


def test_statuses_of_families() -> None:
    for cls in all_error_classes():
        status = http_status(cls.code)
        # (a stored document of a newer format is the server's to upgrade, not the
        # caller's mistake; it is still an UnsupportedFormat to the client)
        if issubclass(cls, errors.InvalidRequest) and cls not in (
                errors.TooLarge, errors.UnsupportedStoredFormat, errors.UnsupportedMediaType,
                errors.LengthRequired, errors.MethodNotAllowed):
            assert status == 400, cls
        if issubclass(cls, NotFound):
            assert status == 404, cls
        if issubclass(cls, errors.ValidationFailed | errors.Conflict):
            assert status == 409, cls
        if issubclass(cls, errors.IntegrityError):
            assert status == 422, cls
    assert http_status("no_such_code") == 500
    assert issubclass(errors.UnsupportedStoredFormat, errors.UnsupportedFormat)
    assert http_status(errors.UnsupportedStoredFormat.code) == 500
    # (a body of another media type than JSON: the caller's, of its own status)
    assert http_status(errors.UnsupportedMediaType.code) == 415
    assert http_status(errors.LengthRequired.code) == 411  # (an upload without a length)
    assert http_status(errors.MethodNotAllowed.code) == 405  # (its Allow header says which)


@pytest.mark.parametrize("code", sorted(HTTP_STATUS))
def test_json_round_trip(code: str) -> None:
    cls = ERRORS_BY_CODE[code]
    err = cls("something happened", name="w", ranks=[0, 3])
    body = err.to_json()
    assert body == {
        "code": code,
        "message": "something happened",
        "detail": {"name": "w", "ranks": [0, 3]},
    }
    again = from_json(body)
    assert type(again) is cls
    assert again.code == code and again.message == "something happened"
    assert again.detail == {"name": "w", "ranks": [0, 3]}
    assert str(again) == "something happened"


def test_from_json_of_odd_bodies() -> None:
    unknown = from_json({"code": "from_the_future", "message": "hm"})
    assert type(unknown) is CkptdError and unknown.message == "hm"
    bare = from_json({}, fallback_status=502)
    assert type(bare) is CkptdError and "502" in bare.message
    odd = from_json({"code": "not_found", "message": "x", "detail": "just text"})
    assert isinstance(odd, NotFound) and odd.detail == {"detail": "just text"}


def test_stdlib_families() -> None:
    assert issubclass(NotFound, KeyError)
    assert str(NotFound("no object at k")) == "no object at k"  # not KeyError's quoting
    with pytest.raises(KeyError):
        raise errors.ChunkNotFound("gone")
    assert issubclass(errors.InvalidRequest, ValueError)
    assert issubclass(errors.UnsupportedFormat, errors.InvalidDocument)
    assert issubclass(errors.UnsupportedValue, TypeError)
    assert issubclass(errors.Timeout, builtins.TimeoutError)
    assert issubclass(errors.Unavailable, ConnectionError)
    assert issubclass(errors.StoreError, OSError)
    assert issubclass(errors.Unauthorized, PermissionError)
    assert issubclass(errors.Forbidden, PermissionError)
    assert issubclass(errors.ChunkHashMismatch, errors.IntegrityError)
    assert issubclass(errors.TilingGap, errors.ValidationFailed)
    assert issubclass(errors.MissingChunks, errors.ValidationFailed)
    assert issubclass(errors.AlreadyCommitted, errors.Conflict)


def test_the_codes_are_frozen() -> None:
    # Codes are append-only: a renamed or dropped code breaks every client that knows it.
    v1 = {
        "internal", "invalid_request", "invalid_name", "invalid_document",
        "unsupported_format", "unsupported_value", "too_large", "unauthorized", "forbidden",
        "not_found", "chunk_not_found", "manifest_not_found", "checkpoint_not_found",
        "job_not_found", "integrity", "chunk_hash_mismatch", "chunk_size_mismatch",
        "manifest_hash_mismatch", "validation_failed", "job_mismatch", "step_mismatch",
        "world_size_mismatch", "dtype_mismatch", "shape_mismatch", "shard_out_of_bounds",
        "tiling_gap", "tiling_overlap", "replica_mismatch", "missing_chunks", "conflict",
        "already_committed", "ref_conflict", "not_committed", "unavailable", "timeout",
        "store_error", "snapshot_skipped", "restore_failed", "chunk_layout_mismatch",
    }
    assert v1 <= set(HTTP_STATUS)


def test_from_json_keeps_a_detail_named_message() -> None:
    err = errors.from_json({"code": "conflict", "message": "m", "detail": {"message": "d"}})
    assert isinstance(err, errors.Conflict)
    assert err.message == "m" and err.detail == {"message": "d"}
