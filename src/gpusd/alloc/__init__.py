"""Choosing and leasing the GPUs of this machine, race-free (docs/allocation.md).

* :mod:`.select` — the constraints (:class:`Constraints`, defined once for flags and keywords) and the ranking;
* :mod:`.placement` — a multi-GPU set chosen by topology, and why;
* :mod:`.candidate` — a device the ranking found (:class:`Candidate`), below both;
* :mod:`.cpus` — binding a command to its GPUs' CPUs;
* :mod:`.leases` — leases held with flock, in the shared lock directory or the authority's;
* :mod:`.epoch` — fencing tokens: the epoch each grant of a GPU carries, growing across restarts;
* :mod:`.handle` — the one lease handle (:class:`LeaseHandle`, :class:`Holder`) both kinds of lease implement;
* :mod:`.queue` — the wait queue (priorities, then first come, first served);
* :mod:`.startgate` — the start slots of ``gpusd run --wait`` (queued jobs submitted together start in turn);
* :mod:`.leaseview` — the lease view, kept by inotify instead of re-read per call;
* :mod:`.inotify` — the one inotify binding (the queue's wake-up, the lease view);
* :mod:`.lockdir` — lock directories and files opened without following anyone's symlinks;
* :mod:`.authority` — leases through the local daemon: the client side of the lease socket;
* :mod:`.policy` — the fair-use policy file;
* :mod:`.bookings` — GPUs booked ahead as every lease request sees them (the backfill rule);
* :mod:`.priority` — priorities: names, who may claim which, ageing;
* :mod:`.env` — the visibility variables for chosen GPUs (``set_cuda_visible_devices``);
* :mod:`.api` — ``gpusd.select`` and its :class:`Selection`;
* :mod:`.backend` — this process's one inventory backend, shared by the API, the env and the supervisor;
* :mod:`.runner` — ``gpusd run``: a command on leased GPUs, for as long as it lives;
* :mod:`.adopt` — ``gpusd adopt PID``: a running GPU process made a lease until it exits.

Internal (docs/api.md): ``gpusd.select``, ``gpusd.Selection``, ``gpusd.Constraints`` and
``gpusd.set_cuda_visible_devices`` are the public names.
"""
