"""A plugin's checkpoint state that cannot be saved fails the save naming the plugin and the key,
and leaves no staging directory; the previous checkpoint stays as it was."""
from __future__ import annotations

import os
import threading

import pytest

import dsplug
from dsplug.checkpoint import CheckpointError
from dsplug.hookspecs import hookimpl
from tests.engine_common import batch, loss_fn, make_model

CONFIG = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}


class Contributes:
    def __init__(self, scope, value):
        self.scope, self.value = scope, value

    @hookimpl
    def dsplug_checkpoint_state(self, scope):
        return self.value if scope == self.scope else None


class WritesFile:
    @hookimpl
    def dsplug_checkpoint_files(self):
        return {"extra_rank_0.pt": {"lock": threading.Lock()}}


def _engine():
    engine = dsplug.initialize(model=make_model(), config=CONFIG)[0]
    x, y = batch(0, 0, 0, 2)
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    return engine


CASES = [
    (Contributes("rank", {"good": 1, "handle": threading.Lock()}),
     r"checkpoint state 'handle' \(scope 'rank'\) from plugin 'my-plugin' cannot be saved: TypeError"),
    (Contributes("model", {"fn": lambda: 0}),
     r"checkpoint state 'fn' \(scope 'model'\) from plugin 'my-plugin' cannot be saved"),
    (Contributes("model", ["not", "a", "dict"]),
     r"plugin 'my-plugin': dsplug_checkpoint_state returned list for scope 'model'"),
    (Contributes("rank", {3: "x"}), r"plugin 'my-plugin': dsplug_checkpoint_state returned the key 3 \(int\)"),
    (Contributes("model", {"client_state": 1}), r"'client_state' \(scope 'model'\) is contributed by 'the engine' "
                                                r"and by plugin 'my-plugin'"),
    (WritesFile(), r"checkpoint file 'extra_rank_0.pt' from plugin 'my-plugin' cannot be saved"),
]


@pytest.mark.parametrize("plugin,message", CASES, ids=["lock", "lambda", "list", "int-key", "engine-key", "file"])
def test_unsaveable_state_names_the_plugin_and_key_and_leaves_nothing(tmp_path, plugin, message):
    engine = _engine()
    engine.save_checkpoint(tmp_path, tag="before")
    before = sorted(os.listdir(tmp_path))
    manifest = (tmp_path / "before" / "manifest.json").read_bytes()
    engine.add_observer(plugin, name="my-plugin")
    with pytest.raises(CheckpointError, match=message) as info:
        engine.save_checkpoint(tmp_path, tag="after")
    assert "\n" not in str(info.value)
    assert sorted(os.listdir(tmp_path)) == before  # no after.partial, 'latest' untouched
    assert (tmp_path / "latest").read_text() == "before"
    assert (tmp_path / "before" / "manifest.json").read_bytes() == manifest
    path, _ = _engine().load_checkpoint(tmp_path)
    assert path == str(tmp_path / "before")
