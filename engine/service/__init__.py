"""The engine as a service: one engine shared by many clients over a persistent WebSocket.

``protocol`` (the messages), ``connection`` (one client's protocol state, transport-free),
``local`` (models served from this process), ``server`` (the WebSocket server with token and
origin checks), ``daemon`` (the long-running process and its record in the user's runtime dir),
``client`` (asyncio and thread-side clients), ``ray_app`` (the same service on Ray Serve).
docs/engine-protocol.md describes the protocol; docs/service.md how to run it.
"""
