"""The rules of one call's event stream, sans-I/O: runtime events in, the events to
forward and the voice turns to archive out.

- The first event must be `Hello`; a runtime that speaks before it fails the call.
- A `Hello` offering video ends the call with UNSATISFIABLE_FORMAT (Portico carries
  audio only); a second `Hello` is dropped.
- A `DuplexFailure` is forwarded once and ends the call; nothing follows it.
- Voice turns become text turns: the caller's final transcript is the user message,
  the agent's text until `SpokenTurnDone` its reply (completed). A barge-in ends the
  turn `cancelled` with what the agent had said; a call that ends mid-turn too; a
  failure ends it `failed`. Agent speech with no utterance before it (a greeting) is
  a reply alone.
- A client's barge-in (`interrupt`, `/v1/session`) while the agent speaks ends its
  turn `cancelled` with what it had said, and the rest of that spoken turn (its
  text, its speech, its end) is not forwarded: the runtime is not told (the duplex
  port has no such message), so Portico mutes it until the runtime's next turn.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from portico.domain.states import TurnState
from portico.runtime.duplex.base import (
    AgentText,
    AudioOut,
    DuplexEvent,
    DuplexFailure,
    Hello,
    Interruption,
    SpokenTurnDone,
    Transcript,
)

UNSATISFIABLE_FORMAT = "UNSATISFIABLE_FORMAT"
DUPLEX_ERROR = "DUPLEX_ERROR"


class VoiceTurnRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One spoken exchange, as the archive keeps it."""

    user_text: str  # "" when the agent spoke unprompted
    reply_text: str  # "" when the agent said nothing
    state: TurnState
    error_code: str = ""
    error_message: str = ""


class Step(NamedTuple):
    forward: list[DuplexEvent]
    records: list[VoiceTurnRecord]
    ended: bool  # the call is over: close it


class CallRules:
    def __init__(self) -> None:
        self.hello: Hello | None = None
        self.ended = False
        self._heard: list[str] = []  # partial transcripts of the utterance being heard
        self._user: str | None = None  # the utterance the agent is answering
        self._said: list[str] = []
        self._speaking = False  # the agent's turn has produced speech
        self._muted = False  # the client interrupted this spoken turn: drop the rest

    def feed(self, event: DuplexEvent) -> Step:
        if self.ended:
            return Step([], [], True)
        if self.hello is None and not isinstance(event, Hello | DuplexFailure):
            return self._fail(DuplexFailure(DUPLEX_ERROR, "the runtime spoke before its format"))
        if self._muted and isinstance(event, AgentText | AudioOut | SpokenTurnDone | Interruption):
            # The rest of the turn the client interrupted; its end unmutes.
            self._muted = not isinstance(event, SpokenTurnDone | Interruption)
            return Step([], [], False)
        match event:
            case Hello():
                return self._hello(event)
            case Transcript():
                if event.final:
                    self._muted = False  # a new utterance: the agent's next turn is heard
                return Step([event], self._heard_text(event), False)
            case AgentText(text=text):
                self._said.append(text)
            case AudioOut():
                self._speaking = True
            case SpokenTurnDone(content=content):
                said = "".join(self._said) if content is None else content
                return Step([event], self._close(TurnState.COMPLETED, said), False)
            case Interruption():
                return Step([event], self._close(TurnState.CANCELLED), False)
            case DuplexFailure():
                return self._fail(event)
        return Step([event], [], False)

    def audio_out(self) -> bool:
        """`feed(AudioOut)` of a started call that has not ended, without its Step: True
        when the audio is forwarded (the turn is speaking), False while muted (dropped).
        Per agent frame, so the caller checks `hello` and `ended` and makes no lists."""
        if self._muted:
            return False
        self._speaking = True
        return True

    def interrupt(self) -> Step:
        """The client barged in: the agent's turn in progress (it has spoken) ends
        cancelled, `Interruption` is forwarded, and the rest of that turn is muted."""
        if self.ended or self.hello is None or not (self._said or self._speaking):
            return Step([], [], False)
        self._muted = True
        return Step([Interruption()], self._close(TurnState.CANCELLED), False)

    def finish(self) -> list[VoiceTurnRecord]:
        """The call ended (hangup, IsLast, close): a turn in progress ends cancelled."""
        self.ended = True
        return self._close(TurnState.CANCELLED)

    def _hello(self, hello: Hello) -> Step:
        if self.hello is not None:
            return Step([], [], False)
        if hello.format.is_video:
            fmt = hello.format
            return self._fail(
                DuplexFailure(
                    UNSATISFIABLE_FORMAT,
                    f"the runtime offered video (frame_rate {fmt.frame_rate}, resolution "
                    f"{fmt.resolution}); Portico carries audio only",
                )
            )
        self.hello = hello
        return Step([hello], [], False)

    def _heard_text(self, transcript: Transcript) -> list[VoiceTurnRecord]:
        if not transcript.final:
            self._heard.append(transcript.text)
            return []
        heard = transcript.text or "".join(self._heard)
        self._heard = []
        records = self._close(TurnState.COMPLETED)  # the agent's last turn, unfinished
        self._user = heard
        return records

    def _close(
        self, state: TurnState, said: str | None = None, failure: DuplexFailure | None = None
    ) -> list[VoiceTurnRecord]:
        reply = "".join(self._said) if said is None else said
        user, self._user, self._said = self._user, None, []
        self._speaking = False
        if not user and not reply:
            return []
        return [
            VoiceTurnRecord(
                user_text=user or "",
                reply_text=reply,
                state=state,
                error_code=failure.code if failure else "",
                error_message=failure.message if failure else "",
            )
        ]

    def _fail(self, failure: DuplexFailure) -> Step:
        self.ended = True
        return Step([failure], self._close(TurnState.FAILED, failure=failure), True)
