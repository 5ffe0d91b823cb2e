"""The gpusd modules ``gpusd list`` may import where the host's daemon answers with its fleet view (the
common case): what tests/discovery/test_list_fast.py checks the command against, and what a module must be
in to say that its imports inside functions are for that command's start-up (docs/architecture.md,
"Imports inside functions").  A module added here is a cost every listing pays: add it only where one
needs it."""

LIST = frozenset({
    "gpusd", "gpusd._version", "gpusd.cli", "gpusd.cli.discover", "gpusd.cli.exits", "gpusd.cli.options",
    "gpusd.cli.table", "gpusd.cli.trust", "gpusd.discovery", "gpusd.discovery.fleetsource",
    "gpusd.discovery.fleetview", "gpusd.discovery.source", "gpusd.discovery.types", "gpusd.errors", "gpusd.identity",
    "gpusd.localdaemon", "gpusd.model", "gpusd.record", "gpusd.sanitize", "gpusd.units", "gpusd.views",
    "gpusd.views.tables", "gpusd.wire", "gpusd.wire.aio", "gpusd.wire.fleet", "gpusd.wire.http", "gpusd.wire.mdns",
    "gpusd.wire.txt",
})
