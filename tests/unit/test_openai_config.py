"""Settings of the openai runtime: the default agent from `openai_*`, agents in the file,
and the start-up refusals that name the setting."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from portico.config import (
    AgentSettings,
    BuiltinToolSettings,
    ClientToolSettings,
    HttpToolSettings,
    Settings,
    load_settings,
)
from portico.errors import ConfigError
from portico.runtime.openai import OpenAIRuntime
from portico.server.services import build_runtime

OPENAI_ENV = {
    "PORTICO_RUNTIME": "openai",
    "PORTICO_OPENAI_BASE_URL": "http://127.0.0.1:9/v1",
    "PORTICO_OPENAI_MODEL": "gpt-test",
    "PORTICO_OPENAI_API_KEY_ENV": "MY_KEY",
    "PORTICO_OPENAI_SYSTEM_PROMPT": "Be brief.",
}


def agent(**fields: Any) -> Settings:
    base = {"runtime": "openai", "base_url": "https://api.example.com/v1", "model": "m"}
    return load_settings(env={}, flags={"agents": {"bot": {**base, **fields}}})


def test_the_default_agent_takes_the_openai_settings_from_the_environment() -> None:
    settings = load_settings(env=OPENAI_ENV)
    default = settings.agent("default")
    assert default is not None
    assert (default.runtime, default.base_url, default.model) == (
        "openai",
        "http://127.0.0.1:9/v1",
        "gpt-test",
    )
    assert (default.api_key_env, default.system_prompt) == ("MY_KEY", "Be brief.")
    assert default.first_token_timeout == 90.0
    settings.check_startable({"MY_KEY": "sk-1"})
    assert isinstance(build_runtime(default, settings), OpenAIRuntime)


def test_an_agent_in_the_file_with_tools(tmp_path: Path) -> None:
    path = tmp_path / "portico.yaml"
    path.write_text(
        """
agents:
  support:
    runtime: openai
    base_url: http://localhost:11434/v1
    model: llama3.1
    max_rounds: 4
    compact_after_tokens: 30000
    tools:
      - {kind: builtin, name: current_time}
      - kind: http
        name: weather
        url: "https://weather.example.com/{city}"
        parameters: {type: object, properties: {city: {type: string}}, required: [city]}
        headers_env: {Authorization: WEATHER_AUTH}
      - {kind: client, name: get_location, consent_message: "Share?", categories: [location]}
""",
        encoding="utf-8",
    )
    settings = load_settings(config_file=str(path), env={})
    support = settings.agents["support"]
    assert [type(tool) for tool in support.tools] == [
        BuiltinToolSettings,
        HttpToolSettings,
        ClientToolSettings,
    ]
    assert (support.max_rounds, support.compact_after_tokens) == (4, 30000)
    settings.check_startable({"WEATHER_AUTH": "Bearer w"})


@pytest.mark.parametrize(
    ("fields", "env", "message"),
    [
        ({"model": None}, {}, "agent 'bot': the openai runtime needs base_url and model"),
        ({"base_url": None}, {}, "agent 'bot': the openai runtime needs base_url and model"),
        ({"base_url": "ftp://x"}, {}, "base_url must start with http:// or https://"),
        ({"api_key_env": "NOPE"}, {}, "api_key_env names NOPE, which is not set"),
        (
            {"tools": [{"kind": "builtin", "name": "current_time"}] * 2},
            {},
            "tool names must be unique",
        ),
        (
            {"tools": [{"kind": "client", "name": "x", "parameters": {"type": "nothing"}}]},
            {},
            "tool 'x': parameters is not a valid JSON Schema",
        ),
        (
            {"tools": [{"kind": "http", "name": "w", "url": "file:///etc/passwd"}]},
            {},
            "tool 'w': url must start with http:// or https://",
        ),
        (
            {
                "tools": [
                    {"kind": "http", "name": "w", "url": "https://x", "headers_env": {"A": "B"}}
                ]
            },
            {},
            "tool 'w': headers_env names B, which is not set",
        ),
    ],
)
def test_an_agent_that_cannot_run_refuses_to_start(
    fields: dict[str, Any], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        agent(**fields).check_startable(env)


def test_the_default_agent_without_a_model_names_the_environment_variables() -> None:
    settings = load_settings(env={"PORTICO_RUNTIME": "openai"})
    with pytest.raises(ConfigError, match="PORTICO_OPENAI_BASE_URL, PORTICO_OPENAI_MODEL"):
        settings.check_startable({})


@pytest.mark.parametrize(
    ("fields", "refusal"),
    [
        (
            {"tools": [{"kind": "builtin", "name": "rm_rf"}]},
            "agents.bot.tools[0].name: invalid value 'rm_rf'; valid values: current_time",
        ),
        (
            {"tools": [{"kind": "http", "name": "bad name", "url": "https://x"}]},
            "agents.bot.tools[0].name: invalid value 'bad name'; expected `str` matching",
        ),
        (
            {"tools": [{"kind": "smtp", "name": "x"}]},
            "agents.bot.tools[0].kind: invalid value 'smtp'; valid values: builtin, client, http",
        ),
        ({"first_token_timeout": 0}, "agents.bot.first_token_timeout: invalid value 0"),
        ({"max_rounds": 0}, "agents.bot.max_rounds: invalid value 0; expected `int` >= 1"),
        # Only the NAME of a variable is a setting.
        (
            {"api_key": "sk-in-the-file"},
            "agents.bot: unknown setting 'api_key' (did you mean 'api_key_env'?)",
        ),
    ],
)
def test_invalid_openai_fields_are_refused_when_loading(
    fields: dict[str, Any], refusal: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        agent(**fields)
    assert refusal in refused.value.message
    assert "sk-in-the-file" not in refused.value.message


def test_other_runtimes_ignore_the_openai_fields() -> None:
    Settings(agents={"x": AgentSettings(runtime="echo")}).check_startable({})
