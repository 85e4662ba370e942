"""An in-memory `certs.TlsStore`: the Secret (with resourceVersions, a create that can lose
to another replica) and the webhook configuration's caBundle, as the API server keeps them."""

from __future__ import annotations


class FakeTlsStore:
    def __init__(self) -> None:
        self.secret: dict[str, bytes] | None = None
        self.version = 0
        self.bundle = b""
        self.bundle_writes = 0
        self.secret_writes = 0
        # Called before a write lands: lets a test make another replica win the race.
        self.before_write = lambda: None

    def read_secret(self) -> tuple[dict[str, bytes], str] | None:
        return (dict(self.secret), str(self.version)) if self.secret is not None else None

    def _write(self, data: dict[str, bytes]) -> None:
        self.secret, self.version, self.secret_writes = dict(data), self.version + 1, self.secret_writes + 1

    def create_secret(self, data: dict[str, bytes]) -> bool:
        self.before_write()
        if self.secret is not None:
            return False
        self._write(data)
        return True

    def replace_secret(self, data: dict[str, bytes], resource_version: str) -> bool:
        self.before_write()
        if str(self.version) != resource_version:
            return False
        self._write(data)
        return True

    def ca_bundle(self) -> bytes:
        return self.bundle

    def set_ca_bundle(self, pem: bytes) -> None:
        self.bundle, self.bundle_writes = pem, self.bundle_writes + 1
