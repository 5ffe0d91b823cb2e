"""Started by an engine's launcher in the engine tests: one line with the rank and GPU it was given."""

import json
import os
import subprocess

addr = subprocess.run(["ip", "-4", "-o", "addr", "show", "eth0"], capture_output=True, text=True).stdout.split()
os.write(1, ("RESULT " + json.dumps({
    "rank": int(os.environ.get("RANK", "-1")), "local_rank": int(os.environ.get("LOCAL_RANK", "-1")),
    "world": int(os.environ.get("WORLD_SIZE", "-1")), "address": addr[3].split("/")[0] if len(addr) > 3 else None,
    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "cuda_device_order": os.environ.get("CUDA_DEVICE_ORDER")}) + "\n").encode())  # one write: ranks share the pipe
