"""DeepSpeed's launcher API functions: ``runner.main`` raising, resource-filter slot order,
``deepspeed.utils.numa.parse_range_list``."""
from __future__ import annotations

import pytest


@pytest.mark.parametrize("argv", ["--num_nodes 1 -i localhost foo.py", "--num_gpus 1 -e localhost foo.py"])
def test_runner_main_raises_the_launch_error(argv):
    from dsplug.launcher import runner
    from dsplug.plugins.launcher.errors import LaunchError

    with pytest.raises(LaunchError) as info:
        runner.main(argv.split())
    assert isinstance(info.value, ValueError)
    assert "--include" in str(info.value) or "--exclude" in str(info.value) or "num_" in str(info.value)


def test_the_launch_command_still_prints_one_error_line(capsys):
    from dsplug.plugins.launcher.cli import run
    from dsplug.launcher.runner import parse_args

    assert run(parse_args("--num_nodes 1 -i localhost foo.py".split())) == 2
    assert capsys.readouterr().err.startswith("dsplug launch: error: ")


def test_resource_filter_slots_ascend_whatever_order_the_spec_names():
    from dsplug.launcher.runner import parse_resource_filter

    hosts = {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1]}
    assert parse_resource_filter(hosts, include_str="worker-0:3,1,0") == {"worker-0": [0, 1, 3]}
    assert parse_resource_filter(hosts, include_str="worker-1:1@worker-0:2,0") == {"worker-0": [0, 2],
                                                                                    "worker-1": [1]}
    assert parse_resource_filter(hosts, exclude_str="worker-0:2") == {"worker-0": [0, 1, 3], "worker-1": [0, 1]}


def test_parse_range_list():
    from dsplug.utils.numa import parse_range_list

    assert parse_range_list("0,2-4,6,8-9") == [0, 2, 3, 4, 6, 8, 9]
    assert parse_range_list("5") == [5]
    for bad, words in (("0,2-6,5-9", "does not come after core 6"), ("8,2-6", "does not come after core 8"),
                       ("1,6-2", "0 <= a <= b"), ("1,x", "not a core number"), ("3,3", "after core 3")):
        with pytest.raises(ValueError, match=words):
            parse_range_list(bad)
