"""The shared pod-level tier: ``kvtier serve`` and what it is made of.

Many engine workers (and many tenants) share one store through it: a context
one worker computed is loaded by any other. Clients use
:class:`kvtier.tiers.remote.RemoteTier`. Heavy imports (uvloop, zmq,
prometheus-client) happen in the modules that need them, not here.
"""
