"""kiln/targets.py: every target's entry holds together, and the rules elsewhere agree with the table."""

from __future__ import annotations

import pytest

from kiln.precisions import PRECISIONS
from kiln.targets import (FLOOR_SM, GPU_ARCHS, GPU_NAMES, OLD_GPUS, TARGETS, normalize_target, sm_of_product)


@pytest.mark.parametrize("name", list(TARGETS))
def test_every_target_names_its_sm_its_products_and_a_memory_budget(name):
    t = TARGETS[name]
    assert t.name == f"sm{t.sm}" and GPU_ARCHS[name] == t.sm >= FLOOR_SM
    assert t.products and all(GPU_NAMES[p] == name for p in t.products)
    size, card = t.memory_budget
    assert size > 8e9 and card
    assert normalize_target(name) == (name, None) and normalize_target(name.upper()) == (name, None)
    for product in t.products:
        assert normalize_target(product) == (name, None)
        assert normalize_target(f"NVIDIA {product.upper()}") == (name, None)


def test_products_belong_to_one_target_and_old_gpus_to_none():
    products = [p for t in TARGETS.values() for p in t.products]
    assert len(products) == len(set(products)) and not set(products) & set(OLD_GPUS)
    for gpu, sm in OLD_GPUS.items():
        target, err = normalize_target(gpu)
        assert target is None and f"sm{sm}" in err["message"] and err["field"] == "target" and err["fix"]
        assert sm < FLOOR_SM


def test_every_precision_builds_for_some_target_and_none_below_the_floor():
    for p in PRECISIONS.values():
        assert p.min_sm >= FLOOR_SM and any(t.sm >= p.min_sm for t in TARGETS.values())


@pytest.mark.parametrize("label,sm", [("NVIDIA-H100-80GB-HBM3", "sm90"), ("NVIDIA-L40S", "sm89"), ("NVIDIA-B200", "sm100"),
                                      ("NVIDIA-GeForce-RTX-5090", "sm120"), ("NVIDIA-A100-SXM4-80GB", "sm80"),
                                      ("Mystery-GPU", None)])
def test_gpu_feature_discoverys_product_labels_map_to_architectures(label, sm):
    assert sm_of_product(label) == sm


def test_the_memory_gate_and_the_cli_read_the_table():
    from click import Option

    from api.cli import build
    from validation.gates import GPU_MEMORY_BUDGETS

    assert GPU_MEMORY_BUDGETS == {t.name: t.memory_budget for t in TARGETS.values()}
    target_help = next(p.help for p in build.params if isinstance(p, Option) and p.name == "target")
    assert all(name in target_help for name in TARGETS)
