"""The API's configuration: one typed object, read from SPILLWAY_* environment variables.

Each field says its unit and why its default is what it is. `spillway api`'s options
override the matching fields.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from platformdirs import user_data_dir
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DATA_DIR = Path(user_data_dir("spillway", appauthor=False))


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPILLWAY_", extra="ignore")

    database_url: str = Field(
        f"sqlite:///{DATA_DIR / 'spillway.db'}",
        description="SQLAlchemy URL. The default, a SQLite file in the user's data directory, needs no server; "
        "production uses postgresql+psycopg://...",
    )
    data_dir: Path = Field(DATA_DIR, description="Token file and local run directories live here")
    auth: Literal["token", "kubernetes", "none"] = Field(
        "token",
        description="token: the bearer token in token_file (local mode); kubernetes: TokenReview + "
        "SubjectAccessReview (cluster mode); none: no checks, only ever bound to 127.0.0.1",
    )
    audience: str = Field(
        "spillway", min_length=1, max_length=253,
        description="Kubernetes mode: the audience a caller's token must be issued for (`kubectl create token "
        "NAME --audience spillway`), checked by TokenReview. A token for the API server's own audience is "
        "refused, so the API never receives a credential that would work against the cluster",
    )
    tls_cert_file: Path | None = Field(
        None, description="Serve HTTPS with this PEM certificate (chain); with tls_key_file. A changed file is "
        "loaded for new connections within tls_reload_seconds, no restart (a renewed Secret)",
    )
    tls_key_file: Path | None = Field(None, description="The certificate's PEM private key")
    tls_reload_seconds: float = Field(60.0, gt=0, description="How often the certificate files are checked")
    token_file: Path | None = Field(None, description="Local-mode token; default <data_dir>/api-token, mode 0600")
    launcher: Literal["local", "kubernetes"] = Field(
        "local", description="Where POST /v1/namespaces/{ns}/jobs runs a job: this machine, or the cluster"
    )
    local_price_per_hour: float = Field(
        0.0, ge=0, description="USD per hour charged to local runs in the cost ledger; 0 because a laptop is free"
    )
    local_poll_seconds: float = Field(
        0.5, gt=0, description="How often the local launcher reads new events; half a second keeps the UI live"
    )
    max_body_bytes: int = Field(
        1 << 20, gt=0, description="Requests above 1 MiB are refused with 413; a FineTuneJob is a few KiB"
    )
    kube_watch: bool = Field(
        True, description="In kubernetes mode, record every FineTuneJob change from a watch into the database"
    )
    kube_price_per_gpu_hour: float = Field(
        2.0, ge=0, description="USD per GPU-hour for cluster jobs without a status.cost; a typical cloud A100 rate"
    )

    @property
    def resolved_token_file(self) -> Path:
        return self.token_file or self.data_dir / "api-token"

    @property
    def local_runs_dir(self) -> Path:
        return self.data_dir / "runs"


@lru_cache
def get_settings() -> Settings:
    return Settings()
