"""``python -m sandbox_server --host 127.0.0.1 --port 8080 [--max-sandboxes N ...]``: serve protocol v1.

Every option is a ``--flag-name VALUE`` (a boolean: ``--flag-name`` / ``--no-flag-name``) and a
``SANDBOX_SERVER_<NAME>`` environment variable (``SANDBOX_SERVER_MAX_SANDBOXES=16``); a flag wins
over its variable. ``--help`` lists them with their documentation (``ServerOptions``' field docs).
Pass the token as ``SANDBOX_SERVER_TOKEN`` rather than ``--token``: command lines are visible to
every user of the host.
"""

from __future__ import annotations

import inspect
import logging
import sys
from typing import Literal

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, CliApp, SettingsConfigDict

from sandbox_server.options import ServerOptions, describe

ENV_PREFIX = "SANDBOX_SERVER_"
TOKEN_ENV = f"{ENV_PREFIX}TOKEN"


class ServeCommand(BaseSettings, ServerOptions):
    """Reference sandbox service for lightning-agentrl (protocol v1, docs/sandbox.md). Every option is also
    an environment variable SANDBOX_SERVER_<NAME> (the token: SANDBOX_SERVER_TOKEN, preferred over --token,
    which other users of the host can see in `ps`); a flag wins over its variable."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, cli_prog_name="python -m sandbox_server",
                                      cli_kebab_case=True, cli_implicit_flags=True, use_attribute_docstrings=True,
                                      extra="forbid")

    host: str = "127.0.0.1"
    """Address to listen on."""

    port: int = Field(8080, ge=0, le=65535)
    """Port to listen on."""

    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = "info"
    """Log level of the server and of uvicorn's access log (method, path and status; never headers)."""


ServeCommand.__doc__ = inspect.cleandoc(ServeCommand.__doc__ or "")  # --help prints it as written


def parse(argv: list[str] | None = None) -> tuple[ServeCommand, ServerOptions]:
    """The command line and environment as (where to listen, the server's options); exits with a message
    naming the option when one is invalid or the token is missing."""
    try:
        command = CliApp.run(ServeCommand, cli_args=sys.argv[1:] if argv is None else argv)
        options = ServerOptions.model_validate(command.model_dump(exclude={"host", "port", "log_level"}))
    except ValidationError as exc:
        sys.exit(f"error: {describe(exc)}")
    if not options.token:
        sys.exit(f"error: a token is required: --token T or the {TOKEN_ENV} environment variable")
    return command, options


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from sandbox_server.app import create_app
    from sandbox_server.connections import bounded_protocol

    command, options = parse(argv)
    logging.basicConfig(level=command.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        app = create_app(options)
    except (ValueError, RuntimeError) as exc:
        sys.exit(f"error: {exc}")
    # Access logs carry method, path and status only; headers (and so the token) are never logged.
    protocol = bounded_protocol(options.header_timeout_s, options.max_connections_per_client)
    # A stop (or a parent's death, PR_SET_PDEATHSIG) waits 1 s for requests in flight, not for a long exec: the
    # sandboxes (and their commands) are removed right after, so a killed trainer leaves nothing running for long.
    uvicorn.run(app, host=command.host, port=command.port, log_level=command.log_level, timeout_graceful_shutdown=1,
                http=protocol)


if __name__ == "__main__":
    main()
