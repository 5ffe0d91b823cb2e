"""Run by torchrun in the engine tests: a rank that ignores SIGTERM (as one saving a checkpoint would
keep running) and sleeps until it is killed.  It writes ``DIR/NODE-LOCALRANK.pid`` (its pid) once it
runs; torchrun has started it in a session of its own."""

import os
import signal
import sys
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
path = os.path.join(sys.argv[1], f"{os.environ['GROUP_RANK']}-{os.environ['LOCAL_RANK']}.pid")
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(path + ".tmp", path)
while True:
    time.sleep(1)
