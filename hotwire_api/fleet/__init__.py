"""A fleet of replicas on one registry (``HOTWIRE_REGISTRY=redis://host:6379/0``): every replica's control plane
registers and deletes vectors through Redis, which numbers the versions for all of them, and follows Redis's
event stream to apply everyone else's changes to its own engine cores. The engine core knows nothing of Redis:
it is told ``version=N`` exactly as data-parallel engine cores are (``hotwire_api.engine``).

Modules, one job each: ``config`` (the setting, key names, a URL safe to print), ``blobs`` (a vector as
content-addressed safetensors bytes), ``lua`` (the Lua scripts Redis runs), ``redis_registry`` (every Redis
command hotwire sends), ``replica`` (this replica: registration and deletion through the registry, the follower
that applies the stream, the heartbeat and the fleet view), ``repair`` (a Redis that restarted or lost data: what
this replica puts back, and the gate that holds changes until the replicas have). docs/fleet.md describes the
whole.
"""
