"""Settings: precedence, conversion, validation, start-up refusals, redaction."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from portico.config import (
    AgentSettings,
    Settings,
    environment_warnings,
    load_settings,
    parse_api_keys,
)
from portico.errors import ConfigError


def write_config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "portico.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def load(
    env: dict[str, str] | None = None,
    *,
    config_file: str | None = None,
    flags: dict[str, Any] | None = None,
) -> Settings:
    return load_settings(config_file=config_file, env=env or {}, flags=flags)


# -- precedence ---------------------------------------------------------------------


# The settings table of the foundation issue that operators and tests rely on:
# (environment variable, default, a value set through it, the value it sets).
SETTINGS_TABLE: list[tuple[str, object, str, object]] = [
    ("PORTICO_HOST", "127.0.0.1", "10.1.2.3", "10.1.2.3"),
    ("PORTICO_PORT", 8080, "9090", 9090),
    ("PORTICO_DATA_DIR", "./.portico", "/var/lib/portico", "/var/lib/portico"),
    ("PORTICO_RUNTIME", "demo", "echo", "echo"),
    ("PORTICO_SCRIPT", None, "script.yaml", "script.yaml"),
    ("PORTICO_AUTH", "none", "apikey", "apikey"),
    ("PORTICO_API_KEYS", {}, "tok=alice", {"tok": "alice"}),
    ("PORTICO_CONTEXT_TTL", 86400, "12.5", 12.5),
    ("PORTICO_PING_INTERVAL", 30, "2.5", 2.5),
    ("PORTICO_PONG_TIMEOUT", 60, "7", 7),
    ("PORTICO_MAX_PAYLOAD_SIZE", 16777216, "4096", 4096),
    ("PORTICO_TOOL_ACK_TIMEOUT", 5, "1.5", 1.5),
    ("PORTICO_CLIENT_TOOL_TIMEOUT", 60, "90", 90),
    ("PORTICO_MEDIA", "local", "none", "none"),
    ("PORTICO_MAX_UPLOAD_BYTES", 104857600, "1000", 1000),
    ("PORTICO_MAX_INLINE_MEDIA_BYTES", 12582912, "1000", 1000),
    ("PORTICO_MEDIA_TTL", 86400, "60", 60),
    ("PORTICO_MAX_CONNECTIONS", 10000, "12", 12),
    ("PORTICO_DRAIN_TIMEOUT", 30, "3", 3),
    ("PORTICO_ORIGINS", (), "https://a.example", ("https://a.example",)),
    ("PORTICO_RATE_LIMIT_MESSAGES", 50, "2.5", 2.5),
    ("PORTICO_RATE_LIMIT_BURST", 100, "7", 7),
    ("PORTICO_MEDIA_RATE_BYTES", 2097152, "1000", 1000),
    ("PORTICO_MEDIA_RATE_BURST", 16777216, "1000", 1000),
    ("PORTICO_RESUME_WINDOW", 30, "4", 4),
    ("PORTICO_SESSION_IDLE_TIMEOUT", 45, "6", 6),
    ("PORTICO_HEARTBEAT_INTERVAL", 15, "2", 2),
    ("PORTICO_RESEND_BUFFER_MESSAGES", 1000, "10", 10),
    ("PORTICO_RESEND_BUFFER_BYTES", 8388608, "2048", 2048),
    ("PORTICO_UPDATE_RETENTION", 604800, "3600", 3600),
    ("PORTICO_STORE", "sqlite", "postgres", "postgres"),
    ("PORTICO_DATABASE_URL", "", "postgresql://db/portico", "postgresql://db/portico"),
    ("PORTICO_DATABASE_POOL_SIZE", 10, "3", 3),
    ("PORTICO_REPLICA_ID", "", "portico-0", "portico-0"),
    ("PORTICO_REPLICA_LEASE", 30, "4.5", 4.5),
    ("PORTICO_TURN_FENCE_TTL", 86400, "600", 600),
    ("PORTICO_REDIS_CLOSE_TIMEOUT", 5, "0.5", 0.5),
]


def _field(env_name: str) -> str:
    return env_name.removeprefix("PORTICO_").lower()


TABLE_IDS = [_field(row[0]) for row in SETTINGS_TABLE]


@pytest.mark.parametrize(
    ("env_name", "default"), [(row[0], row[1]) for row in SETTINGS_TABLE], ids=TABLE_IDS
)
def test_default_is_the_documented_one(env_name: str, default: object) -> None:
    assert getattr(load(), _field(env_name)) == default


@pytest.mark.parametrize(
    ("env_name", "raw", "expected"),
    [(row[0], row[2], row[3]) for row in SETTINGS_TABLE],
    ids=TABLE_IDS,
)
def test_each_setting_reads_its_environment_variable(
    env_name: str, raw: str, expected: object
) -> None:
    value = getattr(load({env_name: raw}), _field(env_name))
    assert value == expected
    assert value != getattr(Settings(), _field(env_name))  # the variable changed it


def test_defaults_need_no_file_environment_or_flags() -> None:
    assert load() == Settings()


def test_config_file_overrides_defaults(tmp_path: Path) -> None:
    path = write_config(tmp_path, "port: 9001\nping_interval: 2.5\nstore: memory\n")
    settings = load(config_file=path)
    assert (settings.port, settings.ping_interval, settings.store) == (9001, 2.5, "memory")
    assert settings.host == "127.0.0.1"


def test_env_overrides_file_and_flags_override_env(tmp_path: Path) -> None:
    path = write_config(tmp_path, "port: 9001\nhost: 10.0.0.1\nlog_level: DEBUG\n")
    env = {"PORTICO_PORT": "9002", "PORTICO_HOST": "10.0.0.2"}
    settings = load(env, config_file=path, flags={"port": 9003})
    assert settings.port == 9003  # flag
    assert settings.host == "10.0.0.2"  # env
    assert settings.log_level == "DEBUG"  # file


def test_flags_set_to_none_do_not_override(tmp_path: Path) -> None:
    settings = load({"PORTICO_PORT": "9002"}, flags={"port": None, "host": None})
    assert (settings.port, settings.host) == (9002, "127.0.0.1")


def test_config_file_named_by_env(tmp_path: Path) -> None:
    path = write_config(tmp_path, "port: 9005\n")
    assert load({"PORTICO_CONFIG": path}).port == 9005


def test_empty_config_file_means_defaults(tmp_path: Path) -> None:
    assert load(config_file=write_config(tmp_path, "")) == Settings()


def test_env_without_prefix_is_ignored() -> None:
    assert load({"PORT": "1", "portico_port": "2", "PORTICO_PORTX": "3"}).port == 8080


# -- conversion of environment strings -----------------------------------------------


def test_env_strings_become_numbers_and_booleans() -> None:
    settings = load(
        {
            "PORTICO_PORT": "9000",
            "PORTICO_PING_INTERVAL": "2.5",
            "PORTICO_MAX_CONNECTIONS": "7",
            "PORTICO_WS_COMPRESSION": "true",
            "PORTICO_ALLOW_UNAUTHENTICATED": "1",
        }
    )
    assert settings.port == 9000
    assert settings.ping_interval == 2.5
    assert settings.max_connections == 7
    assert settings.ws_compression is True
    assert settings.allow_unauthenticated is True


@pytest.mark.parametrize(("raw", "expected"), [("false", False), ("0", False), ("TRUE", True)])
def test_env_booleans(raw: str, expected: bool) -> None:
    assert load({"PORTICO_WS_COMPRESSION": raw}).ws_compression is expected


def test_env_origins_are_a_comma_list() -> None:
    settings = load({"PORTICO_ORIGINS": " https://a.example, https://b.example ,"})
    assert settings.origins == ("https://a.example", "https://b.example")


# -- invalid values: each names its source and what would be valid --------------------------

RUNTIMES = "demo, echo, scripted, openai, openai-realtime, grpc, python"


@pytest.mark.parametrize(
    ("env", "refusal"),
    [
        ({"PORTICO_PORT": "eighty"}, "PORTICO_PORT: invalid value 'eighty'; expected `int`"),
        (
            {"PORTICO_PORT": "70000"},
            "PORTICO_PORT: invalid value '70000'; expected `int` <= 65535",
        ),
        (
            {"PORTICO_PING_INTERVAL": "0"},
            "PORTICO_PING_INTERVAL: invalid value '0'; expected `float` > 0.0",
        ),
        (
            {"PORTICO_WS_COMPRESSION": "maybe"},
            "PORTICO_WS_COMPRESSION: invalid value 'maybe'; expected `bool`",
        ),
        (
            {"PORTICO_AUTH": "ldap"},
            "PORTICO_AUTH: invalid value 'ldap'; valid values: none, apikey, jwt",
        ),
        (
            {"PORTICO_RUNTIME": "gpt"},
            f"PORTICO_RUNTIME: invalid value 'gpt'; valid values: {RUNTIMES}",
        ),
        (
            {"PORTICO_MAX_CONNECTIONS": "0"},
            "PORTICO_MAX_CONNECTIONS: invalid value '0'; expected `int` >= 1",
        ),
        (
            {"PORTICO_BUS_INBOX_TTL": "0"},
            "PORTICO_BUS_INBOX_TTL: invalid value '0'; expected `float` > 0.0",
        ),
        (
            {"PORTICO_TURN_END_RETRY_INTERVAL": "0"},
            "PORTICO_TURN_END_RETRY_INTERVAL: invalid value '0'; expected `float` > 0.0",
        ),
        (
            {"PORTICO_TURN_END_RETRY_WINDOW": "-1"},
            "PORTICO_TURN_END_RETRY_WINDOW: invalid value '-1'; expected `float` > 0.0",
        ),
        (
            {"PORTICO_LOG_LEVEL": "chatty"},
            "PORTICO_LOG_LEVEL: invalid value 'chatty'; valid values: DEBUG, INFO, WARNING, ERROR",
        ),
    ],
)
def test_invalid_env_value_names_the_variable_and_what_is_valid(
    env: dict[str, str], refusal: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        load(env)
    assert refused.value.message == refusal


def refusal_of_file(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> str:
    path = write_config(tmp_path, text)
    with pytest.raises(ConfigError) as refused:
        load(env, config_file=path)
    return refused.value.message.replace(path, "FILE")


@pytest.mark.parametrize(
    ("text", "refusal"),
    [
        (
            "resume_window: soon\n",
            "config file FILE, key resume_window: invalid value 'soon'; expected `float`",
        ),
        (
            "runtime: gpt\n",
            f"config file FILE, key runtime: invalid value 'gpt'; valid values: {RUNTIMES}",
        ),
        ("origins: [1]\n", "config file FILE, key origins[0]: invalid value 1; expected `str`"),
        (
            "agents:\n  helper:\n    runtime: echo\n  'my agent':\n    runtime: gpt\n",
            "config file FILE, key agents['my agent'].runtime: invalid value 'gpt'; "
            f"valid values: {RUNTIMES}",
        ),
        (
            "agents:\n  helper:\n    tools:\n      - {kind: htp, name: x}\n",
            "config file FILE, key agents.helper.tools[0].kind: invalid value 'htp'; "
            "valid values: builtin, client, http",
        ),
        (
            "agents:\n  helper:\n    tools:\n      - {kind: http, name: x}\n",
            "config file FILE, key agents.helper.tools[0]: object missing required field `url`",
        ),
        ("api_keys: [tok]\n", "config file FILE, key api_keys: invalid value; expected `object`"),
        (
            "api_keys: tok\n",
            "config file FILE, key api_keys: expected token=principal[,token=principal...]",
        ),
    ],
)
def test_invalid_file_value_names_the_file_and_key(tmp_path: Path, text: str, refusal: str) -> None:
    assert refusal_of_file(tmp_path, text) == refusal


def test_a_value_is_blamed_on_the_source_that_set_it(tmp_path: Path) -> None:
    """The file sets a good port and the environment a bad one: the variable is named."""
    refusal = refusal_of_file(tmp_path, "port: 9000\nruntime: gpt\n", {"PORTICO_PORT": "x"})
    assert refusal == "PORTICO_PORT: invalid value 'x'; expected `int`"
    path = write_config(tmp_path, "port: x\n")
    with pytest.raises(ConfigError, match="--port: invalid value 70000"):
        load({"PORTICO_PORT": "x"}, config_file=path, flags={"port": 70000})


def test_a_secret_setting_is_never_repeated(tmp_path: Path) -> None:
    refusal = refusal_of_file(tmp_path, "database_url: 5\n")
    assert refusal == "config file FILE, key database_url: invalid value; expected `str`"


@pytest.mark.parametrize(
    ("text", "refusal"),
    [
        ("prot: 80\n", "config file FILE: unknown setting 'prot' (did you mean 'port'?)"),
        ("zebra: 1\n", "config file FILE: unknown setting 'zebra'"),
        (
            "agents:\n  helper:\n    runtime: echo\n    modle: x\n",
            "config file FILE, key agents.helper: unknown setting 'modle' (did you mean 'model'?)",
        ),
        (
            "agents:\n  helper:\n    tools:\n"
            "      - {kind: http, name: x, url: 'http://a', methd: GET}\n",
            "config file FILE, key agents.helper.tools[0]: unknown setting 'methd' "
            "(did you mean 'method'?)",
        ),
    ],
)
def test_unknown_file_setting_is_refused_with_the_nearest_name(
    tmp_path: Path, text: str, refusal: str
) -> None:
    assert refusal_of_file(tmp_path, text) == refusal


def test_invalid_flag_names_the_flag() -> None:
    with pytest.raises(ConfigError) as refused:
        load(flags={"port": -1})
    assert refused.value.message == "--port: invalid value -1; expected `int` >= 0"


def test_config_file_that_is_not_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="expected a mapping"):
        load(config_file=write_config(tmp_path, "- port\n- 80\n"))


def test_unreadable_config_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError) as refused:
        load(config_file=missing)
    assert refused.value.message == f"cannot read config file {missing}: no such file or directory"


@pytest.mark.parametrize(
    ("text", "refusal"),
    [
        (
            "port: [80\n",
            "config file FILE: invalid YAML at line 2, column 1: "
            "expected ',' or ']', but got '<stream end>'",
        ),
        (
            "port: 80\nhost: a: b\n",
            "config file FILE: invalid YAML at line 2, column 8: "
            "mapping values are not allowed here",
        ),
    ],
)
def test_config_file_with_broken_yaml_is_one_line_with_its_position(
    tmp_path: Path, text: str, refusal: str
) -> None:
    assert refusal_of_file(tmp_path, text) == refusal


def test_config_file_that_is_not_text(tmp_path: Path) -> None:
    path = tmp_path / "portico.yaml"
    path.write_bytes(b"\xff\xfeport: 1\n")
    with pytest.raises(ConfigError) as refused:
        load(config_file=str(path))
    assert refused.value.message == f"config file {path}: not UTF-8 text"


# -- unknown PORTICO_* variables ----------------------------------------------------------


def test_unknown_variables_are_warned_about_with_the_nearest_name() -> None:
    env = {
        "PORTICO_PROT": "80",
        "PORTICO_OPENAI_MODLE": "x",
        "PORTICO_ZEBRA": "1",
        "PORTICO_AGENTS": "x",
        "PORTICO_PORT": "80",
        "PORTICO_CONFIG": "p.yaml",
        "PORTICO_CREDENTIAL": "tok",
        "PORT": "1",
    }
    assert environment_warnings(env) == [
        "PORTICO_AGENTS is ignored: `agents` is read from the config file only",
        "PORTICO_OPENAI_MODLE is not a Portico setting and is ignored "
        "(did you mean PORTICO_OPENAI_MODEL?)",
        "PORTICO_PROT is not a Portico setting and is ignored (did you mean PORTICO_PORT?)",
        "PORTICO_ZEBRA is not a Portico setting and is ignored",
    ]


def test_every_setting_variable_is_known() -> None:
    env = {f"PORTICO_{name.upper()}": "" for name in Settings.__struct_fields__}
    del env["PORTICO_AGENTS"]
    assert environment_warnings(env) == []


# -- API keys -------------------------------------------------------------------------


def test_api_keys_from_env() -> None:
    settings = load({"PORTICO_API_KEYS": "tok=alice,tok2=bob"})
    assert settings.api_keys == {"tok": "alice", "tok2": "bob"}


def test_api_keys_tolerate_spaces_and_trailing_comma() -> None:
    assert parse_api_keys(" tok=alice , tok2=bob ,") == {"tok": "alice", "tok2": "bob"}
    assert parse_api_keys("") == {}


def test_api_key_principal_may_contain_equals() -> None:
    assert parse_api_keys("tok=team=red") == {"tok": "team=red"}


def test_api_keys_as_a_string_in_the_config_file(tmp_path: Path) -> None:
    settings = load(config_file=write_config(tmp_path, "api_keys: tok=alice,tok2=bob\n"))
    assert settings.api_keys == {"tok": "alice", "tok2": "bob"}


def test_api_keys_as_a_mapping_in_the_config_file(tmp_path: Path) -> None:
    settings = load(config_file=write_config(tmp_path, "api_keys: {tok: alice}\n"))
    assert settings.api_keys == {"tok": "alice"}


@pytest.mark.parametrize("raw", ["tok", "=alice", "tok=", "tok=alice,bob", "tok=alice,=bob"])
def test_bad_api_keys_are_refused(raw: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load({"PORTICO_API_KEYS": raw})
    assert (
        refused.value.message == "PORTICO_API_KEYS: expected token=principal[,token=principal...]"
    )


# -- start-up refusals ----------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_without_auth_may_start(host: str) -> None:
    load(flags={"host": host}).check_startable()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5", "example.com"])
def test_non_loopback_without_auth_is_refused(host: str) -> None:
    with pytest.raises(ConfigError, match="without authentication"):
        load(flags={"host": host}).check_startable()


@pytest.mark.parametrize(
    ("env", "refusal"),
    [
        ({"PORTICO_PING_INTERVAL": "60"}, "ping_interval must be shorter than pong_timeout"),
        (
            {"PORTICO_HEARTBEAT_INTERVAL": "45"},
            "heartbeat_interval must be shorter than session_idle_timeout",
        ),
    ],
)
def test_keepalive_that_would_close_punctual_peers_is_refused(
    env: dict[str, str], refusal: str
) -> None:
    with pytest.raises(ConfigError, match=refusal):
        load(env).check_startable()
    load(
        {**env, "PORTICO_PONG_TIMEOUT": "61", "PORTICO_SESSION_IDLE_TIMEOUT": "46"}
    ).check_startable()


def test_an_inbox_that_could_lapse_between_its_replicas_reads_is_refused() -> None:
    with pytest.raises(ConfigError, match="bus_inbox_ttl must be at least 3 x bus_read_block"):
        load({"PORTICO_BUS_INBOX_TTL": "2", "PORTICO_BUS_READ_BLOCK": "1"}).check_startable()
    load({"PORTICO_BUS_INBOX_TTL": "3", "PORTICO_BUS_READ_BLOCK": "1"}).check_startable()


def test_a_turn_fence_counter_that_could_expire_under_a_writer_is_refused() -> None:
    env = {
        "PORTICO_BUS": "redis",
        "PORTICO_REPLICA_LEASE": "1",
        "PORTICO_TURN_END_RETRY_WINDOW": "2",
        "PORTICO_TURN_FENCE_TTL": "3.5",
    }
    with pytest.raises(ConfigError, match="turn_fence_ttl must be at least 2 x replica_lease"):
        load(env).check_startable()
    load({**env, "PORTICO_TURN_FENCE_TTL": "4"}).check_startable()


def test_allow_unauthenticated_permits_an_open_bind() -> None:
    load({"PORTICO_HOST": "0.0.0.0", "PORTICO_ALLOW_UNAUTHENTICATED": "true"}).check_startable()


def test_apikey_auth_on_an_open_bind_may_start() -> None:
    env = {"PORTICO_HOST": "0.0.0.0", "PORTICO_AUTH": "apikey", "PORTICO_API_KEYS": "t=a"}
    load(env).check_startable()


def test_apikey_without_keys_is_refused() -> None:
    with pytest.raises(ConfigError, match="api_keys"):
        load({"PORTICO_AUTH": "apikey"}).check_startable()


def test_scripted_default_agent_without_script_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"'default'.*script"):
        load({"PORTICO_RUNTIME": "scripted"}).check_startable()


def test_scripted_named_agent_without_script_is_refused(tmp_path: Path) -> None:
    path = write_config(tmp_path, "agents:\n  helper:\n    runtime: scripted\n")
    with pytest.raises(ConfigError, match="'helper'"):
        load(config_file=path).check_startable()


def test_scripted_with_script_may_start() -> None:
    load({"PORTICO_RUNTIME": "scripted", "PORTICO_SCRIPT": "script.yaml"}).check_startable()


# -- redaction and agents -------------------------------------------------------------


def test_redacted_masks_tokens_and_keeps_the_rest() -> None:
    settings = load({"PORTICO_API_KEYS": "sekrit-one=alice,sekrit-two=bob", "PORTICO_PORT": "1"})
    data = settings.redacted()
    dumped = json.dumps(data)
    assert "sekrit" not in dumped
    assert sorted(data["api_keys"].values()) == ["alice", "bob"]
    assert len(data["api_keys"]) == 2
    assert data["port"] == 1
    # Redaction is a copy: the live settings keep their tokens.
    assert settings.api_keys == {"sekrit-one": "alice", "sekrit-two": "bob"}


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (
            "postgresql://portico:s3cret@db.internal:5432/archive",
            "postgresql://portico:***@db.internal:5432/archive",
        ),
        ("postgres://:s3cret@[::1]/archive", "postgres://:***@[::1]/archive"),
        (
            "postgresql://db/archive?user=portico&password=s3cret",
            "postgresql://db/archive?user=portico&password=***",
        ),
        ("postgresql://portico@db/archive", "postgresql://portico@db/archive"),
        ("", ""),
    ],
)
def test_redacted_masks_the_database_password(url: str, shown: str) -> None:
    settings = load({"PORTICO_STORE": "postgres", "PORTICO_DATABASE_URL": url})
    data = settings.redacted()
    assert data["database_url"] == shown
    assert "s3cret" not in json.dumps(data)
    assert settings.database_url == url


def test_postgres_store_needs_a_database_url() -> None:
    with pytest.raises(ConfigError, match="store=postgres needs database_url"):
        load({"PORTICO_STORE": "postgres"}).check_startable()
    with pytest.raises(ConfigError, match="database_url must start with postgresql://"):
        load(
            {"PORTICO_STORE": "postgres", "PORTICO_DATABASE_URL": "mysql://db/x"}
        ).check_startable()
    load(
        {"PORTICO_STORE": "postgres", "PORTICO_DATABASE_URL": "postgresql://db/x"}
    ).check_startable()
    # Other stores ignore it.
    load({"PORTICO_DATABASE_URL": "mysql://db/x"}).check_startable()


def test_default_agent_comes_from_runtime_and_script() -> None:
    settings = load({"PORTICO_RUNTIME": "scripted", "PORTICO_SCRIPT": "s.yaml"})
    assert settings.agent("default") == AgentSettings(runtime="scripted", script="s.yaml")
    assert settings.agent_names() == ["default"]


def test_configured_agents(tmp_path: Path) -> None:
    text = "agents:\n  helper:\n    runtime: echo\n    sandboxes: [code]\n"
    settings = load(config_file=write_config(tmp_path, text))
    assert settings.agent("helper") == AgentSettings(runtime="echo", sandboxes=("code",))
    assert settings.agent_names() == ["default", "helper"]
    assert settings.agent("default") == AgentSettings(runtime="demo")


def test_unknown_agent_is_none() -> None:
    assert load().agent("nobody") is None


def test_redacted_masks_the_s3_secret() -> None:
    env = {
        "PORTICO_MEDIA": "s3",
        "PORTICO_S3_ACCESS_KEY_ID": "AKIDEXAMPLE",
        "PORTICO_S3_SECRET_ACCESS_KEY": "s3cret-key",
    }
    settings = load(env)
    data = settings.redacted()
    assert "s3cret-key" not in json.dumps(data)
    assert data["s3_secret_access_key"] == "***"
    assert data["s3_access_key_id"] == "AKIDEXAMPLE"  # an id, not a secret
    assert settings.s3_secret_access_key == "s3cret-key"


def test_s3_credentials_go_together() -> None:
    with pytest.raises(ConfigError, match="go together"):
        load({"PORTICO_MEDIA": "s3", "PORTICO_S3_ACCESS_KEY_ID": "AKIDEXAMPLE"}).check_startable()


def test_redacted_masks_the_redis_password() -> None:
    url = "redis://:s3cret@127.0.0.1:6379/0"
    settings = load({"PORTICO_BUS": "redis", "PORTICO_REDIS_URL": url})
    data = settings.redacted()
    assert data["redis_url"] == "redis://:***@127.0.0.1:6379/0"
    assert "s3cret" not in json.dumps(data)
