"""Recovery at start: re-adopt the sandboxes a previous daemon left, their tombstones."""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

from corral.daemon import persist, removal
from corral.daemon.substrates.base import SandboxRuntime, Substrate
from corral.errors import CorralError
from corral.models import STORED, SandboxSpec

from .base import LOST_CAUSES, SHUTDOWN_ENDED, TOMBSTONES, Sandbox, log

if TYPE_CHECKING:  # pragma: no cover
    from .host import EngineHost


class Recovery:
    def _recover(self: EngineHost) -> None:
        """Re-adopt every sandbox a previous daemon left running; clean up everything else."""
        known: set[str] = set()
        lost = 0
        adopted: list[tuple[str, SandboxSpec, SandboxRuntime, Substrate, dict]] = []
        for sid, meta in persist.iter_records(self.sandboxes_dir):
            if not meta or not meta.get("runtime"):
                continue  # half-made (crash mid-create): cleanup_orphans removes it
            try:
                spec = SandboxSpec.model_validate(meta["spec"], context=STORED)
                runtime = SandboxRuntime.from_json(meta["runtime"])
                substrate = self.substrates[spec.substrate]
            except Exception:  # noqa: BLE001 - an unreadable record is an orphan
                log.warning("unreadable sandbox record", extra={"sandbox": sid})
                continue
            try:
                alive = substrate.adopt(runtime)
            except Exception:  # noqa: BLE001
                log.exception("adopt failed", extra={"sandbox": sid})
                alive = False
            if not alive:
                lost += 1
                try:
                    cause = substrate.end_cause(runtime)
                except Exception:  # noqa: BLE001 - no cause found: lost
                    log.exception("end_cause failed", extra={"sandbox": sid})
                    cause = None
                try:
                    substrate.destroy(runtime)
                except Exception:  # noqa: BLE001
                    log.exception("destroy of a dead sandbox failed", extra={"sandbox": sid})
                removal.remove_or_quarantine(os.path.join(self.sandboxes_dir, sid))
                lost = not cause or cause.get("cause") in LOST_CAUSES
                self._tombstone(sid, "lost" if lost else "crashed", cause)
                continue
            adopted.append((sid, spec, runtime, substrate, meta))
        # Their networks, all at once per substrate (one rule set); one that cannot be
        # restored is ended and answers sandbox_lost (reason network_lost), never left
        # running without the network its spec promises.
        no_net: dict[str, str] = {}
        for substrate in self.substrates.values():
            mine = [(rt, spec) for _, spec, rt, sub, _ in adopted if sub is substrate]
            try:
                no_net.update(substrate.restore_networks(mine))
            except Exception as e:  # noqa: BLE001 - none of them has its network
                log.exception("restore_networks failed", extra={"substrate": substrate.name})
                no_net.update({rt.sandbox_id: str(e) for rt, _ in mine})
        for sid, spec, runtime, substrate, meta in adopted:
            if sid in no_net:
                lost += 1
                log.warning("re-adopted sandbox without its network: ended",
                            extra={"sandbox": sid, "error": no_net[sid]})
                try:
                    substrate.destroy(runtime)
                except Exception:  # noqa: BLE001
                    log.exception("destroy of a sandbox without its network failed",
                                  extra={"sandbox": sid})
                removal.remove_or_quarantine(os.path.join(self.sandboxes_dir, sid))
                self._tombstone(sid, "network_lost")
                continue
            sb = Sandbox(sid, spec, float(meta["created_at"]), float(meta["expires_at"]))
            sb.runtime = runtime
            sb.state = "running"
            sb.trajectory = meta.get("trajectory")
            if self._frozen(substrate, runtime):
                if meta.get("paused_at"):
                    sb.state, sb.paused_at = "paused", float(meta["paused_at"])
                else:
                    # Frozen but not paused: the last daemon died in a snapshot's capture (or
                    # between a pause's freeze and its record, or a resume's thaw and its
                    # record). Left so, its next exec would freeze with the loop waiting.
                    self._thaw_adopted(substrate, sb)
            if self.snaps is not None:
                self.snaps.acquire(sb.layers)
            sb.last_active = self.clock.time()  # the idle clock restarts with the daemon
            self._register(sb)
            known.add(sid)
            self._watch(sb)
            self._schedule(sb, self.clock.time())
        removed: list[str] = []
        for substrate in self.substrates.values():
            try:
                removed += substrate.cleanup_orphans(known)
            except Exception:  # noqa: BLE001
                log.exception("cleanup_orphans failed", extra={"substrate": substrate.name})
        for sid, _ in persist.iter_records(self.sandboxes_dir):
            if sid not in known:  # belt and braces: records the substrate did not know
                removal.remove_or_quarantine(os.path.join(self.sandboxes_dir, sid))
        trash = os.path.join(self.sandboxes_dir, ".trash")  # restores a crash interrupted
        with contextlib.suppress(OSError):
            for name in os.listdir(trash):
                removal.remove_or_quarantine(os.path.join(trash, name), self.sandboxes_dir)
        qdir = os.path.join(self.sandboxes_dir, removal.QUARANTINE)
        with contextlib.suppress(OSError):  # left by an earlier run: one more try each
            for name in os.listdir(qdir):
                try:
                    removal.remove_tree(os.path.join(qdir, name))
                except OSError:
                    removal.quarantined.append(os.path.join(qdir, name))
        self.trajlog.readopted([(sid, sb.spec.model_dump(mode="json"), sb.created_at, sb.info())
                                for sid, sb in self.sandboxes.items() if sid in known])
        self.trajlog.recovered(known)
        self.counters["adopted"] = len(known)
        self.counters["orphans_removed"] = len(removed)
        log.info("recovered state", extra={"adopted": len(known), "lost": lost,
                                           "orphans_removed": len(removed)})

    # Ids of sandboxes that a graceful stop destroyed, kept across restarts: a client coming
    # back after `corral down; corral up` (or a restart by its supervisor) gets
    # daemon_restarted, an infra error a trainer masks, not sandbox_not_found.
    def _save_shutdown_tombstones(self: EngineHost) -> None:
        ids = [*self._shutdown_ended, *self.sandboxes][-TOMBSTONES:]
        try:
            persist.write_json_atomic(os.path.join(self.config.state_dir, SHUTDOWN_ENDED),
                                      {"ids": ids})
        except OSError as e:
            log.warning("cannot record the sandboxes this stop ends", extra={"error": str(e)})

    def _load_shutdown_tombstones(self: EngineHost) -> None:
        path = os.path.join(self.config.state_dir, SHUTDOWN_ENDED)
        try:
            ids = persist.read_json(path)["ids"]
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("unreadable record of the last stop's sandboxes",
                        extra={"error": str(e)})
            return
        self._shutdown_ended = [str(i) for i in ids][-TOMBSTONES:]
        for sid in self._shutdown_ended:
            self._tombstone(sid, "shutdown")

    def _thaw_adopted(self: EngineHost, substrate: Substrate, sb: Sandbox) -> None:
        assert sb.runtime is not None
        log.warning("re-adopted sandbox was frozen but not paused: thawed",
                    extra={"sandbox": sb.id})
        try:
            substrate.thaw(sb.runtime)
        except (OSError, TimeoutError, CorralError):
            log.exception("thaw of a re-adopted sandbox failed", extra={"sandbox": sb.id})
