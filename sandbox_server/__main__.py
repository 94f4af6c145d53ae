"""``python -m sandbox_server --host 127.0.0.1 --port 8080 [--token T] [--max-sandboxes N ...]``.

The token may also come from the SANDBOX_SERVER_TOKEN environment variable (preferred: command
lines are visible to every user of the host).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import typing

from sandbox_server.options import ServerOptions

TOKEN_ENV = "SANDBOX_SERVER_TOKEN"


def _flag(text: str) -> bool:
    lowered = text.lower()
    if lowered not in ("true", "false", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return lowered in ("true", "1", "yes")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sandbox_server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--log-level", default="info")
    hints = typing.get_type_hints(ServerOptions)
    for f in dataclasses.fields(ServerOptions):
        kind = hints[f.name]
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, type=_flag, nargs="?", const=True, default=f.default)
        elif kind in (int, float):
            parser.add_argument(flag, type=kind, default=f.default)
        else:
            parser.add_argument(flag, default=f.default)
    return parser


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from sandbox_server.app import create_app

    args = vars(build_parser().parse_args(argv))
    host, port, log_level = args.pop("host"), args.pop("port"), args.pop("log_level")
    args["token"] = args["token"] or os.environ.get(TOKEN_ENV, "")
    if not args["token"]:
        sys.exit(f"error: a token is required: --token T or the {TOKEN_ENV} environment variable")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        options = ServerOptions(**args)
        app = create_app(options)
    except (ValueError, RuntimeError) as exc:
        sys.exit(f"error: {exc}")
    # Access logs carry method, path and status only; headers (and so the token) are never logged.
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
