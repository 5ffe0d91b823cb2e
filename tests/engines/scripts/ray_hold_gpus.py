"""A Ray driver for tests/engines/test_launch_pool.py: one ``num_gpus=1`` task per GPU of the cluster at
``sys.argv[1]``, each touching ``sys.argv[2]/started-<ip>-<gpu>`` and then using its GPU for 10 minutes
(what a training job would do while its reservation runs out)."""

import os
import sys
import time

import ray

ray.init(address=sys.argv[1], log_to_driver=False)


@ray.remote(num_gpus=1)
def hold(where: str) -> None:
    ip = ray.util.get_node_ip_address()
    gpu = ",".join(str(g) for g in ray.get_gpu_ids())
    open(os.path.join(where, f"started-{ip}-{gpu}"), "w").close()
    time.sleep(600)


refs = [hold.remote(sys.argv[2]) for _ in range(int(ray.cluster_resources().get("GPU", 0)))]
try:
    ray.get(refs)
except Exception as exc:  # noqa: BLE001 - the cluster went away under the tasks
    print(f"ENDED {type(exc).__name__}: {str(exc)[-2000:]}", flush=True)
