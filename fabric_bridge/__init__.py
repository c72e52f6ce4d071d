"""fabric_bridge: move KV pages and metadata between engine instances over NIXL.

Modules: ``layout`` (KV layout + compatibility), ``plan`` (transfer plan, expected write
counts), ``completion`` (receiver counters, timeouts, quarantine), ``agent`` (NIXL wrapper),
``control`` (TCP handshake). See README.md. Nothing is imported here, so ``layout`` and
``plan`` can be used without loading NIXL.
"""
