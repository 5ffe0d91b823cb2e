"""The fleet secret for the command line: one lookup for every command (docs/security.md).

From ``--token-file PATH``, else ``$GPUSD_TOKEN_FILE``, else ``$GPUSD_TOKEN``; never from a
command-line value, which ``ps`` shows to every local user (``--token VALUE`` is refused with a hint).
"""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

import argparse

from ..errors import ConfigError

# typing is not imported at run time: start-up time
TYPE_CHECKING = False

if TYPE_CHECKING:  # pragma: no cover
    from ..wire.signing import FleetKey

HINT = ("--token VALUE would show the fleet secret to every local user (ps): put it in a file only you can "
        "read and pass --token-file FILE, or set $GPUSD_TOKEN")


# how to make the secret, for every message that finds none (the recipe of docs/security.md)
MAKE_ONE = ("make one with: openssl rand -hex 32 > fleet.key && chmod 600 fleet.key, copy it to every host "
            "(each daemon: gpusd start --token-file fleet.key), then pass --token-file fleet.key "
            "or set $GPUSD_TOKEN_FILE (docs/security.md)")


class RefuseSecretOnArgv(argparse.Action):
    """``--token VALUE``: an error with the way to do it instead."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        parser.error(HINT)


def add_token_flags(p: argparse._ActionsContainer, what: str) -> None:
    p.add_argument("--token-file", metavar="FILE",
                   help=f"the fleet secret, read from FILE (mode 600; or $GPUSD_TOKEN_FILE, $GPUSD_TOKEN): {what}")
    p.add_argument("--token", nargs="?", action=RefuseSecretOnArgv, help=argparse.SUPPRESS)
    try:
        p.add_argument("--identity", metavar="FILE", dest="identity",
                       help="sign remote writes with this SSH key (like ssh -i; default: the first key of "
                            "ssh-agent, $SSH_AUTH_SOCK): the host attributes them to the account listing it")
    except argparse.ArgumentError:
        # the command has it already
        pass


def secret(args: argparse.Namespace) -> str | None:
    """The fleet secret for this command, or None.  ConfigError (exit 2) when it cannot be read."""
    import os

    identity = getattr(args, "identity", None)
    # for this process and the renewer it starts (wire.sshsig)
    if isinstance(identity, str) and identity:
        os.environ["GPUSD_IDENTITY"] = os.path.abspath(identity)
    if getattr(args, "token_file", None) is None and not os.environ.get("GPUSD_TOKEN_FILE") and not (
            os.environ.get("GPUSD_TOKEN") or "").strip():
        # none given (wire.signing.load_secret's three places): its module is not imported
        return None
    from ..errors import SecretError
    from ..wire.signing import load_secret

    try:
        return load_secret(getattr(args, "token_file", None))
    except SecretError as exc:
        raise ConfigError(str(exc)) from None


def fleet_key(args: argparse.Namespace) -> FleetKey | None:
    """The keys derived from this command's fleet secret, or None without one."""
    value = secret(args)
    if value is None:
        return None
    from ..wire.signing import FleetKey

    return FleetKey(value)
