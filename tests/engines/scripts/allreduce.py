"""Run by torchrun in the engine tests: an all-reduce over gloo, then one JSON line per rank saying what
it saw (its rank, the host address it runs on, CUDA_VISIBLE_DEVICES, the all-reduce result)."""

import json
import os
import subprocess

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
addr = subprocess.run(["ip", "-4", "-o", "addr", "show", "eth0"], capture_output=True, text=True).stdout.split()
os.write(1, ("RESULT " + json.dumps({
    "rank": rank, "world": world, "local_rank": int(os.environ["LOCAL_RANK"]),
    "address": addr[3].split("/")[0] if len(addr) > 3 else None,
    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "cuda_device_order": os.environ.get("CUDA_DEVICE_ORDER"),
    "sum": t.item()}) + "\n").encode())  # one write: ranks share the pipe
dist.destroy_process_group()
