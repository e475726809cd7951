"""The host ledger: one process that grants GPU capacity to every user's scheduler on a host.

``protocol`` (the wire format), ``policy`` (pure: may a grant be made now), ``config`` (its JSON
policy file), ``procs`` (what /proc says of a pid), ``server`` (the asyncio process),
``client`` (its asyncio client) and ``tenant`` (a user's server's long-lived link). See docs/host-ledger.md.
"""
