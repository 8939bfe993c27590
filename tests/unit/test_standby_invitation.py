"""The invitation file between a launcher and standby workers, the config that asks for it,
and a standby worker that outlives a run it cannot join."""
from __future__ import annotations

import asyncio
import json
import os

import pytest

from astraflow.config.loader import ConfigError, parse_config
from astraflow.rollout.invitation import ANNOUNCEMENT, announce, announced, check_private, withdraw
from tests.conftest import BASE_CONFIG


def test_announce_replace_and_withdraw(tmp_path):
    standby = tmp_path / "standby"
    first = announce(standby, tmp_path / "run-a")
    assert os.stat(standby).st_mode & 0o777 == 0o700
    assert announced(standby) == {"run_dir": str((tmp_path / "run-a").resolve()), "id": first}
    second = announce(standby, tmp_path / "run-a")  # the same run again (resumed): a new invitation
    assert second != first
    withdraw(standby, first)  # an ended invitation leaves the newer one alone
    assert announced(standby)["id"] == second
    withdraw(standby, second)
    assert announced(standby) is None
    assert list(standby.iterdir()) == []  # no temporary file left behind


def test_a_damaged_announcement_is_ignored_not_fatal(tmp_path):
    (tmp_path / ANNOUNCEMENT).write_text("{not json")
    assert announced(tmp_path) is None
    (tmp_path / ANNOUNCEMENT).write_text(json.dumps({"run_dir": 3}))
    assert announced(tmp_path) is None


def test_a_standby_directory_others_may_write_is_refused(tmp_path):
    os.chmod(tmp_path, 0o770)
    with pytest.raises(ConfigError, match=r"writable by others \(mode 0770\).*chmod 700"):
        check_private(tmp_path)


def test_no_workers_needs_a_standby_directory():
    with pytest.raises(ConfigError, match=r"rollout\.workers: expected >= 0, got -1"):
        parse_config(BASE_CONFIG, overrides=["rollout.workers=-1"])
    with pytest.raises(ConfigError, match=r"rollout\.workers: 0 workers and no rollout\.standby"):
        parse_config(BASE_CONFIG, overrides=["rollout.workers=0"])
    cfg = parse_config(BASE_CONFIG, overrides=["rollout.workers=0", "rollout.standby=/srv/standby"])
    assert cfg.rollout.standby == "/srv/standby" and cfg.rollout.workers == 0


def test_a_run_a_standby_worker_cannot_join_is_logged_and_it_waits_for_the_next(tmp_path, caplog):
    from astraflow.rollout.standby import StandbyWorker

    standby = tmp_path / "standby"
    announce(standby, tmp_path / "no-such-run")
    worker = StandbyWorker(standby, [], "standby-0")

    async def main() -> None:
        serving = asyncio.create_task(worker.serve())
        await asyncio.sleep(0.5)
        assert not serving.done()  # still standing by
        worker.stop()
        await asyncio.wait_for(serving, 5)

    asyncio.run(main())
    assert "cannot join the run announced" in caplog.text and "no-such-run: no such directory" in caplog.text
    assert worker.runs == 0
