"""Pure pieces of the API: the local token file, settings from the environment, time parsing."""

from __future__ import annotations

import stat
from datetime import UTC, datetime
from pathlib import Path

import pytest

from spillway_api.auth import TokenAuth, ensure_token_file
from spillway_api.errors import ApiError
from spillway_api.service import _iso
from spillway_api.settings import Settings


def test_token_file_is_created_private_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "cfg" / "api-token"
    token = ensure_token_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(token) >= 32
    path.chmod(0o644)
    assert ensure_token_file(path) == token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_token_auth_refuses_missing_and_wrong_tokens() -> None:
    auth = TokenAuth("s3cret-token")
    for bad in (None, "wrong", ""):
        with pytest.raises(ApiError) as err:
            auth.authenticate(bad)
        assert err.value.status == 401
    assert auth.authenticate("s3cret-token").name


def test_settings_read_spillway_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPILLWAY_DATABASE_URL", "postgresql+psycopg://u@h/db")
    monkeypatch.setenv("SPILLWAY_LOCAL_PRICE_PER_HOUR", "1.25")
    monkeypatch.setenv("SPILLWAY_DATA_DIR", str(tmp_path))
    settings = Settings()
    assert settings.database_url.startswith("postgresql+psycopg://")
    assert settings.local_price_per_hour == 1.25
    assert settings.resolved_token_file == tmp_path / "api-token"
    assert Settings.model_fields["database_url"].default.startswith("sqlite:///")


def test_event_times_become_aware_utc() -> None:
    assert _iso(0) == datetime(1970, 1, 1, tzinfo=UTC)
    assert _iso("2026-01-02T03:04:05Z") == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert _iso("not a time") is None and _iso(None) is None
