"""Every job's journal in the coordinator's ``state_dir``: found at start, kept within their
retention, and the finished tunings that warm-start new jobs.

One file per job (``<job>.jsonl``, :mod:`hyperagent.tuner.journal`). At start every journal is
read (one that cannot be read stops the coordinator, naming the file and line); a job that
did not end keeps its state until the job is found again. The retention policy: a journal
whose job ended (its last entry says so, or the coordinator released the job) is deleted
``keep_days`` after its last entry, and beyond ``keep`` files the oldest such journals go
first; a live job's journal is never deleted. The final settings of each owner's latest
finished tuning of each fingerprint stay in memory to warm-start that owner's next job of the
fingerprint (another user's tuning starts no job: its settings are that user's).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hyperagent.tuner.journal import Journal, JournalState

log = logging.getLogger(__name__)


@dataclass
class _File:
    modified: float
    ended: bool


class Journals:
    """The journals under ``state_dir``."""

    def __init__(self, state_dir: Path, keep_days: float = 30.0, keep: int = 1000) -> None:
        self.state_dir = state_dir
        self.keep_s = keep_days * 86400.0
        self.keep = keep
        self._states: dict[str, JournalState] = {}
        self._files: dict[str, _File] = {}
        self._finished: dict[tuple[int | None, str], tuple[str, dict[str, Any], float]] = {}
        self.deleted = 0

    def path(self, job: str) -> Path:
        return self.state_dir / f"{job}.jsonl"

    def of(self, job: str) -> Journal:
        """The journal file of ``job``."""
        self._files.setdefault(job, _File(time.time(), False)).ended = False
        return Journal(self.path(job))

    def load(self, now: float | None = None) -> None:
        """Read every journal (blocking: call it off the event loop); raises JournalError
        for one that cannot be read. Then apply the retention policy."""
        now = time.time() if now is None else now
        for path in sorted(self.state_dir.glob("*.jsonl")):
            job = path.stem
            state = Journal(path).load()
            ended = state.ended is not None
            self._files[job] = _File(path.stat().st_mtime, ended)
            if state.final is not None and state.measured and state.fingerprint:
                self._remember(job, state.owner, state.fingerprint, state.final)
            if not ended:
                self._states[job] = state
        self.prune(now)

    def state_of(self, job: str) -> JournalState | None:
        """What the journal of ``job`` held at start (its job did not end), once."""
        return self._states.pop(job, None)

    def unread(self, job: str) -> bool:
        """``job`` has a journal file that was not read at start (written since): read it
        with :meth:`read` off the event loop."""
        return job in self._files and job not in self._states

    def read(self, job: str) -> JournalState:
        """Read ``job``'s journal now (blocking)."""
        return Journal(self.path(job)).load()

    def note_final(
        self, job: str, owner: int | None, fingerprint: str, entry: dict[str, Any]
    ) -> None:
        """A tuning of ``job`` (of the user ``owner``) finished with ``entry`` (its
        ``final``)."""
        self._remember(job, owner, fingerprint, entry)

    def _remember(
        self, job: str, owner: int | None, fingerprint: str, final: dict[str, Any]
    ) -> None:
        ts = float(final.get("ts", time.time()))
        known = self._finished.get((owner, fingerprint))
        if known is None or known[2] <= ts:
            self._finished[(owner, fingerprint)] = (job, dict(final["settings"]), ts)

    def finished(self, owner: int | None, fingerprint: str) -> tuple[str, dict[str, Any]] | None:
        """The latest finished tuning of ``owner``'s with ``fingerprint``: its job and final
        settings (a tuning whose owner is not known starts none)."""
        found = None if owner is None else self._finished.get((owner, fingerprint))
        return None if found is None else (found[0], found[1])

    def release(self, job: str, now: float | None = None) -> None:
        """``job`` was released: its journal is kept by the retention policy from now."""
        now = time.time() if now is None else now
        self._files[job] = _File(now, True)
        self.prune(now)

    def prune(self, now: float) -> int:
        """Delete the ended jobs' journals the retention policy no longer keeps; returns how
        many."""
        ended = sorted((f.modified, job) for job, f in self._files.items() if f.ended)
        doomed = [job for modified, job in ended if now - modified > self.keep_s]
        extra = len(self._files) - len(doomed) - self.keep
        kept = [job for _, job in ended if job not in doomed]
        doomed += kept[: max(0, extra)]
        for job in doomed:
            try:
                self.path(job).unlink(missing_ok=True)
            except OSError as e:
                log.warning("cannot delete the journal of %s: %s", job, e.strerror)
                continue
            del self._files[job]
            self.deleted += 1
        if doomed:
            log.info("deleted %d journal(s) of ended jobs (retention)", len(doomed))
        return len(doomed)
