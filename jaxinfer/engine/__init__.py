"""The engine: requests in, tokens out, one step at a time.

``engine.Engine`` is the in-process API (add_request / step / abort / generate);
``async_engine.AsyncEngine`` drives it from its own thread for servers. A request's walk
through these modules, stop by stop (each stop a ``file:function``, which
tests/test_docs.py checks exists), the life of a step, start-up and the invariants are in
docs/architecture.md: keep them there, in the same commit as the code they describe.
"""
