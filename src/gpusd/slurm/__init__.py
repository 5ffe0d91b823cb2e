"""gpusd and Slurm (docs/slurm.md): slurm.conf and gres.conf lines from the fleet (``conf``, pure),
the Slurm job leases of ``gpusd slurm prolog``/``epilog`` (``jobs``), and slurmd run as a dynamic
node beside the daemon (``node``)."""
