"""A Ray driver for tests/engines/test_launch_pool.py: one ``num_gpus=1`` task per GPU of the cluster at
``sys.argv[1]``, each touching ``sys.argv[2]/started-<ip>-<gpu>`` and then using its GPU for 10 minutes
(what a training job would do while its reservation runs out)."""

import os
import subprocess
import sys
import time

import ray

ray.init(address=sys.argv[1], log_to_driver=False)


@ray.remote(num_gpus=1)
def hold() -> None:
    words = subprocess.run(["ip", "-4", "-o", "addr", "show", "eth0"], capture_output=True, text=True).stdout.split()
    ip = words[3].split("/")[0] if len(words) > 3 else "?"
    gpu = ",".join(str(g) for g in ray.get_gpu_ids())
    open(os.path.join(sys.argv[2], f"started-{ip}-{gpu}"), "w").close()
    time.sleep(600)


refs = [hold.remote() for _ in range(int(ray.cluster_resources().get("GPU", 0)))]
try:
    ray.get(refs)
except Exception as exc:  # noqa: BLE001 - the cluster went away under the tasks
    print(f"ENDED {type(exc).__name__}", flush=True)
