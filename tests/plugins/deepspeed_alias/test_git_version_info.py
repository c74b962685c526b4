"""``deepspeed.git_version_info`` answered from the running installation."""
from __future__ import annotations

import torch


def test_version_is_the_alias_version_and_torch_info_describes_the_installed_torch():
    import dsplug.git_version_info as info
    from dsplug.plugins.deepspeed_alias import DEEPSPEED_API_VERSION
    from dsplug.plugins.deepspeed_alias.install import alias_version

    assert info.version == alias_version() and info.version.startswith(DEEPSPEED_API_VERSION + "+dsplug.")
    assert info.torch_info["version"] == ".".join(torch.__version__.split("+")[0].split(".")[:2])
    expected_cuda = ".".join(torch.version.cuda.split(".")[:2]) if torch.version.cuda else "0.0"
    assert info.torch_info["cuda_version"] == expected_cuda
    assert set(info.torch_info) == {"version", "bf16_support", "cuda_version", "nccl_version", "hip_version"}
    assert (info.git_hash, info.git_branch) == ("unknown", "unknown")


def test_ops_tables_agree_with_deepspeed_ops():
    import dsplug
    import dsplug.git_version_info as info
    from dsplug.op_builder import ALL_OPS

    assert info.compatible_ops == dsplug.ops.__compatible_ops__
    assert set(info.installed_ops) == set(info.compatible_ops)
    for name, cls in ALL_OPS.items():
        if name in info.installed_ops:
            assert info.installed_ops[name] == cls().is_built()
    assert info.installed_ops["fused_adam"] is False  # no native build: torch's kernels do the work
    assert info.accelerator_name == dsplug.get_accelerator().device_name()


def test_the_harness_import_works_through_from_import():
    from dsplug.git_version_info import torch_info, version  # what DeepSpeed's tests/unit/util.py does

    assert isinstance(torch_info, dict) and isinstance(version, str)


def test_the_alias_module_has_deepspeeds_git_attributes():
    import dsplug
    from dsplug.plugins.deepspeed_alias.finder import DeepSpeedModule

    module = DeepSpeedModule(dsplug, "0.19.8+dsplug.0.1.0")
    assert (module.__git_hash__, module.__git_branch__) == ("unknown", "unknown")
    assert (module.__version_major__, module.__version_minor__, module.__version_patch__) == (0, 19, 8)
