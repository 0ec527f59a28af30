"""The agent SDK: write one async handler, run it in Portico's process or in its own.

    from portico.agent import Reply, ToolResult, Turn

    async def handler(turn: Turn) -> AsyncIterator[Reply]:
        yield f"You said: {turn.text}"

In the server: ``PORTICO_RUNTIME=python PORTICO_PLUGIN=mymodule:handler portico serve``.
In its own process (the gRPC runtime contract, needs the `grpc` extra):
``portico agent serve mymodule:handler --port 50051``; a voice agent adds
``--voice mymodule:voice`` (`VoiceCall`). See docs/agents.md.
"""

from portico.agent.api import (
    Handler,
    HistoryMessage,
    Media,
    Part,
    Reply,
    ToolAnswer,
    ToolRejected,
    ToolResult,
    Turn,
    Usage,
)
from portico.agent.voice import AudioFormat, AudioFrame, VoiceCall, VoiceHandler
from portico.domain.model import MediaContent
from portico.errors import AgentError

__all__ = [
    "AgentError",
    "AudioFormat",
    "AudioFrame",
    "Handler",
    "HistoryMessage",
    "Media",
    "MediaContent",
    "Part",
    "Reply",
    "ToolAnswer",
    "ToolRejected",
    "ToolResult",
    "Turn",
    "Usage",
    "VoiceCall",
    "VoiceHandler",
]
