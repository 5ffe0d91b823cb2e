"""Distributed engines on gpusd's GPUs: a :class:`~.placement.Placement` (the hosts and GPUs a job got)
turned into what DeepSpeed, Open MPI, Horovod, torchrun and Ray read (:mod:`.generate`), the per-rank
GPU wrapper (:mod:`.rank_gpu`), and the SSH launcher (:mod:`.launch`).  See docs/engines.md."""
