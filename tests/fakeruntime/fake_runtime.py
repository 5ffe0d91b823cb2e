#!/usr/bin/env python3
"""A fake container runtime (docker, podman, nerdctl, apptainer: by the name it is called as) for tests.

It records every call (argv and the variables apptainer passes in) as one JSON line in
$FAKE_RUNTIME_LOG, and behaves: ``run`` writes --cidfile, starts the container's command through a
"shim" in a session of its own (as a daemon-run container is: killing the client does not end it),
with only the -e variables; attached, it waits for the container and forwards SIGTERM/SIGINT to it
(sig-proxy); with -d it prints the id and exits.  ``wait ID`` waits for the container and prints its
exit status; ``stop [-t N] ID`` ends it.  ``apptainer exec|run IMAGE CMD...`` runs CMD with the
APPTAINERENV_ variables.  State (pids, exit statuses) lives in $FAKE_RUNTIME_STATE.
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

NAME = os.path.basename(sys.argv[0])
STATE = os.environ.get("FAKE_RUNTIME_STATE", "/tmp/fake-runtime")
VALUE = {"-e", "--env", "--cidfile", "--label", "--gpus", "--device", "--group-add", "--name", "-v", "-w", "-u",
         "--bind", "-B"}


def log(argv):
    path = os.environ.get("FAKE_RUNTIME_LOG")
    if path:
        passed = {k: v for k, v in os.environ.items() if k.startswith(("APPTAINERENV_", "SINGULARITYENV_"))
                  or k in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "ZE_AFFINITY_MASK")}
        with open(path, "a") as f:
            f.write(json.dumps({"runtime": NAME, "argv": argv, "pid": os.getpid(), "env": passed}) + "\n")


def state(cid, what):
    return os.path.join(STATE, f"{cid}.{what}")


def rc_of(cid):
    try:
        with open(state(cid, "rc")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def shim(cid, env, cmd):
    """The container: runs cmd, writes its exit status."""
    proc = subprocess.Popen(cmd, env=env)
    with open(state(cid, "pid"), "w") as f:
        f.write(str(proc.pid))

    def forward(signum, _frame):
        try:
            proc.send_signal(signum)
        except OSError:
            pass

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, forward)
    rc = proc.wait()
    rc = rc if rc >= 0 else 128 - rc
    with open(state(cid, "rc.tmp"), "w") as f:
        f.write(str(rc))
    os.rename(state(cid, "rc.tmp"), state(cid, "rc"))


def run(args):
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    cidfile, detached, k = None, False, 0
    while k < len(args) and args[k].startswith("-"):
        a = args[k]
        if a in VALUE:
            v = args[k + 1]
            if a in ("-e", "--env"):
                name, _, value = v.partition("=")
                env[name] = value
            if a == "--cidfile":
                cidfile = v
            k += 2
            continue
        if a in ("-d", "--detach") or (a.startswith("-") and not a.startswith("--") and "d" in a):
            detached = True
        k += 1
    image, cmd = args[k], args[k + 1:] or ["true"]
    if image == "missing-image":
        print(f"Unable to find image '{image}'", file=sys.stderr)
        return 125
    cid = uuid.uuid4().hex + uuid.uuid4().hex
    os.makedirs(STATE, exist_ok=True)
    if cidfile:
        if os.path.exists(cidfile):
            print("container ID file found, make sure the other container isn't running", file=sys.stderr)
            return 125
        with open(cidfile, "w") as f:
            f.write(cid)
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "__shim", cid, json.dumps(env), *cmd],
                         start_new_session=True)
    with open(state(cid, "shim"), "w") as f:
        f.write(str(p.pid))
    if detached:
        print(cid, flush=True)
        return 0

    def forward(signum, _frame):
        try:
            os.kill(p.pid, signum)
        except OSError:
            pass

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, forward)
    p.wait()
    rc = rc_of(cid)
    return 125 if rc is None else rc


def wait(cid):
    if not os.path.exists(state(cid, "shim")):
        print(f"Error: No such container: {cid}", file=sys.stderr)
        return 1
    while rc_of(cid) is None:
        time.sleep(0.05)
    print(rc_of(cid), flush=True)
    return 0


def stop(args):
    grace = 10
    if args[:1] == ["-t"]:
        grace, args = int(args[1]), args[2:]
    cid = args[0]
    try:
        shim_pid = int(open(state(cid, "shim")).read())
        os.kill(shim_pid, signal.SIGTERM)
    except (OSError, ValueError):
        return 1
    deadline = time.monotonic() + grace
    while rc_of(cid) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if rc_of(cid) is None:
        try:
            os.kill(int(open(state(cid, "pid")).read()), signal.SIGKILL)
        except (OSError, ValueError):
            pass
    print(cid)
    return 0


def apptainer(args):
    k = 0
    while k < len(args) and args[k].startswith("-"):
        k += 2 if args[k] in VALUE else 1
    cmd = args[k + 1:] or ["true"]
    env = dict(os.environ)
    for key, value in os.environ.items():
        for prefix in ("APPTAINERENV_", "SINGULARITYENV_"):
            if key.startswith(prefix):
                env[key[len(prefix):]] = value
    return subprocess.call(cmd, env=env)


def main():
    argv = sys.argv[1:]
    if argv[:1] == ["__shim"]:
        shim(argv[1], json.loads(argv[2]), argv[3:])
        return 0
    log(argv)
    if NAME in ("apptainer", "singularity"):
        return apptainer(argv[1:]) if argv[:1] in (["exec"], ["run"]) else 0
    while argv and argv[0].startswith("-"):
        argv = argv[1:]
    if argv[:1] == ["container"]:
        argv = argv[1:]
    if argv[:1] == ["run"]:
        return run(argv[1:])
    if argv[:1] == ["wait"]:
        return wait(argv[1])
    if argv[:1] == ["stop"]:
        return stop(argv[1:])
    print(f"fake {NAME}: {argv[:1]} not faked", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
