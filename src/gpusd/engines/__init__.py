"""Distributed engines on gpusd's GPUs (docs/engines.md).

* :mod:`.placement` — a :class:`~.placement.Placement`: the hosts and GPUs a job got, head first;
* :mod:`.generate` — what DeepSpeed, Open MPI, Horovod, torchrun and Ray read, from a placement;
* :mod:`.rank_gpu` — the per-rank GPU wrapper run under mpirun/horovodrun (standard library only at start);
* :mod:`.launch` — the SSH launcher (``gpusd launch``);
* :mod:`.plan` — what runs where: each engine's per-host commands, the leases they carry, their guards;
* :mod:`.raycluster` — starting and stopping a Ray cluster's nodes (``gpusd ray up/down``);
* :mod:`.records` — what gpusd remembers of jobs and Ray clusters in its state directory, and their renewers;
* :mod:`.hold` — the host-side guard that stops what an engine left running before its lease can end;
* :mod:`.jobguard` — the host-side guard of a launched job: every process it starts ends with it.

Internal (docs/api.md).
"""
