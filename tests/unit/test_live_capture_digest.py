"""Layers are stored once per digest and shared by every snapshot that hashes to it, also
across tenants: a stored layer must hash to its digest. The capture copies and hashes the
sandbox's files side by side, which is the copy's hash only while the sandbox is frozen. A
sandbox that cannot be frozen is copied live: then the digest is taken from the copy."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from corral import _core
from corral.daemon import snapshots
from corral.daemon.snapshots import SnapshotStore, layer_digest


@pytest.fixture
def racing_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Rust capture as it goes when a file changes between its hash and its copy."""
    real = _core.capture_layer

    def capture_layer(parts: list[Any], *args: Any) -> tuple[str, int]:
        digest, size = real(parts, *args)
        Path(parts[0][2], "f").write_bytes(b"changed while it was copied")
        return digest, size

    monkeypatch.setattr(snapshots._core, "capture_layer", capture_layer)


def _capture(tmp_path: Path, held: bool) -> tuple[str, str]:
    upper = tmp_path / "upper"
    upper.mkdir()
    (upper / "f").write_bytes(b"as hashed")
    store = SnapshotStore(str(tmp_path / "state"))
    os.makedirs(store.spares_dir, exist_ok=True)
    tmp, digest, _ = store.capture([str(upper)], lambda: held, lambda: None)
    return tmp, digest


def test_a_live_copy_is_named_by_what_was_copied(tmp_path: Path, racing_copy: None) -> None:
    tmp, digest = _capture(tmp_path, held=False)
    assert digest == layer_digest(tmp)


def test_a_frozen_copy_keeps_the_hash_taken_while_copying(tmp_path: Path,
                                                          racing_copy: None) -> None:
    """(No file changes while frozen: the second pass is left out.)"""
    tmp, digest = _capture(tmp_path, held=True)
    assert digest != layer_digest(tmp)
