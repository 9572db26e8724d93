"""The gateway's copies of the nodes' trajectory logs (corral.cluster.trajship.LogCopies):
pruned as the nodes prune theirs, without moving the shipping cursor back, and a gone node's
copy removed once nothing of it is left."""

from __future__ import annotations

import json
import os

from corral.cluster.trajship import LogCopies


def _entry(seq: int, sid: str, op: str, t: float) -> tuple:
    return (seq, sid, op, None, None, json.dumps({}), json.dumps({"ok": True}), None, t, t,
            None, None)


def _sandbox(sid: str, created: float, ended: float | None) -> tuple:
    return (sid, json.dumps({"image": "host"}), created, ended,
            None if ended is None else "killed", None)


def _fill(copies: LogCopies, node: str) -> None:
    """Sandbox a (ended at t=10) has seqs 1-3 and the highest, 6; b (live) has 4-5."""
    got = {"entries": [_entry(1, "a", "create", 1), _entry(2, "a", "exec", 2),
                       _entry(3, "a", "exec", 3), _entry(4, "b", "create", 4),
                       _entry(5, "b", "exec", 5), _entry(6, "a", "kill", 10)],
           "sandboxes": [_sandbox("a", 1, 10), _sandbox("b", 4, None)]}
    assert copies.apply(node, 0, got) == 6


def test_a_copy_drops_what_its_node_drops_and_keeps_its_cursor(tmp_path):
    copies = LogCopies(str(tmp_path), retention_s=100)
    try:
        _fill(copies, "n1")
        assert copies.prune("n1", now=50, live=True) == 0  # a ended 40 s ago: kept
        assert copies.read("n1", "a") is not None
        assert copies.prune("n1", now=200, live=True) == 1
        assert copies.read("n1", "a") is None
        got = copies.read("n1", "b")
        assert got is not None and [e["seq"] for e in got["entries"]] == [4, 5]
        # The highest row went with a: the next call still asks for what follows it.
        assert copies.cursor("n1")["after"] == 6
        assert copies.apply("n1", 6, {"entries": [_entry(7, "b", "exec", 7)]}) == 1
        assert [e["seq"] for e in copies.read("n1", "b")["entries"]] == [4, 5, 7]
        assert copies.nodes() == ["n1"]  # a live node's copy stays, however small
    finally:
        copies.close()


def test_a_gone_nodes_copy_is_removed_once_empty(tmp_path):
    copies = LogCopies(str(tmp_path), retention_s=100)
    try:
        _fill(copies, "n2")
        assert copies.seal("n2") == 1  # b ended now ("lost")
        assert copies.prune("n2", now=200, live=False) == 1  # a only: b ended just now
        assert copies.nodes() == ["n2"] and copies.find("b") == "n2"
        assert copies.prune("n2", now=10**10, live=False) == 1
        assert copies.nodes() == [] and copies.find("b") is None
        assert not os.path.exists(copies.dir_of("n2"))
    finally:
        copies.close()


def test_a_copy_is_read_a_page_at_a_time_and_its_owner_from_its_head(tmp_path):
    """The gateway streams a lost node's sandbox's log from its copy (the node's own pages)
    and tells whose it is from its sandbox row and first entry, never the whole log."""
    copies = LogCopies(str(tmp_path), retention_s=100)
    try:
        labelled = (7, "c", "create", None, None,
                    json.dumps({"labels": {"corral.tenant": "alice"}}), json.dumps({}),
                    None, 7.0, 7.0, None, None)
        _fill(copies, "n3")
        copies.apply("n3", 6, {"entries": [labelled]})
        assert copies.owner_of("n3", "c") == (True, "alice")
        assert copies.owner_of("n3", "a") == (True, None)  # the admin's
        assert copies.owner_of("n3", "zz") == (False, None)
        pages = copies.stream("n3", "b", jsonl=False, more=b',"node":"n3","copy":true')
        doc = json.loads(b"".join(p for page in pages for p in page))
        assert [e["seq"] for e in doc["entries"]] == [4, 5]
        assert doc["node"] == "n3" and doc["copy"] is True and doc["sandbox_id"] == "b"
        lines = b"".join(p for page in copies.stream("n3", "b", jsonl=True) for p in page)
        assert [json.loads(x)["seq"] for x in lines.splitlines()] == [4, 5]
        assert copies.stream("n3", "zz", jsonl=False) is None
    finally:
        copies.close()
