"""jsonl_monitor against dsplug's monitor contract, plus what is particular to it."""
from __future__ import annotations

import json

import dsplug_jsonl_monitor.plugin as plugin
from dsplug_jsonl_monitor.monitor import EMA_TAG, STATE_KEY, read_events

from dsplug.testing import MonitorContract, save_and_load, train_steps

BETA = 0.5


class TestJsonlMonitor(MonitorContract):
    plugin_name = "jsonl_monitor"
    # registered at runtime when the distribution is not installed (a no-op when it is)
    plugins = (plugin,)
    distribution = "dsplug-jsonl-monitor"
    section = {"enabled": True, "output_path": "{tmp_path}", "job_name": "job", "ema_beta": BETA}

    def read_back(self, tmp_path):
        return read_events(str(tmp_path / "job" / "events.jsonl"))

    def check_trained(self, engine, losses):
        monitor = self.part(engine)
        ema = losses[0]
        for loss in losses[1:]:
            ema = BETA * ema + (1 - BETA) * loss
        assert monitor.loss_ema == ema
        assert monitor.best_loss == min(losses)
        assert monitor.steps_seen == len(losses)

    def test_resumed_run_continues_ema_and_file(self):
        whole = self.make_engine()
        train_steps(whole, 4)
        want = self.part(whole).state_dict()
        self.destroy(whole)
        (self.tmp_path / "job" / "events.jsonl").unlink()

        first = self.make_engine()
        train_steps(first, 2)
        resumed = save_and_load(first, self.tmp_path / "ckpt", self.make_engine)
        self.destroy(first)
        saved = json.loads(json.dumps(self.part(resumed).state_dict()))
        assert saved["steps_seen"] == 2 and saved["events_written"] > 0
        train_steps(resumed, 2)
        got = self.part(resumed).state_dict()
        self.destroy(resumed)
        assert got == want
        # one file, appended to across the restart, holding exactly the events counted
        events = self.read_back(self.tmp_path)
        assert len(events) == got["events_written"]
        assert [s for t, _, s in events if t == EMA_TAG] == [2, 4, 6, 8]

    def test_state_lives_under_its_own_key(self):
        engine = self.make_engine()
        train_steps(engine, 1)
        state = self.state_of(engine)
        assert list(state["model"]) == [STATE_KEY] and state["rank"] == {}
