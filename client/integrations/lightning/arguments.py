"""The plugin's arguments, checked where they are given: Lightning calls a
``CheckpointIO`` first at its first save, after an epoch of training, where a
mistake in them surfaced before as an internal error of a class the user never
called."""

from __future__ import annotations

import contextlib
import difflib
import inspect
import math
import operator
from collections.abc import Mapping
from typing import Any

import torch

from ckptd.errors import InvalidRequest

from ...checkpointer import Checkpointer
from ...endpoint import check_url as endpoint_check_url

# What the plugin passes to the Checkpointer itself (the rest are the user's).
_OWN = frozenset({"self", "url", "job", "rank", "world_size", "token", "timeout"})


def check_url(url: str) -> str:
    """``url`` when it is one the ``Checkpointer`` opens; ``InvalidRequest`` in a line
    otherwise (the checkpointer's own check, ``client/endpoint.py``)."""
    return endpoint_check_url(url, "url")


def check_timeout(timeout: Any) -> float | None:
    """``timeout`` in seconds (None: no bound); ``InvalidRequest`` for anything else
    than a number above 0."""
    if timeout is None:
        return None
    if (isinstance(timeout, bool) or not isinstance(timeout, int | float)
            or not math.isfinite(timeout) or timeout <= 0):
        raise InvalidRequest(f"timeout must be seconds above 0 (or None: no bound), not "
                             f"{timeout!r}")
    return float(timeout)


def check_checkpointer_kwargs(kwargs: Mapping[str, Any]) -> None:
    """``InvalidRequest`` in a line for a keyword ``Checkpointer`` does not take, with
    the nearest one and every one it takes."""
    valid = sorted(set(inspect.signature(Checkpointer.__init__).parameters) - _OWN)
    for name in kwargs:
        if name in _OWN - {"self", "timeout"}:
            raise InvalidRequest(f"CkptdCheckpointIO: {name}= is the plugin's to set (rank 0 "
                                 "saves the whole checkpoint as a one-rank step), not yours")
        if name not in valid:
            near = difflib.get_close_matches(name, valid, n=1)
            hint = f"did you mean {near[0]}=? " if near else ""
            raise InvalidRequest(f"CkptdCheckpointIO got an unknown keyword {name}=: {hint}"
                                 f"it takes url, job, token, pointers, timeout, load_only and "
                                 f"the Checkpointer's {', '.join(valid)}")


def step_value(key: str, value: Any) -> int:
    """A checkpoint's ``global_step``/``step`` as an int: an int, an int-valued float
    (``500.0``) or a 0-d integer tensor; ``InvalidRequest`` for anything else."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and value.dim() == 0 and not value.dtype.is_floating_point \
                and not value.dtype.is_complex and value.dtype != torch.bool:
            value = int(value.item())
    elif isinstance(value, float) and value.is_integer():
        value = int(value)
    elif not isinstance(value, bool):
        with contextlib.suppress(TypeError):  # (a numpy integer)
            value = operator.index(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    shown = (f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
             if isinstance(value, torch.Tensor) else f"{value!r}"[:80])
    raise InvalidRequest(f"checkpoint[{key!r}] is {shown}: the ckptd step of a checkpoint is "
                         "a whole number >= 0 (an int, an int-valued float or a 0-d integer "
                         f"tensor); put one in {key!r}, or leave {key!r} out to take the "
                         "step after the job's latest")
