"""The benchmarks' presets cannot drift from the sizes the scenarios read: the GPU preset
(`python -m benchmarks --gpu`, chosen by itself on a GPU) runs in no CI, and a scenario
reads one key set whatever the mode (`--quick`, full)."""

import importlib

import pytest

from benchmarks import _runner


@pytest.mark.parametrize("name", ["s1_frozen_training", "s2_gp_serving", "s10_finetune"])
def test_the_gpu_preset_has_every_size_the_full_one_has(name):
    sizes = importlib.import_module(f"benchmarks.{name}").SIZES
    assert set(sizes["gpu"]) == set(sizes["full"]) == set(sizes["quick"])


@pytest.mark.parametrize("name", sorted(_runner.SCENARIOS.values()))
def test_every_preset_has_every_size_the_full_one_has(name):
    module = importlib.import_module(f"benchmarks.{name}")
    for preset in getattr(module, "SIZES", {}).values():
        assert set(preset) == set(module.SIZES["full"])
