"""Jobs: what ``gpusd run`` starts, with an identity, a protocol to tell it of GPU changes, grow and
shrink, priorities with preemption, and rebalancing (docs/jobs.md).  Imports the core, ``inventory``
and ``alloc``."""
