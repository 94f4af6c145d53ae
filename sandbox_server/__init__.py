"""Reference HTTP sandbox service for lightning-agentrl (protocol v1).

Run it with ``python -m sandbox_server --host 127.0.0.1 --port 8080 --token T`` or, from Python,
with :func:`sandbox_server.launch.start_local_server`. The protocol is described in
``docs/sandbox.md``; the server also publishes its OpenAPI schema at ``/v1/openapi.json``.
"""

from sandbox_server.options import ServerOptions

PROTOCOL_VERSION = "v1"

__all__ = ["PROTOCOL_VERSION", "ServerOptions"]
