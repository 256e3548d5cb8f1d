"""A configuration error never echoes an API key."""

from __future__ import annotations

import pytest

from server.config import ConfigError, load_config


@pytest.mark.parametrize(
    ("flags", "environ"),
    [
        ({}, {"SPLITFUSE_API_KEY": "secret-key-1,"}),
        ({"api_key": ["secret-key-1", ""]}, {}),
        ({"api_keys": ["secret-key-1", " "]}, {}),
    ],
)
def test_a_bad_api_key_setting_is_refused_without_echoing_the_keys(flags, environ) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(flags=flags, environ=environ)
    assert "api_key" in str(error.value)
    assert "secret-key-1" not in str(error.value)


def test_other_settings_still_show_the_value_given() -> None:
    with pytest.raises(ConfigError, match="'lots'"):
        load_config(flags={"port": "lots"}, environ={})
