"""The gpusd modules the quick commands (``devices``, ``select``, ``env``, ``run``) may import: what
tests/cli/test_cli_imports.py checks each such command against, and what a module must be in to say
that its imports inside functions are for start-up (docs/architecture.md, "Imports inside functions").
A module added here is a cost every quick command may pay: add it only where one needs it."""

QUICK = frozenset({
    "gpusd", "gpusd._version", "gpusd.alloc", "gpusd.alloc.api", "gpusd.alloc.authority", "gpusd.alloc.backend",
    "gpusd.alloc.bookings", "gpusd.alloc.candidate", "gpusd.alloc.cpus", "gpusd.alloc.env", "gpusd.alloc.epoch",
    "gpusd.alloc.handle", "gpusd.alloc.inotify", "gpusd.alloc.leases", "gpusd.alloc.leaseview", "gpusd.alloc.lockdir",
    "gpusd.alloc.placement", "gpusd.alloc.policy", "gpusd.alloc.priority", "gpusd.alloc.queue", "gpusd.alloc.runner",
    "gpusd.alloc.select", "gpusd.alloc.startgate", "gpusd.cli", "gpusd.cli.alloc", "gpusd.cli.devices",
    "gpusd.cli.exits", "gpusd.cli.jobs", "gpusd.cli.options", "gpusd.cli.table", "gpusd.cli.trust", "gpusd.errors",
    "gpusd.identity", "gpusd.ids", "gpusd.inventory", "gpusd.inventory.base", "gpusd.inventory.combined",
    "gpusd.inventory.lost", "gpusd.inventory.nvml", "gpusd.inventory.nvmlfast", "gpusd.inventory.processes",
    "gpusd.inventory.simulated", "gpusd.inventory.vendors", "gpusd.inventory.window", "gpusd.jobs",
    "gpusd.jobs.child", "gpusd.jobs.containers", "gpusd.jobs.control", "gpusd.jobs.record", "gpusd.jobs.state",
    "gpusd.jobs.supervisor", "gpusd.model", "gpusd.record", "gpusd.sanitize", "gpusd.topology", "gpusd.units",
    "gpusd.views", "gpusd.views.tables", "gpusd.wire", "gpusd.wire.aio",
})
