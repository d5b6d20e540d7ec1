"""What an S3 store's failures mean to whoever runs ckptd, and what to do: botocore's
errors (an AWS setting it cannot read, an endpoint that does not answer as S3) turned
into one line each, and the failures no retry can mend, failed at once."""

from __future__ import annotations

import os

from botocore.exceptions import (
    ConfigNotFound,
    ConfigParseError,
    InvalidConfigError,
    ProfileNotFound,
)

from ckptd.errors import InvalidRequest


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
