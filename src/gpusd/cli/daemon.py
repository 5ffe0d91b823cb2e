"""``gpusd start|stop|status|demo``: the daemon's life cycle (see docs/daemon.md)."""

# Imports inside functions: start-up (a command's own module).
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from ..errors import EXIT_NO_DAEMON, AlreadyRunning, ConfigError

# start flag (dest) -> (the flag as shown, the key of DaemonConfig.options()); the flags left out
# (--foreground, --timeout, --state-dir, --token, -v) do not make another daemon
_COMPARED = {"interfaces": ("--interface", "interfaces"), "port": ("--port", "port"),
             "session": ("--session", "session"), "interval": ("--interval", "interval"),
             "history": ("--sample-window", "history"), "simulate": ("--simulate", "simulate"),
             "hostname": ("--hostname", "hostname"), "gpusd_compat": ("--gpusd-compat", "gpusd_compat"),
             "fleet": ("--fleet-view", "fleet"), "txt_interval": ("--txt-interval", "txt_interval"),
             "threshold": ("--threshold", "thresholds"), "thresholds": ("--thresholds", "thresholds"),
             "dcgm_metrics": ("--dcgm-metrics", "dcgm_metrics"), "user_metrics": ("--user-metrics", "user_metrics"),
             "record": ("--no-record", "no_record"), "retention": ("--retention", "retention_days"),
             "history_size": ("--history-size", "history_size_mib"), "idle_after": ("--idle-after", "idle_after"),
             "idle_release": ("--idle-release", "idle_release"), "idle_grace": ("--idle-grace", "idle_grace"),
             "slurm": ("--slurm", "slurm"), "slurm_controller": ("--slurm-controller", "slurm_controller"),
             "slurmctld": ("--slurmctld", "slurmctld"),
             # what the daemon trusts and where it serves (a second start with another secret, peers or
             # ports must not be told "already running" while the old ones stay in force)
             "token_file": ("--token-file", "secret"), "tls_port": ("--tls-port", "tls_port"),
             "peers": ("--peer", "peers"), "peers_file": ("--peers-file", "peers_file"),
             "dns_sd_domain": ("--dns-sd-domain", "dns_sd_domain"), "dns_server": ("--dns-server", "dns_server"),
             "lease_socket": ("$GPUSD_LEASE_SOCKET", "lease_socket")}


def _state_dir(args: argparse.Namespace) -> Path:
    """The state directory; ``--state-dir`` is passed on as ``$GPUSD_STATE_DIR`` (to the backends and
    to a background daemon)."""
    from ..identity import state_dir

    if getattr(args, "state_dir", None):
        os.environ["GPUSD_STATE_DIR"] = str(Path(args.state_dir).resolve())
    return state_dir()


def _config(args: argparse.Namespace, state: Path) -> Any:
    from ..daemon.config import DaemonConfig
    from .trust import secret

    token = secret(args)
    cfg = DaemonConfig(
        interfaces=args.interfaces,
        port=args.port,
        session=args.session,
        interval=args.interval,
        history=args.history,
        simulate=args.simulate,
        hostname=args.hostname,
        state_dir=state if os.environ.get("GPUSD_STATE_DIR") else None,
        gpusd_compat=args.gpusd_compat,
        token=token,
        tls_port=args.tls_port,
        fleet=args.fleet,
        txt_min_interval=args.txt_interval,
        thresholds=_rule_specs(args),
        dcgm_metrics=getattr(args, "dcgm_metrics", True),
        user_metrics=getattr(args, "user_metrics", False),
        record=getattr(args, "record", True),
        retention=getattr(args, "retention", 365.0) * 86400,
        history_size=int(getattr(args, "history_size", 1024.0) * 2**20),
        idle_after=getattr(args, "idle_after", 900.0),
        idle_release=getattr(args, "idle_release", False),
        idle_grace=getattr(args, "idle_grace", 900.0),
        rebalance=getattr(args, "rebalance", False),
        rebalance_policy=Path(args.rebalance_policy).resolve() if getattr(args, "rebalance_policy", None) else None,
        peers=getattr(args, "peers", None),
        peers_file=getattr(args, "peers_file", None),
        dns_sd_domain=getattr(args, "dns_sd_domain", None),
        dns_server=getattr(args, "dns_server", None),
        slurm=getattr(args, "slurm", False),
        slurm_controller=getattr(args, "slurm_controller", None),
        slurmctld=getattr(args, "slurmctld", None),
    )
    cfg.validate()
    return cfg


def _rule_specs(args: argparse.Namespace) -> list[str]:
    """The threshold rules of ``--threshold`` and ``--thresholds`` (files), parsed; without either, the
    rules' parser is not loaded (a daemon without rules never needs it: memory at rest)."""
    if not (args.threshold or args.thresholds):
        return []
    from ..thresholds import rule_specs

    return rule_specs(args.threshold or (), args.thresholds or ())


def _foreground_args(args: argparse.Namespace) -> list[str]:
    """The flags a background start passes on to its ``--foreground`` child (the token goes through
    the environment, not the command line, where ``ps`` would show it)."""
    out: list[str] = []
    for iface in args.interfaces or []:
        out += ["--interface", iface]
    out += ["--port", str(args.port), "--session", args.session, "--interval", str(args.interval),
            "--sample-window", str(args.history), "--fleet-view", args.fleet, "--txt-interval", str(args.txt_interval)]
    if not getattr(args, "record", True):
        out.append("--no-record")
    if getattr(args, "idle_release", False):
        out.append("--idle-release")
    if getattr(args, "rebalance", False):
        out.append("--rebalance")
    if getattr(args, "rebalance_policy", None):
        out += ["--rebalance-policy", str(Path(args.rebalance_policy).resolve())]
    out += ["--retention", str(getattr(args, "retention", 365.0)), "--history-size",
            str(getattr(args, "history_size", 1024.0)), "--idle-after", str(getattr(args, "idle_after", 900.0)),
            "--idle-grace", str(getattr(args, "idle_grace", 900.0))]
    if args.hostname:
        out += ["--hostname", args.hostname]
    for peer in getattr(args, "peers", None) or []:
        out += ["--peer", peer]
    for flag, name in (("--peers-file", "peers_file"), ("--dns-sd-domain", "dns_sd_domain"),
                       ("--dns-server", "dns_server")):
        if getattr(args, name, None):
            value = getattr(args, name)
            out += [flag, os.path.abspath(value) if name == "peers_file" else value]
    if args.tls_port is not None:
        out += ["--tls-port", str(args.tls_port)]
    if args.simulate:
        out += ["--simulate", args.simulate]
    if args.gpusd_compat:
        out.append("--gpusd-compat")
    if not args.dcgm_metrics:
        out.append("--no-dcgm-metrics")
    if getattr(args, "user_metrics", False):
        out.append("--user-metrics")
    for rule in _rule_specs(args):
        out += ["--threshold", rule]
    if args.verbose:
        out.append("-" + "v" * args.verbose)
    return out


def _given(args: argparse.Namespace) -> set[str]:
    """The ``gpusd start`` flags (dests) given on the command line, defaults left out."""
    argv = getattr(args, "_argv", None)
    if argv is None:
        return set()
    from . import _innermost, build_parser

    parser = build_parser("start")
    ns, _ = parser.parse_known_args(argv)
    sub = _innermost(parser, ns)
    for action in sub._actions:
        action.default = argparse.SUPPRESS
    ns, _ = parser.parse_known_args(argv)
    return set(vars(ns)) & set(_COMPARED)


def _given_by_environment(cfg: Any) -> set[str]:
    """Options given through the environment rather than flags: a secret ($GPUSD_TOKEN_FILE,
    $GPUSD_TOKEN), the lease socket ($GPUSD_LEASE_SOCKET)."""
    out = set()
    if cfg.token is not None:
        out.add("token_file")
    if os.environ.get("GPUSD_LEASE_SOCKET") is not None:
        out.add("lease_socket")
    return out


def _differences(args: argparse.Namespace, cfg: Any, running: Any, served: Any = None) -> list[str] | None:
    """The given options that differ from the running daemon's (None: its options are unknown);
    ``served``: what it serves (its info file: the ports it took)."""
    served = served if isinstance(served, dict) else {}
    given = _given(args) | _given_by_environment(cfg)
    if not given:
        return []
    if not isinstance(running, dict):
        return None
    wanted = cfg.options()
    out: list[str] = []
    seen: set[str] = set()
    for dest in sorted(given, key=list(_COMPARED).index):
        flag, key = _COMPARED[dest]
        new, old = wanted.get(key), running.get(key)
        if key == "interfaces":
            new, old = sorted(new or []), sorted(old or []) if isinstance(old, list) else old
        if key == "tls_port" and new is not None and new == served.get("tls_port"):
            # the port it took (the default is --port + 1): the same
            old = new
        if new == old or key in seen:
            continue
        seen.add(key)
        # a daemon older than the option: it cannot say, so it is not the same
        if key not in running:
            out.append(f"{flag} (the running daemon does not record it)")
        elif key == "secret":
            # never shown, not even its fingerprint: with or without, same or another
            out.append(f"{flag} (running: {'with another secret' if old else 'without a secret: trust is off'})"
                       if new else f"{flag} (running: with a secret)")
        elif isinstance(new, bool) or isinstance(old, bool):
            out.append(f"{flag} (running: {'with' if old else 'without'} it)")
        else:
            out.append(f"{flag} {_show(new)} (running: {_show(old)})")
    return out


def _show(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value)) or "none"
    return "default" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _stop_hint(state: Path) -> str:
    """``gpusd stop`` with what selects this daemon (``--state-dir``), under the name the user ran."""
    from ..daemon.process import stop_command
    from . import prog

    return prog() + stop_command(state)[len("gpusd"):]


def _already_running(args: argparse.Namespace, cfg: Any, st: Any) -> int:
    """A daemon already runs on this state directory: the same for a foreground and a background
    start.  The options given match its own: say so, exit 0.  They differ: refuse (exit 7)."""
    info = st.info
    where = (f"pid {st.pid}, serving {' '.join(info.get('urls') or []) or '?'}, session {info.get('session', '?')}, "
             f"state directory {st.state_dir}")
    diff = _differences(args, cfg, info.get("options"), info)
    if diff is None:
        raise AlreadyRunning(f"a daemon is already running ({where}) and its options are not recorded (an older "
                             "daemon, or one still starting), so the options given cannot be checked; stop it "
                             f"first ({_stop_hint(st.state_dir)}) to start with them")
    if diff:
        raise AlreadyRunning(f"a daemon is already running ({where}) with other options: {'; '.join(diff)}. "
                             f"Stop it first ({_stop_hint(st.state_dir)}), or give another --state-dir for a "
                             "second daemon")
    print(f"gpusd: already running ({where})")
    return 0


def print_unit(args: argparse.Namespace) -> int:
    """``gpusd start --print-unit [options]``: the systemd unit whose ExecStart= runs this install's gpusd
    with the options given (docs/daemon.md, "systemd"); nothing is started."""
    from ..daemon.process import unit_text

    argv = list(getattr(args, "_argv", None) or ["start"])
    words = [w for w in argv[argv.index("start") + 1 if "start" in argv else 0:] if w not in ("--print-unit",
                                                                                             "--foreground")]
    sys.stdout.write(unit_text([sys.executable, "-m", "gpusd", "start", "--foreground", *words]))
    return 0


def start(args: argparse.Namespace) -> int:
    if getattr(args, "print_unit", False):
        return print_unit(args)
    state = _state_dir(args)
    # one line, not a traceback, for a state directory that cannot be (/proc/x, a read-only disk)
    try:
        state.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create the state directory {state}: {exc.strerror or exc} "
                          "(give --state-dir DIR or $GPUSD_STATE_DIR)") from None
    cfg = _config(args, state)
    if args.hostname:
        os.environ["GPUSD_HOSTNAME"] = args.hostname
    from ..localdaemon import status as daemon_status

    st = daemon_status(state)
    if st.running:
        return _already_running(args, cfg, st)
    if args.foreground:
        from ..daemon import logs
        from ..daemon.process import run_foreground

        level = os.environ.get("GPUSD_LOG_LEVEL") or ("DEBUG" if args.verbose > 1 else "INFO")
        # rate-limited; a --log-file is rotated by size while running
        logs.setup(level, args.log_file)
        return run_foreground(cfg, args.ready_fd)

    from ..daemon import process
    from . import prog

    # so that its hints name the program the user ran
    env = dict(os.environ, GPUSD_PROG=prog())
    # the child takes exactly the secret read here
    env.pop("GPUSD_TOKEN_FILE", None)
    env.pop("GPUSD_TOKEN", None)
    if cfg.token:
        env["GPUSD_TOKEN"] = cfg.token
    info = process.spawn(_foreground_args(args), state, env=env, timeout=args.timeout)
    sim = "  [SIMULATED GPUs]" if info.get("simulated") else ""
    print(f"gpusd: started (pid {info.get('pid')}), announced as {info.get('service')}, "
          f"session {info.get('session')}, {process.serving_line(info)}{sim}")
    print(f"gpusd: log {state / process.LOG_FILE}; stop with: {_stop_hint(state)}")
    return 0


def stop(args: argparse.Namespace) -> int:
    from ..daemon import process

    state = _state_dir(args)
    pid = process.stop(state, timeout=args.timeout, force=args.force)
    print(f"gpusd: stopped (pid {pid})")
    return 0


def status(args: argparse.Namespace) -> int:
    from ..localdaemon import status as daemon_status

    state = _state_dir(args)
    st = daemon_status(state)
    live = _fetch_host(st.info) if st.running else None
    if args.json:
        out = {"running": st.running, "pid": st.pid, "state_dir": str(state), **st.info}
        if live is not None:
            out["host"] = live
        from ..sanitize import dumps

        print(dumps(out, indent=1))
        return 0 if st.running else EXIT_NO_DAEMON
    if not st.running:
        print(f"gpusd: not running (state directory {state})")
        return EXIT_NO_DAEMON
    info = st.info
    print(f"gpusd: running, pid {st.pid}, state directory {state}")
    if info:
        print(f"  service   {info.get('service')}  (session {info.get('session')}, node {info.get('node_id')})")
        print(f"  serving   {' '.join(info.get('urls') or [])}")
        if info.get("tls_port"):
            print(f"  https     {' '.join(info.get('tls_urls') or [])} port {info.get('tls_port')}, certificate "
                  f"{info.get('cert_fp')} (trust on)")
        print(f"  mDNS on   {', '.join(info.get('interfaces') or []) or 'all interfaces'}")
        auth = info.get("authority")
        if isinstance(auth, dict):
            from ..sanitize import for_terminal

            print(f"  leases    lease authority on {for_terminal(auth.get('socket'))}" if auth.get("serving") else
                  f"  leases    NOT the lease authority: {for_terminal(auth.get('why') or 'unknown', 300)} "
                  "(clients lease in the shared lock directory; docs/daemon.md)")
    if live is not None:
        snap = live.get("snapshot") or {}
        gpus = snap.get("gpus") or []
        sim = "  [SIMULATED GPUs]" if snap.get("simulated") else ""
        print(f"  GPUs      {len(gpus)}{sim}")
    elif info:
        print("  (the HTTP API did not answer)")
    return 0


def _fetch_host(info: dict[str, Any]) -> dict[str, Any] | None:
    """GET /api/v1/host from the running daemon (the one blocking GET helper, no aiohttp at start-up)."""
    from ..localdaemon import api_bases
    from ..wire.http import SourceError, fetch_json

    for base in api_bases(info):
        try:
            data = fetch_json(f"{base}/host", timeout=2).data
            return data if isinstance(data, dict) else None
        except SourceError:
            # down, not HTTP, or died mid-answer
            continue
    return None


# -- demo ------------------------------------------------------------------------------------------
DEMO_HOSTS = ["4xA100-80GB", "2xH100-80GB,2xRTX4090", "2xL40S", "8xA100-40GB", "1xH200-141GB", "4xRTX3090",
              "2xV100-32GB", "4xT4"]


def demo(args: argparse.Namespace) -> int:
    """Three daemons with simulated GPUs, bound to 127.0.0.1 (nothing leaves the machine), a
    discovery client bound likewise, and a live table; everything started is stopped at the end."""
    import asyncio
    import shutil
    import tempfile

    if not 1 <= args.hosts <= len(DEMO_HOSTS):
        raise ConfigError(f"--hosts must be between 1 and {len(DEMO_HOSTS)}")
    tmp = Path(tempfile.mkdtemp(prefix="gpusd-demo-"))
    # two demos on one machine do not see each other
    session = f"demo-{os.getpid()}"
    # filled as they start, so a failed or interrupted start stops those already running
    procs: list[Any] = []
    try:
        print(f"gpusd demo: starting {args.hosts} daemons with simulated GPUs on 127.0.0.1 (session {session}) ...",
              flush=True)
        _start_demo_daemons(tmp, session, args.hosts, procs)
        return asyncio.run(_demo_show(session, args))
    except KeyboardInterrupt:
        return 130
    finally:
        _stop_demo_daemons(procs)
        shutil.rmtree(tmp, ignore_errors=True)


def _start_demo_daemons(tmp: Path, session: str, n: int, procs: list[Any]) -> None:
    """Start ``n`` demo daemons and wait until each is announced; every process started is appended
    to ``procs`` at once (the caller stops them, also when this raises)."""
    import subprocess
    import time

    from ..daemon.process import _failure, _read_line

    pipes: list[tuple[Any, int, Path]] = []
    try:
        for i in range(1, n + 1):
            state = tmp / f"demo-{i}"
            state.mkdir()
            # simulated daemons are never this machine's lease authority (its leases are of real GPUs)
            env = dict(os.environ, GPUSD_STATE_DIR=str(state), GPUSD_INTERFACES="127.0.0.1", GPUSD_LEASE_SOCKET="off")
            env.pop("GPUSD_SIMULATE", None)
            r, w = os.pipe()
            argv = [sys.executable, "-m", "gpusd", "start", "--foreground", "--simulate", DEMO_HOSTS[i - 1],
                    "--interface", "127.0.0.1", "--port", "0", "--hostname", f"demo-{i}", "--session", session,
                    "--state-dir", str(state), "--fleet-view", "off", "--ready-fd", str(w)]
            try:
                with open(state / "gpusd.log", "ab") as log:
                    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                         pass_fds=(w,), start_new_session=True)
            except BaseException:
                os.close(r)
                raise
            finally:
                os.close(w)
            procs.append(p)
            pipes.append((p, r, state))
        deadline = time.monotonic() + 30
        for p, r, state in pipes:
            line = _read_line(r, max(0.1, deadline - time.monotonic()), p)
            if not line:
                raise _failure(p.poll() or 1, state / "gpusd.log")
    finally:
        for _, r, _ in pipes:
            os.close(r)


def _stop_demo_daemons(procs: list[Any]) -> None:
    import signal
    import subprocess

    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


async def _demo_show(session: str, args: argparse.Namespace) -> int:
    import asyncio
    import time

    from ..discovery.client import AsyncClient
    from .discover import render_devices

    events: list[str] = []
    client = AsyncClient(session=session, interfaces=["127.0.0.1"])

    def note(ev: Any) -> None:
        if ev.event in ("host_added", "host_removed"):
            events.append(f"{time.strftime('%H:%M:%S')} {ev}")

    client.register_event_handler("*", note)
    await client.start_listening()
    try:
        await client.wait_settled(5.0)
        # the demo knows how many hosts it started: on a busy machine one may take longer to resolve
        # than discovery's settling time (bounded all the same)
        until = time.monotonic() + 20
        while len(client.hosts) < args.hosts and time.monotonic() < until:
            await asyncio.sleep(0.1)
        live = sys.stdout.isatty() and not args.once
        if not live:
            print("\n".join(events))
            print(render_devices(client.list_devices(), client.hosts))
            return 0
        from rich.console import Group
        from rich.live import Live
        from rich.text import Text

        def frame() -> Group:
            head = Text(f"gpusd demo — session {session} — every GPU on the (loopback) LAN, live; "
                        f"ends by itself after {args.duration:g} s (Ctrl-C ends it sooner)", style="bold")
            table = Text(render_devices(client.list_devices(), client.hosts))
            return Group(head, Text("\n".join(events[-6:]), style="dim"), table)

        end = time.monotonic() + args.duration
        with Live(frame(), refresh_per_second=4, screen=False) as view:
            while time.monotonic() < end:
                await asyncio.sleep(0.5)
                view.update(frame())
        print("gpusd demo: done. On real machines: gpusd start on each GPU host, gpusd list anywhere on the LAN.")
        return 0
    finally:
        await client.stop_listening()


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", name: str) -> None:
    """The parsers of ``gpusd start``, ``stop``, ``status`` and ``demo``."""
    from . import options as o

    if name == "start":
        _start_parser(sub, o)
    elif name == "stop":
        p = o.command(sub, name, "gpusd.cli.daemon:stop", "stop the daemon (its host disappears from clients at once)",
                      parents=[o.state_dir()])
        p.add_argument("--timeout", type=o.seconds, default=10.0, metavar="S", help="how long to wait (default 10)")
        p.add_argument("--force", action="store_true", help="SIGKILL the daemon if it does not stop in time")
    elif name == "status":
        o.command(sub, name, "gpusd.cli.daemon:status", "is the daemon running, and what does it serve",
                  parents=[o.state_dir(), o.json_output()])
    else:
        p = o.command(sub, name, "gpusd.cli.daemon:demo",
                      "start three daemons with simulated GPUs on 127.0.0.1, discover them and show them live")
        p.add_argument("--duration", type=o.positive_seconds, default=10.0, metavar="S",
                       help="seconds to show (default 10)")
        p.add_argument("--once", action="store_true", help="print the table once, then stop")
        p.add_argument("--hosts", type=int, default=3, help="number of simulated hosts (1-8, default 3)")


def _start_parser(sub: Any, o: Any) -> None:
    p = o.command(sub, "start", "gpusd.cli.daemon:start",
                  "start the daemon: sample this machine's GPUs, serve them over HTTP, announce them on the LAN",
                  parents=[o.interface(), o.session(all_sessions=False), o.state_dir(),
                           o.token("trust on: private fields and writes for signed requests, HTTPS with a pinned "
                                   "certificate"),
                           o.thresholds(), o.beyond(), o.simulate()])
    p.add_argument("--foreground", action="store_true", help="run in the foreground (systemd, containers)")
    p.add_argument("--print-unit", action="store_true",
                   help="print a systemd unit that starts this install's gpusd with the other options given, "
                   "and start nothing (docs/daemon.md, systemd)")
    p.add_argument("--port", type=int, default=4780, help="HTTP port (default 4780; 0: any free port)")
    p.add_argument("--interval", type=o.positive_seconds, default=1.0, metavar="S",
                   help="seconds between samples (default 1)")
    window = p.add_argument("--sample-window", dest="history", type=o.seconds, default=300.0, metavar="S",
                            help="seconds of per-GPU samples kept in memory, served at /api/v1/history (default 300)")
    # "history" is the usage history database (docs/cli.md, "Vocabulary")
    o.deprecated(p, "--history", window)
    p.add_argument("--hostname", help="host name to announce (default: this machine's, or $GPUSD_HOSTNAME)")
    p.add_argument("--gpusd-compat", action="store_true",
                   help="also announce hwsd's _gpu-sd._tcp and _net-sd._tcp records (for GPU-SD/Equalizer clients)")
    p.add_argument("--tls-port", type=int, default=None, metavar="N",
                   help="with a fleet secret: the HTTPS port (default: --port + 1; 0: any free port)")
    view = p.add_argument("--fleet-view", dest="fleet", choices=("auto", "on", "off"), default="auto",
                          help="the /api/v1/fleet view: started on first use (auto), always, or never")
    # --fleet elsewhere: a switch, act on the fleet (run, report)
    o.deprecated(p, "--fleet", view)
    p.add_argument("--txt-interval", type=o.seconds, default=6.0, metavar="S",
                   help="minimum seconds between TXT record updates (default 6: RFC 6762 allows 10 a minute)")
    p.add_argument("--timeout", type=o.positive_seconds, default=30.0, metavar="S",
                   help="how long to wait for a background daemon to come up (default 30)")
    p.add_argument("--log-file", metavar="FILE", default=None,
                   help="with --foreground: log to FILE, rotated at 10 MiB (3 kept) while running "
                   "(default: stderr; a background daemon logs to gpusd.log in its state directory)")
    p.add_argument("--dcgm-metrics", action=argparse.BooleanOptionalAction, default=True,
                   help="/metrics also serves NVIDIA DCGM exporter names (DCGM_FI_DEV_GPU_UTIL...) for Grafana "
                   "dashboards made for it (default: on)")
    p.add_argument("--user-metrics", action="store_true",
                   help="/metrics also serves GPU-seconds used and held per user, to readers that may see "
                   "private data (this machine, signed requests); docs/monitoring.md, Privacy")
    h = p.add_argument_group("usage history (docs/history.md)")
    h.add_argument("--no-record", dest="record", action="store_false", help="record no usage history")
    h.add_argument("--retention", type=o.positive_number, default=365.0, metavar="DAYS",
                   help="days of 5-minute history and job records kept (default 365)")
    h.add_argument("--history-size", type=o.positive_number, default=1024.0, metavar="MIB",
                   help="size bound of the history database in MiB (default 1024)")
    h.add_argument("--idle-after", type=o.positive_seconds, default=900.0, metavar="S",
                   help="mark a lease idle after S seconds under 5 %% utilisation (default 900)")
    h.add_argument("--idle-release", action="store_true",
                   help="release idle reservations after a notice and --idle-grace (never a running job's lease)")
    h.add_argument("--idle-grace", type=o.seconds, default=900.0, metavar="S",
                   help="seconds between the release notice and the release (default 900)")
    r = p.add_argument_group("rebalancing of gpusd jobs (docs/jobs.md)")
    r.add_argument("--rebalance", action="store_true",
                   help="move --preemptible jobs off GPUs that stay hot while another GPU is idle, and pause "
                   "--pausable jobs while their GPU is too hot (default policy)")
    r.add_argument("--rebalance-policy", metavar="FILE",
                   help="rebalance with the thresholds of this JSON file (implies --rebalance)")
    sl = p.add_argument_group("Slurm (docs/slurm.md)")
    sl.add_argument("--slurm", action="store_true",
                    help="join Slurm as a dynamic node (slurmd -Z, configless) with this host's GPUs; Slurm then "
                    "allocates them: local and remote gpusd leases are refused, Slurm jobs' leases recorded")
    sl.add_argument("--slurm-controller", metavar="HOST[:PORT]",
                    help="with --slurm: slurmctld's address (default: the daemon announcing --slurmctld)")
    sl.add_argument("--slurmctld", metavar="[HOST:]PORT", nargs="?", const="6817", default=None,
                    help="announce that slurmctld runs on this host (its port, default 6817)")
    p.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
