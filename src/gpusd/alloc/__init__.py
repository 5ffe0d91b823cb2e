"""Race-free allocation of the local GPUs: constraints and ranking (:mod:`.select`), leases held with
flock (:mod:`.leases`), the FIFO wait queue (:mod:`.queue`), the CUDA environment (:mod:`.env`), the
Python API (:mod:`.api`) and ``gpusd run`` (:mod:`.runner`)."""
