"""Jobs: what ``gpusd run`` starts, with an identity, a protocol to tell it of GPU changes, grow and
shrink, priorities with preemption, and rebalancing (docs/jobs.md).

* :mod:`.record` — the job records beside the leases;
* :mod:`.control` — the job's control socket (grow, shrink, preempt, move, pause);
* :mod:`.supervisor` — runs the command, restarts it, tells it of changes;
* :mod:`.child` — the supervisor's command (started, signalled through its pidfd, stopped);
* :mod:`.state` — the supervisor's states and the one table of their transitions;
* :mod:`.rebalance` — the rebalancing policy (pure decisions the daemon acts on);
* :mod:`.fleet` — the records of fleet runs (``gpusd run --fleet``, ``gpusd fleet-job``);
* :mod:`.checkpoint` — NVIDIA's ``cuda-checkpoint``, for transparent moves;
* :mod:`.containers` — container runs (docker, podman, nerdctl, apptainer) rewritten for the leased GPUs.

Imports the core, ``inventory`` and ``alloc``.  Internal (docs/api.md); the job's own side is
:mod:`gpusd.job` (public, standard library only).
"""
