"""Start one command per host of a placement, over SSH, and stop them all together.

- **SSH as the user has it**: ``ssh [-F $GPUSD_SSH_CONFIG] [--ssh-option ...] TARGET CMD``, so the user's
  config, keys and agent apply; a host whose address is one of this machine's runs the command
  directly (no SSH).  The children are started in their own session, so a Ctrl-C reaches gpusd only,
  which then stops every host in order (below).
- **Output** of every host is copied line by line, prefixed ``[HOST#RANK]`` (RANK = the host's position
  in the placement; engines such as torchrun add their own per-process prefix after it).
- **Stopping**: on SIGINT/SIGTERM, or when one host's command fails, gpusd closes each ssh's standard
  input.  The remote side runs the command under a small ``sh`` watchdog that waits for that end of
  input, then sends SIGTERM to the whole remote process group (sshd makes the remote shell a session
  leader, so the group is the command and everything it started), and SIGKILL ``grace`` seconds later.
  The same happens when gpusd itself dies (kill -9): ssh's channel closes.  A cut link closes
  nothing (sshd may not notice for hours), so gpusd also sends a heartbeat byte down each channel
  every ``HEARTBEAT`` seconds, and the watchdog stops the command after ``silence`` seconds without
  one (where ``timeout`` exists there: GNU coreutils, busybox); gpusd's own ssh gives up on a silent
  server after ``ServerAliveInterval`` x ``ServerAliveCountMax`` (5 s x 3, unless the options say
  otherwise), so gpusd learns it too and stops the other hosts.  Local commands get the same
  signals through ``killpg``.
- **Exit status**: the first host that fails gives its status (a remote signal death reads 128+N, as
  ssh reports it; 255 is ssh's own failure); 130 after a Ctrl-C; 0 when every host succeeded.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import shlex
import shutil
import signal
import sys
import tempfile
from collections import deque
from dataclasses import dataclass, field
from typing import IO, Sequence

import ifaddr

from ..errors import exec_failure
from .generate import FILES, HostCommand, find_python, safe_path_check
from .placement import HostSlot

SSH_CONFIG_VAR = "GPUSD_SSH_CONFIG"
CHUNK = 1 << 16
# seconds between the heartbeat bytes gpusd sends down each ssh channel
HEARTBEAT = 1.0
# seconds after --grace before gpusd kills an ssh (or local guard) that has not returned
KILL_WAIT = 15.0
# ssh gives up on a cut link
SERVER_ALIVE = (("ServerAliveInterval", "5"), ("ServerAliveCountMax", "3"))


@dataclass
class LaunchOptions:
    ssh: str = "ssh"
    # -F FILE (default $GPUSD_SSH_CONFIG)
    ssh_config: str | None = None
    # each passed as -o OPTION
    ssh_options: list[str] = field(default_factory=list)
    # remote working directory (None: the login directory)
    chdir: str | None = None
    # sent to every host (gpusd launch --env)
    env: dict[str, str] = field(default_factory=dict)
    # seconds between SIGTERM and SIGKILL
    grace: float = 10.0
    # the remote watchdog stops the command after this long without a heartbeat
    silence: float = 10.0
    # stop the remote group when ssh's input closes (off for daemonising commands)
    watchdog: bool = True
    stop_on_failure: bool = True
    prefix: bool = True
    # None: this machine's interface addresses
    local_addresses: frozenset[str] | None = None
    # the Python with gpusd on the hosts, which runs each host's guard (gpusd.engines.jobguard);
    # None: found there (this machine's interpreter at the same path, else the gpusd on PATH)
    python: str | None = None

    def __post_init__(self) -> None:
        if self.ssh_config is None:
            self.ssh_config = os.environ.get(SSH_CONFIG_VAR) or None


def local_addresses() -> frozenset[str]:
    """Every IP address of this machine (its current network namespace), loopback included."""

    out = {"127.0.0.1", "::1", "localhost"}
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            out.add(ip.ip if isinstance(ip.ip, str) else ip.ip[0])
    return frozenset(out)


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface that has ``address``, or None."""

    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if (ip.ip if isinstance(ip.ip, str) else ip.ip[0]) == address:
                return str(adapter.name)
    return None


def _iface_lines(cmd: HostCommand) -> str:
    """sh lines that set each of ``cmd.iface_env`` to the interface carrying the slot's address (from
    ``ip -o addr show to ADDR``), unless the host's environment has it; a line on stderr when it
    cannot be told."""
    address = cmd.slot.address
    try:
        ipaddress.ip_address(address)
    except ValueError:
        # a name: ip cannot look it up; the engine resolves it itself
        return ""
    out = []
    for var in cmd.iface_env:
        hint = (f"gpusd: cannot tell which interface carries {address} here (no ip command?); if {var} must be "
                f"set (the host name resolves to loopback), give gpusd launch --env {var}=IFACE")
        out.append(f'if [ -z "${{{var}-}}" ]; then gpusd_if=$(ip -o addr show to {shlex.quote(address)} 2>/dev/null | '
                   "awk '{print $2; exit}'); "
                   f'if [ -n "$gpusd_if" ]; then {var}=$gpusd_if; export {var}; '
                   f"else echo {shlex.quote(hint)} >&2; fi; fi\n")
    return "".join(out)


def is_local(slot: HostSlot, opts: LaunchOptions) -> bool:
    addresses = opts.local_addresses if opts.local_addresses is not None else local_addresses()
    return slot.address in addresses or slot.ssh_host in ("localhost", "127.0.0.1", "::1")


def _watchdog_script(grace: float, files: bool, silence: float = 10.0) -> str:
    # stdin is ssh's channel: when it ends (gpusd stops the job, or gpusd/ssh died) or stays silent
    # for ``silence`` seconds (a cut link: gpusd sends a byte every HEARTBEAT seconds), the whole
    # process group of the remote shell gets SIGTERM, then SIGKILL.  The watchdog ignores TERM itself.
    g = max(0, int(grace))
    quiet = max(2, int(silence + 0.999))
    rm = ' rm -rf -- "$gpusd_files";' if files else ""
    # each heartbeat is one non-newline byte: `head -c 1` prints it; at the end of input or after
    # `quiet` seconds of silence it prints nothing.  Without `timeout`, only the end of input counts.
    wait = (f'if command -v timeout >/dev/null 2>&1; then while [ -n "$(timeout {quiet} head -c 1 <&3 2>/dev/null)" ]; '
            "do :; done; else cat <&3 >/dev/null; fi;")
    # sh gives a background job /dev/null as its input: ssh's channel is handed over on fd 3.
    return ("exec 3<&0\n"
            f"{{ trap '' TERM; {wait} kill -TERM 0;{rm} sleep {g}; kill -KILL 0; }} "
            "</dev/null >/dev/null 2>&1 &\n")


GUARD_MODULE = "gpusd.engines.jobguard"


# Run by this machine's interpreter path on the host: the guard when that Python has gpusd, else the
# watchdog script ($1) — one Python start either way, instead of a probe and then the guard.
_GUARD_BOOT = ("import os, signal, sys\n"
               "try:\n    from gpusd.engines.jobguard import main\n"
               "except ImportError:\n"
               # Python ignores it; sh must not inherit that
               "    signal.signal(signal.SIGPIPE, signal.SIG_DFL)\n"
               "    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)\n"
               "    os.execv('/bin/sh', ['sh', '-c', sys.argv[1], 'gpusd-launch'])\n"
               "sys.exit(main(sys.argv[2:]))\n")


def _guard_script(cmd: HostCommand, opts: LaunchOptions, fallback: str) -> str:
    """sh lines that exec the command under the host's guard (:mod:`gpusd.engines.jobguard`, which
    reaches every descendant, ranks in sessions of their own included) where a Python with gpusd is
    there: ``--python``; else this machine's interpreter where the same path is there and safe
    (:func:`gpusd.engines.generate.safe_path_check`), which runs ``fallback`` itself when it lacks
    gpusd; else the interpreter of the ``gpusd`` on the host's PATH.  Without one they fall through,
    saying so, to ``fallback`` (the ``sh`` watchdog, which reaches the process group only)."""


    quiet = max(2, int(opts.silence + 0.999))
    files = ["--files", '"$gpusd_files"'] if cmd.files else []
    args = " ".join(["--grace", f"{opts.grace:g}", "--silence", str(quiet), *files, "--", _command_words(cmd, opts)])
    hint = ("gpusd launch: no Python with gpusd on this host (give --python PATH): stopping the job reaches its "
            "process group only, not processes in sessions of their own")
    if opts.python:
        return f"exec {shlex.quote(opts.python)} -m {GUARD_MODULE} {args}\n"
    warned = f"echo {shlex.quote(hint)} >&2\n{fallback}"
    here = shlex.quote(sys.executable)
    return ("export gpusd_files\n" if cmd.files else "") + (
        f"gpusd_here={here}; {safe_path_check()}\n"
        f'if [ -x "$gpusd_here" ] && gpusd_ours "$gpusd_here"; then '
        f'exec "$gpusd_here" -c {shlex.quote(_GUARD_BOOT)} {shlex.quote(warned)} {args}; fi\n'
        + find_python(GUARD_MODULE, here, probe_here=False) + "\n"
        f'if [ -n "$gpusd_py" ]; then exec $gpusd_py -m {GUARD_MODULE} {args}; fi\n'
        f"echo {shlex.quote(hint)} >&2\n")


def _command_words(cmd: HostCommand, opts: LaunchOptions) -> str:
    env = {**opts.env, **cmd.env}
    return " ".join(["env", *[shlex.quote(f"{k}={v}") for k, v in env.items()], *map(_shell_word, cmd.argv)])


def _shell_word(word: str) -> str:
    """``word`` quoted for sh, with the FILES token standing for the private directory made on the host."""
    parts = word.split(FILES)
    return '"$gpusd_files"'.join(shlex.quote(p) if p else "" for p in parts) or "''"


def remote_script(cmd: HostCommand, opts: LaunchOptions) -> str:
    """The ``sh`` script run on the remote host for ``cmd``."""
    lines = []
    if opts.chdir:
        lines.append(f"cd -- {shlex.quote(opts.chdir)} || exit 97\n")
    # a private directory (mktemp -d: mode 0700, a fresh name) for the command's files
    if cmd.files:
        lines.append('gpusd_files=$(mktemp -d "${TMPDIR:-/tmp}/gpusd.XXXXXXXX") || exit 97\n')
        for name, content in cmd.files.items():
            lines.append(f'printf %s {shlex.quote(content)} > "$gpusd_files"/{shlex.quote(name)} || exit 97\n')
    if cmd.iface_env:
        lines.append(_iface_lines(cmd))
    # names from gpusd's own table (inventory.vendors), never from the network
    if cmd.unset:
        lines.append("unset " + " ".join(shlex.quote(n) for n in cmd.unset) + "\n")
    if not opts.watchdog:
        return "".join(lines) + f"exec {_command_words(cmd, opts)}\n"
    fallback = (_watchdog_script(opts.grace, bool(cmd.files), opts.silence)
                + f"exec {_command_words(cmd, opts)} </dev/null 3<&-\n")
    return "".join(lines) + _guard_script(cmd, opts, fallback) + fallback


def ssh_argv(cmd: HostCommand, opts: LaunchOptions) -> list[str]:
    argv = [opts.ssh]
    if opts.ssh_config:
        argv += ["-F", opts.ssh_config]
    for o in opts.ssh_options:
        argv += ["-o", o]
    given = {o.split("=", 1)[0].split()[0].lower() for o in opts.ssh_options if o.strip()}
    # after the user's: ssh keeps the first value it is given
    for name, value in SERVER_ALIVE:
        if name.lower() not in given:
            argv += ["-o", f"{name}={value}"]
    # The login shell may be any shell: it is only asked to exec sh with one quoted word.
    remote = "exec sh -c " + shlex.quote(remote_script(cmd, opts)) + " gpusd-launch"
    return argv + ["-T", "--", cmd.slot.ssh_target, remote]


# lines of each host's output kept, to say why it failed
TAIL = 5


@dataclass
class _Running:
    cmd: HostCommand
    proc: asyncio.subprocess.Process
    local: bool
    label: str
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL))


@dataclass(frozen=True)
class Failure:
    """A host whose command failed: its label (``HOST#RANK``), ssh target, status and last lines of output."""

    label: str
    target: str
    status: int
    tail: tuple[str, ...]


async def _pump(reader: asyncio.StreamReader | None, out: IO[str], label: str, prefix: bool,
                tail: deque[str] | None = None) -> None:
    if reader is None:
        return
    pending = b""

    def emit(raw: bytes) -> None:
        text = raw.decode(errors="replace").rstrip("\r")
        out.write(f"[{label}] {text}\n" if prefix else text + "\n")
        if tail is not None and text.strip():
            tail.append(text)

    while True:
        chunk = await reader.read(CHUNK)
        if not chunk:
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        # an endless line: flush it in pieces
        if len(pending) > CHUNK:
            lines.append(pending)
            pending = b""
        for line in lines:
            emit(line)
        out.flush()
    if pending:
        emit(pending)
        out.flush()


class Launch:
    """One launch of ``commands`` (one per host).  ``await launch.run()`` returns the exit status."""

    def __init__(self, commands: Sequence[HostCommand], opts: LaunchOptions | None = None,
                 stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> None:
        self.commands = list(commands)
        self.opts = opts or LaunchOptions()
        self.stdout = stdout or sys.stdout
        self.stderr = stderr or sys.stderr
        self.running: list[_Running] = []
        # the first failure's status
        self.status: int | None = None
        # every host that failed, in the order they ended
        self.failures: list[Failure] = []
        self.interrupted = False
        self._stopping = False
        self._local_dirs: list[str] = []

    async def _start(self, cmd: HostCommand) -> _Running:
        local = is_local(cmd.slot, self.opts)
        label = f"{cmd.slot.hostname}#{cmd.rank}"
        if local:
            env = {k: v for k, v in os.environ.items() if k not in cmd.unset}
            env.update({**self.opts.env, **cmd.env})
            for var in cmd.iface_env:
                iface = None if var in env else interface_of(cmd.slot.address)
                if iface is not None:
                    env[var] = iface
            argv = cmd.argv
            if cmd.files:
                d = tempfile.mkdtemp(prefix="gpusd.")
                self._local_dirs.append(d)
                for name, content in cmd.files.items():
                    with open(os.path.join(d, name), "x") as f:
                        f.write(content)
                argv = [a.replace(FILES, d) for a in argv]
            # under the guard, which stops every descendant when the pipe closes
            if self.opts.watchdog:
                argv = [sys.executable, "-m", GUARD_MODULE, "--grace", f"{self.opts.grace:g}", "--silence", "0",
                        "--", *argv]
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE if self.opts.watchdog else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True,
                cwd=self.opts.chdir if self.opts.chdir and os.path.isdir(self.opts.chdir) else None)
        else:
            proc = await asyncio.create_subprocess_exec(
                *ssh_argv(cmd, self.opts), stdin=asyncio.subprocess.PIPE if self.opts.watchdog
                else asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, start_new_session=True)
        return _Running(cmd, proc, local, label)

    def stop(self) -> None:
        """Stop every host's command (idempotent): close ssh input / SIGTERM local groups, and
        SIGKILL what is left after the grace period."""
        if self._stopping:
            return
        self._stopping = True
        for r in self.running:
            if r.proc.returncode is not None:
                continue
            # the host's guard (or watchdog) stops everything, then returns
            if r.proc.stdin is not None:
                r.proc.stdin.close()
            else:
                _killpg(r.proc.pid, signal.SIGTERM)
        # a guard SIGKILLs what outlives the grace and returns once it is gone (10 s at most more)
        asyncio.get_running_loop().call_later(self.opts.grace + KILL_WAIT, self._kill_all)

    async def _heartbeat(self) -> None:
        """One byte down every remote channel each HEARTBEAT seconds, until the job stops: the remote
        watchdogs stop their command when it no longer comes (a cut link)."""
        while not self._stopping:
            for r in self.running:
                stdin = r.proc.stdin
                if r.local or stdin is None or r.proc.returncode is not None or stdin.is_closing():
                    continue
                try:
                    stdin.write(b".")
                except (OSError, RuntimeError):
                    pass
            await asyncio.sleep(HEARTBEAT)

    def _kill_all(self) -> None:
        for r in self.running:
            if r.proc.returncode is None:
                _killpg(r.proc.pid, signal.SIGKILL)

    def _interrupt(self) -> None:
        if not self.interrupted:
            self.interrupted = True
            self.stderr.write("gpusd: stopping every host...\n")
            self.stderr.flush()
        self.stop()

    async def _watch(self, r: _Running) -> None:
        await asyncio.gather(_pump(r.proc.stdout, self.stdout, r.label, self.opts.prefix, r.tail),
                             _pump(r.proc.stderr, self.stderr, r.label, self.opts.prefix, r.tail))
        code = await r.proc.wait()
        # a local command killed by a signal: report it as a shell would
        if code < 0:
            code = 128 - code
        if code != 0:
            self.failures.append(Failure(r.label, r.cmd.slot.ssh_target, code, tuple(r.tail)))
        if code != 0 and self.status is None and not (self.interrupted and self._stopping):
            self.status = code
            what = "ssh failed" if code == 255 and not r.local else f"exited with status {code}"
            self.stderr.write(f"gpusd: {r.label} ({r.cmd.slot.ssh_target}) {what}\n")
            self.stderr.flush()
            if self.opts.stop_on_failure:
                self.stop()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        handled = []
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                loop.add_signal_handler(sig, self._interrupt)
                handled.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):
                pass
        try:
            try:
                for cmd in self.commands:
                    self.running.append(await self._start(cmd))
            except OSError as e:
                self.stderr.write(f"gpusd: cannot start {e.filename or ''}: {e.strerror or e}\n")
                self.status = exec_failure(e, str(e.filename or ""))[0]
                self.stop()
            beat = asyncio.ensure_future(self._heartbeat()) if self.opts.watchdog else None
            try:
                await asyncio.gather(*(self._watch(r) for r in self.running))
            finally:
                if beat is not None:
                    beat.cancel()
        finally:
            for sig in handled:
                loop.remove_signal_handler(sig)
            self._kill_all()

            for d in self._local_dirs:
                shutil.rmtree(d, ignore_errors=True)
        if self.status is not None:
            return self.status
        return 130 if self.interrupted else 0


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_commands(commands: Sequence[HostCommand], opts: LaunchOptions | None = None) -> int:
    """Run ``commands`` (one per host) to the end; the exit status as described in the module."""
    return asyncio.run(Launch(commands, opts).run())
