"""`sparkctl watch`: supervise the service, restart the whole group when a rank, the head or a node fails.

The policy is sparkctl.rules.supervisor; its hands (SSH, Docker, the head's HTTP API) are
`orchestrate.watch.WatchOps`. Here: the signals' handling, the end's report.
"""

from __future__ import annotations

import signal
import sys

import click

from .. import signals
from ..errors import CheckFailed
from ..orchestrate.watch import WatchOps
from ..output import console, finish
from ..rules.supervisor import STOPPED, Policy, Supervisor
from .common import globals_of, one_replica, settings_of


@click.command("watch")
@click.pass_context
def watch_cmd(ctx: click.Context) -> None:
    """Supervise the service: a dead rank, a hung head or a lost node restarts the whole group.

    Runs in the foreground until a person runs `sparkctl down` (exit 0) or the restart budget is spent
    (WATCH_MAX_RESTARTS within WATCH_RESTART_WINDOW_S: the cluster is left down, exit 1). SIGINT,
    SIGTERM and SIGHUP end it with 128 + the signal's number, after it has published "stopped".
    """
    g = globals_of(ctx)
    s = one_replica(settings_of(g), "watch")
    policy = Policy.from_settings(s)
    out = console(True)  # progress lines go to stderr (a log); --json prints the end as one document
    ops = WatchOps(g.ssh_config_path(), s, policy, say=lambda m: out.print(m, markup=False))
    sup = Supervisor(ops, policy)
    # The first signal is the stop: the first one decides the status and the ones after it (`timeout`
    # sends SIGTERM twice: to the process and to its group) cannot cut the publish of "stopped" short.
    signals.end_on_first()
    try:
        ops.start()
        ops.say(f"watching cluster {s.cluster_name} ({' '.join(s.nodes)}): every {policy.interval_s:g}s, canary "
                f"every {policy.canary_every_s:g}s, at most {policy.max_restarts} restarts in {policy.window_s:g}s")
        code = sup.run()
    except KeyboardInterrupt as exc:
        signals.commit()  # already so for a signal (end_on_first); for any other KeyboardInterrupt too
        got = signals.received()
        signum = exc.signum if isinstance(exc, signals.Interrupted) else got[0] if got else signal.SIGINT
        sup.state, sup.detail = STOPPED, f"stopped by {signals.signal_name(signum)}"
        ops.say(f"{signals.signal_name(signum)}: stopping (publishing the stopped state; a further signal "
                "changes nothing)")
        ops.publish({"state": sup.state, "detail": sup.detail, "restarts": sup.restarts,
                     "last_reason": sup.last_reason})
        code = 128 + signum
    finally:
        ops.close()
    reason = sup.detail or sup.state
    if not g.json:
        ops.say(f"watch ends ({code}): {reason}")
    doc = {"exit": code, "state": sup.state, "reason": reason, "restarts": sup.restarts}
    if code:
        finish(g.json, doc, CheckFailed(f"watch ended: {reason}", exit_code=code, shown=True,
                                        fix=None if code > 128 else
                                        "the restart budget is spent and the cluster is down: `sparkctl logs` "
                                        "and `sparkctl diagnose` say why the ranks died; `sparkctl up` (or "
                                        "`sparkctl deploy --yes --supervise`) starts it again"))
    finish(g.json, doc)
    sys.exit(0)


COMMANDS = {"watch": watch_cmd}
