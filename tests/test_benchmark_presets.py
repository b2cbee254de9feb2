"""The benchmarks' GPU preset (`python -m benchmarks --gpu`, chosen by itself on a GPU)
cannot drift from the sizes the scenarios read: no GPU runs it in CI."""

import importlib

import pytest


@pytest.mark.parametrize("name", ["s1_frozen_training", "s2_gp_serving", "s10_finetune"])
def test_the_gpu_preset_has_every_size_the_full_one_has(name):
    sizes = importlib.import_module(f"benchmarks.{name}").SIZES
    assert set(sizes["gpu"]) == set(sizes["full"]) == set(sizes["quick"])
