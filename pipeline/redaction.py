"""Credentials never leave the process in clear: a tracking URI such as ``http://user:pass@host`` is shown and
written as ``http://user:***@host`` (MLflow params, the journal and its state file, config.yaml in checkpoints
and artifacts, console lines). Only the live connection uses the real URI. A leaf module (imports nothing of
ours) so config, checkpoints and tracking can all use it."""

from __future__ import annotations

import re

MASK = "***"
# scheme://user:password@  -> the password part; a bare user (no colon) is not a secret and is kept
_USERINFO_PASSWORD = re.compile(r"^(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/@:]*):(?P<password>[^/@]*)@")


def redact_uri(uri: str | None) -> str | None:
    """``uri`` with the password of its user-info replaced by ``***``; anything else unchanged."""
    if not uri:
        return uri
    return _USERINFO_PASSWORD.sub(lambda m: f"{m['head']}:{MASK}@", uri, count=1)


_ANY_USERINFO_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/@:\s]*):(?P<password>[^/@\s]*)@")


def redact_text(text: str) -> str:
    """Every ``scheme://user:password@`` inside ``text`` masked (library error messages quote the URI)."""
    return _ANY_USERINFO_PASSWORD.sub(lambda m: f"{m['head']}:{MASK}@", text)


def is_redacted(uri: str | None) -> bool:
    m = _USERINFO_PASSWORD.match(uri or "")
    return m is not None and m["password"] == MASK


def without_userinfo(uri: str) -> str:
    """``http://user:***@host`` -> ``http://host``: MLflow then takes MLFLOW_TRACKING_USERNAME/PASSWORD."""
    return re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/@]*@", r"\1", uri, count=1)
