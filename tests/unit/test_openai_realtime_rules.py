"""The `openai-realtime` runtime's settings and its sans-I/O event mapping."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from portico.config import load_settings
from portico.errors import ConfigError
from portico.runtime.duplex.base import AudioIn, DuplexFailure, Interruption, SpokenTurnDone
from portico.runtime.duplex.openai_realtime import (
    OpenAIRealtimeRuntime,
    RealtimeMapping,
    audio_append,
    build,
)
from portico.runtime.openai import OpenAIRuntime
from portico.server.services import build_runtime

REALTIME_ENV = {
    "PORTICO_RUNTIME": "openai-realtime",
    "PORTICO_OPENAI_BASE_URL": "http://127.0.0.1:9/v1",
    "PORTICO_OPENAI_MODEL": "gpt-realtime",
    "PORTICO_OPENAI_API_KEY_ENV": "MY_KEY",
}


def test_the_default_agent_is_an_openai_realtime_agent_from_the_environment() -> None:
    settings = load_settings(env=REALTIME_ENV)
    settings.check_startable({"MY_KEY": "sk"})
    default = settings.agent("default")
    assert default is not None
    assert default.runtime == "openai-realtime"
    assert (default.base_url, default.model) == ("http://127.0.0.1:9/v1", "gpt-realtime")
    # Text turns: chat completions at the same base URL; calls: the Realtime API.
    assert isinstance(build_runtime(default, settings), OpenAIRuntime)
    assert isinstance(build(default, {"MY_KEY": "sk"}), OpenAIRealtimeRuntime)


def test_an_openai_realtime_agent_without_a_model_is_refused() -> None:
    settings = load_settings(env={"PORTICO_RUNTIME": "openai-realtime"})
    with pytest.raises(ConfigError, match="PORTICO_OPENAI_BASE_URL, PORTICO_OPENAI_MODEL"):
        settings.check_startable({})


def test_an_unset_key_variable_is_refused() -> None:
    with pytest.raises(ConfigError, match="MY_KEY, which is not set"):
        load_settings(env=REALTIME_ENV).check_startable({})


def test_the_last_frame_commits_and_asks_for_a_reply() -> None:
    assert [e["type"] for e in audio_append(AudioIn(b"\x00\x01", 3, is_last=True))] == [
        "input_audio_buffer.append",
        "input_audio_buffer.commit",
        "response.create",
    ]
    (append,) = audio_append(AudioIn(b"\x00\x01", 0))
    assert base64.b64decode(append["audio"]) == b"\x00\x01"


def test_barge_in_cancels_only_a_response_in_progress() -> None:
    mapping = RealtimeMapping(model="m")
    assert mapping.on_event({"type": "input_audio_buffer.speech_started"}) == []
    assert mapping.take_replies() == []
    mapping.on_event({"type": "response.created"})
    assert mapping.on_event({"type": "input_audio_buffer.speech_started"}) == [Interruption()]
    assert mapping.take_replies() == [{"type": "response.cancel"}]


def test_a_failed_response_is_a_failure_not_a_turn() -> None:
    mapping = RealtimeMapping(model="m")
    (event,) = mapping.on_event({"type": "response.done", "response": {"status": "failed"}})
    assert isinstance(event, DuplexFailure)
    assert mapping.on_event({"type": "response.done"}) == [SpokenTurnDone()]


json_values: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=10,
)
event_types = st.sampled_from(
    [
        "response.created",
        "response.audio.delta",
        "response.output_audio.delta",
        "response.audio_transcript.delta",
        "conversation.item.input_audio_transcription.completed",
        "input_audio_buffer.speech_started",
        "response.done",
        "error",
        "session.created",
    ]
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=event_types,
    fields=st.dictionaries(
        st.sampled_from(["delta", "transcript", "item_id", "response", "error"]), json_values
    ),
)
def test_any_server_event_maps_without_raising(kind: str, fields: dict[str, Any]) -> None:
    mapping = RealtimeMapping(model="m")
    events = mapping.on_event({**fields, "type": kind})
    assert len(events) <= 1


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(max_size=40) | st.binary(max_size=40))
def test_any_socket_text_maps_or_fails_the_call(text: str | bytes) -> None:
    events = RealtimeMapping(model="m").on_text(text)
    assert len(events) <= 1
    assert all(isinstance(e, DuplexFailure) for e in events) or events == []


def test_malformed_audio_fails_the_call() -> None:
    (event,) = RealtimeMapping(model="m").on_event(
        {"type": "response.audio.delta", "delta": "not base64!"}
    )
    assert event == DuplexFailure("PROVIDER_UNAVAILABLE", "the model m sent malformed audio")
