"""fabric_bridge: move KV pages and metadata between engine instances over NIXL.

Modules: ``layout`` (KV layout + compatibility), ``plan`` (transfer plan, expected write
counts), ``agent`` (the FabricAgent facade: NIXL start, registration, peers, close), ``peers``
(descriptor lists prepared per peer), ``sender`` (posting, send state, reaping),
``completion`` (receiver counters, timeouts, quarantine), ``progress`` (the progress thread),
``notifications`` (typed messages between agents), ``nixl_api`` (lazy, replaceable NIXL) and
``control`` (TCP handshake). See README.md. Nothing is imported here, and no module imports
NIXL before the first agent starts, so everything imports where NIXL is not installed.
"""
