"""A fleet of replicas on one registry (``HOTWIRE_REGISTRY=redis://host:6379/0``): every replica's control plane
registers and deletes vectors through Redis, which numbers the versions for all of them, and follows Redis's
event stream to apply everyone else's changes to its own engine cores. The engine core knows nothing of Redis:
it is told ``version=N`` exactly as data-parallel engine cores are (``hotwire_api.engine``).

Modules, one job each: ``config`` (the setting, key names, a URL safe to print), ``blobs`` (a vector as
content-addressed safetensors bytes), ``lua`` (the Lua scripts Redis runs), ``redis_registry`` (every Redis
command hotwire sends), ``standing`` (what this replica's jobs share: whether Redis answers, the versions it
knows, the follower's progress), ``changes`` (registration and deletion through the registry), ``follower``
(applies the stream to this replica's engine cores, resyncs, collects blobs), ``heartbeat`` (the heartbeat, the
registry section of ``/steer/slots`` and the fleet view), ``repair`` (a Redis that restarted or lost data: what
this replica puts back, and the gate that holds changes until the replicas have), ``replica`` (those jobs
together: started, caught up before the API server takes requests, stopped), ``fleet_registry`` (the
``hotwire_api.vector_registry`` interface the routes call, over this API server's replica). docs/fleet.md
describes the whole.
"""
