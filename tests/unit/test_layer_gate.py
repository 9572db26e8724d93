"""Pulls of one layer do not wait on each other's registries (corral.daemon.oci.layers.
LayerStore.ensure): a tenant's registry that trickled a layer held every other pull of its
digest, any tenant's, for hours; and a build that lost the race to place a layer another
caller placed first failed as infra (image_pull_failed) though the layer was stored."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import tarfile
import threading
import time
from typing import Any

from corral.daemon.oci import layers, unpack
from corral.daemon.oci.layers import LayerStore
from corral.errors import CorralError

MT = "application/vnd.oci.image.layer.v1.tar+gzip"


def _layer() -> tuple[bytes, str, str]:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tf:
        ti = tarfile.TarInfo("f")
        ti.size = 1000
        ti.uid, ti.gid = os.getuid(), os.getgid()  # the unpack gives each file its owner
        tf.addfile(ti, io.BytesIO(b"x" * 1000))
    plain = raw.getvalue()
    blob = gzip.compress(plain, mtime=0)
    return blob, hashlib.sha256(blob).hexdigest(), "sha256:" + hashlib.sha256(plain).hexdigest()


def _run(store: LayerStore, hexd: str, diff: str, fetch: Any, out: dict, name: str) -> None:
    try:
        store.ensure(hexd, MT, diff, fetch, unpack.Limits(1 << 30, 10 ** 6))
        out[name] = "ok"
    except CorralError as e:
        out[name] = e.to_payload()


def _fetch(blob: bytes, entered: threading.Event | None = None,
           go: threading.Event | None = None, fail: bool = False) -> Any:
    """A fetch that writes ``blob``: first it says it ``entered`` and waits for ``go`` (a
    registry that takes its time), and with ``fail`` it then fails instead."""
    def fetch(dest: str) -> None:
        if entered is not None and go is not None:
            entered.set()
            go.wait(30)
        if fail:
            raise OSError(104, "the registry closed the connection")
        with open(dest, "wb") as f:
            f.write(blob)
    return fetch


def test_a_slow_fetch_of_one_caller_does_not_hold_another(tmp_path, monkeypatch):
    monkeypatch.setattr(layers, "GATE_WAIT_S", 0.2, raising=False)
    store = LayerStore(str(tmp_path), erofs=False)
    blob, hexd, diff = _layer()
    inside, go = threading.Event(), threading.Event()
    slow = _fetch(blob, inside, go)  # the tenant's trickling registry
    fast = _fetch(blob)
    out: dict[str, Any] = {}
    a = threading.Thread(target=_run, args=(store, hexd, diff, slow, out, "slow"))
    a.start()
    assert inside.wait(10)
    t = time.monotonic()
    _run(store, hexd, diff, fast, out, "fast")
    assert out["fast"] == "ok" and time.monotonic() - t < 5, out
    go.set()
    a.join(30)
    assert out["slow"] == "ok", out  # it found the layer placed: no error
    assert store.has(hexd)


def test_a_gate_dropped_while_another_waits_on_it_fails_no_one(tmp_path, monkeypatch):
    """A's fetch fails, B waits on A's gate, C arrives when A is gone (a new gate): B and C
    build the same layer at once; the second to place it failed with image_pull_failed.
    Whatever the order the threads meet in, no caller but A fails."""
    monkeypatch.setattr(layers, "GATE_WAIT_S", 2.0, raising=False)
    store = LayerStore(str(tmp_path), erofs=False)
    blob, hexd, diff = _layer()
    a_in, a_go, b_in, b_go = (threading.Event() for _ in range(4))
    fetch_a = _fetch(blob, a_in, a_go, fail=True)
    fetch_b = _fetch(blob, b_in, b_go)
    fetch_c = _fetch(blob)
    out: dict[str, Any] = {}
    ta = threading.Thread(target=_run, args=(store, hexd, diff, fetch_a, out, "A"))
    ta.start()
    assert a_in.wait(10)
    tb = threading.Thread(target=_run, args=(store, hexd, diff, fetch_b, out, "B"))
    tb.start()  # on A's gate, or (if it gets there after A ended) on a gate of its own
    a_go.set()
    ta.join(30)
    assert b_in.wait(10)
    _run(store, hexd, diff, fetch_c, out, "C")
    b_go.set()
    tb.join(30)
    assert out["B"] == "ok" and out["C"] == "ok", out
    assert out["A"]["error"]["code"] == "image_pull_failed", out

