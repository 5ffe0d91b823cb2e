"""``gpusd notify``: tell me when N GPUs are free (docs/notify.md).  A thin client of :mod:`gpusd.notify`."""

# Imports inside functions: start-up (a command's own module).
from __future__ import annotations

import argparse
import sys

from ..errors import ConfigError

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from ..notify.deliver import Notice, Target


class _Said:
    """The target, and one line on stderr for each notice delivered."""

    def __init__(self, target: Target) -> None:
        self.target = target

    def deliver(self, n: Notice) -> None:
        from ..notify.deliver import summary

        self.target.deliver(n)
        print(f"gpusd notify: {summary(n)}; told {self.target.describe()}", file=sys.stderr, flush=True)

    def describe(self) -> str:
        return self.target.describe()


def notify(args: argparse.Namespace) -> int:
    from ..notify.deliver import target
    from ..notify.notifier import fleet_watch, local_watch, run
    from .options import to_constraints

    if not args.fleet and (args.host is not None or args.model is not None):
        raise ConfigError("--host and --model choose among the fleet's hosts: use them with --fleet")
    # every flag is checked (the target, its secret file) before anything is watched
    tgt = target(exec_=args.exec_, webhook=args.webhook, secret_file=args.webhook_secret_file, mail=args.mail,
                 smtp=args.smtp, mail_from=args.mail_from, webhook_timeout=args.webhook_timeout,
                 webhook_attempts=args.webhook_attempts)
    c = to_constraints(args)
    client = None
    if args.fleet:
        from ..notify.watch import pace_for
        from .pool import _client, _key, say_unverified

        client = _client(args, _key(args), pace_for(c))
        watch = fleet_watch(c, client, args.host, args.model)
        say_unverified(client.hosts)
    else:
        watch = local_watch(c, args.simulate)
    try:
        delivered = run(watch, _Said(tgt), repeat=args.repeat, timeout=args.timeout,
                        on_error=lambda exc: print(f"gpusd: {exc}", file=sys.stderr, flush=True))
    finally:
        watch.close()
        if client is not None:
            client.stop_listening()
    return 0 if delivered else 1


def _attempts(text: str) -> int:
    from .options import whole_number

    return whole_number(text, 1, 20, f"must be a whole number from 1 to 20, not {text!r}")


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", name: str) -> None:
    """The parser of ``gpusd notify``."""
    from . import options as o

    p = o.command(sub, name, "gpusd.cli.notify:notify",
                  "run a command, post a webhook or send a mail when N GPUs are free; takes no lease",
                  parents=[o.constraints(wait=False), o.simulate(), o.host_filter(),
                           *o.fleet("needed with --fleet: only verified hosts are watched")])
    g = p.add_argument_group("what to do (one of)")
    g.add_argument("--exec", dest="exec_", metavar="CMD",
                   help="run CMD through the shell, with GPUSD_NOTIFY_HOST, _GPUS (indices), _UUIDS, _COUNT set")
    g.add_argument("--webhook", metavar="URL",
                   help="POST a JSON notice (schema gpusd-notify/1, docs/notify.md) to an http(s) URL")
    g.add_argument("--mail", metavar="ADDR", help="mail ADDR through the local sendmail (or --smtp)")
    g = p.add_argument_group("delivery")
    g.add_argument("--webhook-secret-file", metavar="FILE",
                   help="sign the POST: X-Gpusd-Signature, HMAC-SHA256 with the key in FILE (chmod 600)")
    g.add_argument("--webhook-timeout", type=o.positive_seconds, default=5.0, metavar="S",
                   help="each try waits S seconds at most for the receiver's answer (default 5)")
    g.add_argument("--webhook-attempts", type=_attempts, default=4, metavar="N",
                   help="tries at most, with a doubling back-off from 0.5 s (default 4)")
    g.add_argument("--smtp", metavar="HOST[:PORT]", help="with --mail: send through this mail server (default: "
                   "the local sendmail)")
    g.add_argument("--mail-from", metavar="ADDR", help="with --mail: the sender (default USER@HOSTNAME)")
    g = p.add_argument_group("when")
    g.add_argument("--fleet", action="store_true",
                   help="on any verified host of the fleet (N GPUs on one host, as gpusd reserve chooses)")
    g.add_argument("--timeout", type=o.positive_seconds, metavar="DUR",
                   help="give up after DUR (90s, 15m, 2h) without a notice (exit 5)")
    g.add_argument("--repeat", action="store_true",
                   help="keep watching: tell again each time the GPUs become free again")
