"""What ``ckptd gc`` says and how it follows a collection: through a server (started
in the background, polled), or run here on a store (stopped by Ctrl-C or SIGTERM,
which hands the lease back)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckptd.cli import _human, console, err_console

if TYPE_CHECKING:
    from ckptd.client.transport_http import SyncTransport
    from ckptd.lifecycle.gc import GcProgress


class _NoSpinner:
    """Stands in for rich's status where stderr is no terminal (a log keeps the lines)."""

    def update(self, text: str) -> None:
        pass


def spinner(text: str) -> contextlib.AbstractContextManager[Any]:
    """A rich status on stderr in a terminal; nothing elsewhere."""
    return err_console.status(text) if err_console.is_terminal else contextlib.nullcontext(
        _NoSpinner())


def say(text: str) -> None:
    err_console.print(text, highlight=False, soft_wrap=True, markup=False)


def say_state(state: dict[str, Any], dry_run: bool) -> None:
    """One line when the store's GC state is damaged: a collection rewrites it (a
    dry run does not), first holding saves one lease."""
    if state.get("phase") != "damaged":
        return
    if dry_run:
        say(f"note: {state.get('note')} (a dry run leaves it)")
    else:
        say(f"the store's GC state is damaged, and saves fail until this collection takes "
            f"it over: {state.get('note')}")


def say_run(run: Any, joined: bool, asked: float | None) -> None:
    """One line on stderr: the collection followed, and the grace period it waits out."""
    left = max(0.0, run.started_at + run.grace - time.time())
    if joined:
        say(f"a collection is already under way on the server (grace {run.grace:g} s"
            + (f", not the {asked:g} s asked" if asked is not None and asked != run.grace else "")
            + f"); following it: {left:.0f} s of its grace period left")
    elif left > 0:
        say(f"collecting garbage: waiting out the {run.grace:g} s grace period (saves in "
            f"flight finish meanwhile), {left:.0f} s left")


def outcome(now: Any, run: Any, what: str, again: str) -> Any | None:
    """A background ``run``'s report once ``now`` (its status) says it ended (its error
    raised), None while it runs; ``Unavailable`` once the server answering does not
    know it (the one running it stopped or restarted, or another replica answers)."""
    from ckptd.errors import Unavailable, from_json

    ended = now.last_run if now.last_run is not None and now.last_run.id == run.id else None
    if ended is not None:
        if ended.error is not None or ended.report is None:
            raise from_json(ended.error or {"code": "internal",
                                            "message": f"the {what} left no report"})
        return ended.report
    if now.running is None or now.running.id != run.id:
        # (its lease, if it held one, runs out and the next collection takes it over)
        raise Unavailable(f"the {what} {run.id} is not known to the server that answered: "
                          "the server running it stopped or restarted, or another replica "
                          f"answers now; `ckptd status` shows where the store stands, and {again}")
    return None


def polled(ask: Callable[[], Any], tries: int = 3) -> Any:
    """``ask()``'s answer, asked again a second later when it did not get through:
    the replica running the run may have gone under the poll (its connection reset,
    the call not retried: the CLI's calls are not), and the routing then asks the
    next, which says whether it knows the run (``outcome``)."""
    from ckptd.errors import Unavailable

    for left in range(tries - 1, -1, -1):
        try:
            return ask()
        except Unavailable:
            if not left:
                raise
            time.sleep(1.0)
    return None  # (not reached)


def follow(server: SyncTransport, run: Any, status: Any) -> Any:
    """Polls until the background collection ``run`` ended: its report (or error)."""
    while True:
        now = polled(server.gc_status)
        if (done := outcome(now, run, "collection", "`ckptd gc` again starts one")):
            return done
        left = now.running.started_at + now.running.grace - time.time()
        status.update(f"collecting garbage: waiting out the grace period, {left:.0f} s left"
                      if left > 0 else "collecting garbage: marking and sweeping")
        time.sleep(1.0)


def collect_remote(server: SyncTransport, dry_run: bool, grace: float | None,
                   doing: str) -> Any:
    """A collection on the server (a dry run answered at once), followed here."""
    import typer

    before = server.gc_status()
    say_state(before.state, dry_run)
    if dry_run:
        with spinner(doing):
            return server.gc(dry_run, grace)
    run = server.start_gc(grace)
    try:
        say_run(run, joined=before.running is not None and before.running.id == run.id,
                asked=grace)
        with spinner(doing) as status:
            return follow(server, run, status)
    except KeyboardInterrupt:
        say(f"interrupted: collection {run.id} goes on on the server; `ckptd gc` again "
            "follows it")
        raise typer.Exit(code=130) from None


async def collect_direct(repo: Any, dry_run: bool, grace: float | None, doing: str,
                         progress: GcProgress) -> Any:
    """A collection run here on the store (its lease: ``direct_lease``)."""
    from ckptd.lifecycle.gc import collect_garbage, direct_lease, gc_state

    say_state(await gc_state(repo.store), dry_run)
    with spinner(doing):
        report = await collect_garbage(
            repo.store, grace=600.0 if grace is None else grace, dry_run=dry_run,
            lease=direct_lease(repo.store), progress=progress)
    return dataclasses.asdict(report)


def say_stopped(progress: GcProgress, dry_run: bool) -> None:
    """The one line of a collection run here that Ctrl-C or SIGTERM stopped: what it
    did, and whether saves go on (its lease handed back) or wait, until when."""
    if dry_run:
        say("interrupted: a dry run changes nothing")
        return
    if not progress.generation:
        say("interrupted before the collection took the store's GC lease: nothing was deleted")
        return
    done = (f"after deleting {progress.deleted} chunks" if progress.deleted
            else "having deleted nothing")
    where = f"garbage collection {progress.generation} stopped while {progress.phase}, {done}"
    if progress.released:
        say(f"interrupted: {where}; its lease is handed back, so saves go on (`ckptd gc` "
            "again collects the rest)")
        return
    until = progress.live_until
    left = f"{until - time.time():.0f} s" if until is not None else "one lease"
    at = time.strftime(" (%H:%M:%S UTC)", time.gmtime(until)) if until is not None else ""
    why = (", with a delete the store may still carry out" if progress.unanswered
           else "; its lease could not be handed back")
    say(f"interrupted: {where}{why}: saves wait for its lease {left} more{at}, then "
        "`ckptd gc` takes it over")


def print_report(r: dict[str, Any], dry_run: bool) -> None:
    if dry_run:
        for cid in r["deleted"]:
            console.print(f"would delete chunk {cid}", soft_wrap=True)
    verb = "would free" if dry_run else "freed"
    console.print(
        f"GC {r['generation']}: {verb} {_human(r['bytes_freed'])} in {r['chunks_deleted']} "
        f"chunks; kept {r['chunks_kept']} of {r['chunks_total']} "
        f"({_human(r['bytes_total'] - r['bytes_freed'])}); {r['seconds']:.2f} s"
    )
