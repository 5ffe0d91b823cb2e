"""gpusd and Slurm (docs/slurm.md).

* :mod:`.conf` — slurm.conf and gres.conf lines from the fleet (pure);
* :mod:`.jobs` — the Slurm job leases of ``gpusd slurm prolog``/``epilog``;
* :mod:`.node` — slurmd run as a dynamic node beside the daemon.

Internal (docs/api.md).
"""
