"""The `portico` command: `serve`, `config show`, `chat`, `agent serve`.

Exit status: 0 done; 1 the archive could not be opened or a chat session failed;
2 the command line, a setting or the machine refuses to start the server (a bad
value, a port in use, a data dir that cannot be written); 130 interrupted. Every
failure a user can cause is one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import os
import sys
from collections.abc import Sequence
from typing import Any, get_args

import msgspec
import yaml

from portico import __version__
from portico.agent.loader import load_handler, load_voice_handler
from portico.agent.options import AgentOptions, agent_options
from portico.client.chat import DEFAULT_URL, ChatOptions, run_chat
from portico.config import (
    RuntimeName,
    Settings,
    StoreName,
    environment_warnings,
    load_settings,
)
from portico.errors import ConfigError, StoreError
from portico.server.app import serve
from portico.server.observability import configure_logging


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="portico", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"portico {version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve_cmd = commands.add_parser("serve", help="run the server")
    _add_setting_flags(serve_cmd)

    config_cmd = commands.add_parser("config", help="inspect settings")
    config_sub = config_cmd.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print the effective settings (credentials masked)")
    _add_setting_flags(show)

    chat_cmd = commands.add_parser("chat", help="chat with an agent over /v1/session")
    chat_cmd.add_argument("--url", default=DEFAULT_URL, help=f"session endpoint ({DEFAULT_URL})")
    chat_cmd.add_argument(
        "--credential", help="sent in hello (default: the PORTICO_CREDENTIAL variable)"
    )
    chat_cmd.add_argument("--agent", help="the agent to talk to (default: the server's)")
    chat_cmd.add_argument(
        "--session", metavar="ID", help="continue this archived conversation (a session id)"
    )
    chat_cmd.add_argument(
        "--metadata",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="metadata sent with every message (repeatable)",
    )
    _add_agent_command(commands)
    return parser


def version() -> str:
    """The installed distribution's version; the source tree's when run uninstalled."""
    try:
        return importlib.metadata.version("portico")
    except importlib.metadata.PackageNotFoundError:
        return __version__


# The `portico agent serve` flags: AgentOptions' fields, with their defaults.
AGENT_OPTION_HELP = {
    "client_tool_timeout": "seconds a client tool call waits before the handler gets a "
    "rejection; 0: no limit",
    "memory_timeout": "seconds a turn.memory call waits for the facade's answer",
    "max_conversations": "conversations whose history the agent keeps",
    "max_history_messages": "messages kept per conversation",
    "max_queued_turns": "turns of one stream waiting behind the running one",
    "grace": "seconds running turns get on SIGTERM",
    "max_queued_audio_frames": "caller audio frames a voice call holds before its handler reads",
}


def _add_agent_command(commands: Any) -> None:
    agent_cmd = commands.add_parser("agent", help="run an agent handler (portico.agent)")
    agent_sub = agent_cmd.add_subparsers(dest="agent_command", required=True)
    serve = agent_sub.add_parser(
        "serve", help="serve a handler over the gRPC runtime contract (omnia.runtime.v1)"
    )
    serve.add_argument("handler", help="the handler: module:attr, or a portico.agents entry point")
    serve.add_argument(
        "--voice", help="the voice handler for duplex calls: module:attr (docs/agents.md, Voice)"
    )
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (127.0.0.1)")
    serve.add_argument("--port", type=int, default=50051, help="0 picks a free one (50051)")
    defaults = msgspec.structs.asdict(AgentOptions())
    for option, meaning in AGENT_OPTION_HELP.items():
        default = defaults[option]
        serve.add_argument(
            "--" + option.replace("_", "-"),
            dest=option,
            type=type(default),
            default=default,
            help=f"{meaning} ({default:g})",
        )
    serve.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")


def _run_agent(args: argparse.Namespace) -> None:
    try:
        from portico.agent.server import serve_agent
    except ImportError as exc:
        raise ConfigError("portico agent serve needs grpcio: pip install 'portico[grpc]'") from exc
    values = {option: getattr(args, option) for option in AGENT_OPTION_HELP}
    values["client_tool_timeout"] = values["client_tool_timeout"] or None  # 0: no limit
    options = agent_options(values)
    handler = load_handler(args.handler)
    voice = load_voice_handler(args.voice) if args.voice else None
    configure_logging(args.log_level.upper())
    asyncio.run(
        serve_agent(
            handler,
            host=args.host,
            port=args.port,
            options=options,
            on_ready=lambda line: print(line, flush=True),
            voice=voice,
        )
    )


def _add_setting_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="settings file (YAML or JSON)")
    parser.add_argument("--host", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to bind; 0 picks a free one (default 8080)")
    parser.add_argument(
        "--data-dir", dest="data_dir", help="archive and media (default ./.portico)"
    )
    parser.add_argument(
        "--runtime", choices=list(get_args(RuntimeName)), help="the default agent's runtime"
    )
    parser.add_argument("--script", help="the scripted runtime's file (JSON or YAML)")
    parser.add_argument("--auth", choices=["none", "apikey", "jwt"], help="authentication")
    parser.add_argument("--store", choices=list(get_args(StoreName)), help="archive backend")
    parser.add_argument(
        "--allow-unauthenticated",
        dest="allow_unauthenticated",
        action="store_const",
        const=True,
        help="permit --auth none on a non-loopback bind",
    )
    parser.add_argument("--log-level", dest="log_level", help="DEBUG, INFO, WARNING or ERROR")


FLAG_SETTINGS = (
    "host",
    "port",
    "data_dir",
    "runtime",
    "script",
    "auth",
    "store",
    "allow_unauthenticated",
    "log_level",
)


def _settings(args: argparse.Namespace) -> Settings:
    flags: dict[str, Any] = {name: getattr(args, name) for name in FLAG_SETTINGS}
    for warning in environment_warnings(os.environ):
        print(f"portico: warning: {warning}", file=sys.stderr)
    return load_settings(config_file=args.config, flags=flags)


def _run_server(settings: Settings) -> None:
    settings.check_startable()
    configure_logging(settings.log_level)
    try:
        import uvloop
    except ImportError:  # uvloop is optional on platforms without it
        asyncio.run(serve(settings, on_ready=lambda line: print(line, flush=True)))
    else:
        uvloop.run(serve(settings, on_ready=lambda line: print(line, flush=True)))


def _chat_options(args: argparse.Namespace) -> ChatOptions:
    metadata = {}
    for item in args.metadata:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--metadata takes KEY=VALUE, not {item!r}")
        metadata[key] = value
    if not args.url.startswith(("ws://", "wss://")):
        raise ConfigError(f"--url must start with ws:// or wss://, not {args.url!r}")
    return ChatOptions(
        url=args.url,
        credential=args.credential or os.environ.get("PORTICO_CREDENTIAL"),
        agent=args.agent,
        metadata=metadata,
        session=args.session,
    )


def _without_grpc_fork_handlers() -> None:
    """Portico forks only to exec (MCP servers, the archive's writer process), never to
    run gRPC in a child, so gRPC's fork handlers are of no use here; with a channel
    active they can crash the child before its exec (grpc/grpc#43055: "epoll_wait error:
    Bad file descriptor", the child killed by SIGABRT). Read by gRPC when it loads, so
    set before anything imports it; an operator's own setting stands."""
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


def main(argv: Sequence[str] | None = None) -> int:
    _without_grpc_fork_handlers()
    args = _parser().parse_args(argv)
    try:
        if args.command == "chat":
            return asyncio.run(run_chat(_chat_options(args)))
        if args.command == "agent":
            _run_agent(args)
            return 0
        settings = _settings(args)
        if args.command == "serve":
            _run_server(settings)
        else:
            sys.stdout.write(yaml.safe_dump(settings.redacted(), sort_keys=True))
    except ConfigError as exc:
        print(f"portico: {exc.message}", file=sys.stderr)
        return 2
    except StoreError as exc:  # the archive cannot be opened: say why, no traceback
        print(f"portico: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


__all__ = ["main"]
