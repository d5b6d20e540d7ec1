"""``CKPTD_*`` variables set that ckptd does not read, said in a line each.

A misspelled setting was ignored without a word: ``CKPTD_TOKENS_FILES=tokens
CKPTD_RETENTON=retention.toml ckptd serve`` served every job to anyone and kept
every step, and ``serve --check`` said ok (found by an operator's probe). Only a
warning: a newer client's variable in an older server's environment must not stop it.
Every command says them (``ckptd.cli``), and a ``Checkpointer`` on rank 0 logs them
once (a training job's misspelled ``CKPTD_UPLOAD_CONCURENCY`` was as silent)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping

PREFIX = "CKPTD_"


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A line for each ``CKPTD_*`` name in ``environ`` that is no ckptd setting,
    naming the setting it is closest to, if one is close."""
    from ckptd.knobs import CLIENT_VARIABLES, TEST_ONLY_PREFIX

    names = sorted(n for n in environ if n.startswith(PREFIX) and not n.startswith(
        TEST_ONLY_PREFIX) and n.removeprefix(PREFIX) not in CLIENT_VARIABLES)
    if not names:  # (the usual case: the server's settings are not imported)
        return []
    from ckptd.server.settings import Settings

    known = sorted(CLIENT_VARIABLES | {f.upper() for f in Settings.model_fields})
    lines = []
    for name in names:
        bare = name.removeprefix(PREFIX)
        if bare in known:
            continue
        near = difflib.get_close_matches(bare, known, n=1, cutoff=0.75)
        hint = f" (did you mean {PREFIX}{near[0]}?)" if near else ""
        lines.append(f"{name} is not a ckptd setting{hint}")
    return lines
