"""Every entry of every axis table — precision, backend, KV cache, GPU target — is complete and consistent, and every
combination of them is either refused by the spec (naming a field and a fix) or carried by each rule that reads the
descriptors: a new value that misses a rule fails here, not in a build after calibration. Run over the tables, so a
new entry is checked without touching this file."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from kiln.backends import BACKENDS, default_backend, support_matrix
from kiln.errors import SpecError
from kiln.families import FAMILIES
from kiln.kvcache import DEFAULT_KV_CACHE, KV_CACHES, KV_SCALE_SUFFIXES, backend_gap, kv_cache_error
from kiln.precisions import FORMATS, PRECISIONS
from kiln.recipes import AUTO, RECIPES, recipes_for
from kiln.runtimes import RUNTIMES
from kiln.spec import GATE_NAMES, parse_spec
from kiln.targets import CPU, FLOOR_SM, TARGETS, normalize_target
from kiln.toolchain import READERS, toolchain_for

ALL_TARGETS = [CPU, *TARGETS]
CHECKPOINT = "hf://acme/tiny@" + "0" * 40


# -- precision ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(PRECISIONS))
def test_every_precision_has_gates_a_ladder_of_its_recipes_and_formats_it_reads(name):
    p = PRECISIONS[name]
    assert p.name == name and p.title and p.block >= 1 and p.trtllm_gemm_plugin
    assert p.gates and set(p.gates) <= set(GATE_NAMES)
    assert p.ladder and all(RECIPES[r].precision == name for r in p.ladder)
    assert p.default_recipe == AUTO or RECIPES[p.default_recipe].precision == name
    for recipe in recipes_for(name):
        assert recipe.quant_algo in FORMATS and recipe.format.precision == name
        assert recipe.backends and set(recipe.backends) <= set(BACKENDS)
    assert {f.precision for f in FORMATS.values()} <= set(PRECISIONS)


@pytest.mark.parametrize("name", list(PRECISIONS))
def test_every_precision_has_a_name_in_every_runtime(name):
    """Each recipe says, for every serving runtime, the name it loads the export under (or None); each runtime
    loads some recipe of every precision."""
    for recipe in recipes_for(name):
        assert set(recipe.runtimes) == set(RUNTIMES), recipe.name
    for runtime in RUNTIMES:
        assert any(r.runtimes[runtime] for r in recipes_for(name)), f"no {name} recipe is loaded by {runtime}"


@pytest.mark.parametrize("name", list(PRECISIONS))
def test_every_precision_has_a_minimum_sm_per_backend_that_some_target_meets(name):
    for backend in BACKENDS.values():
        need = backend.min_sm(PRECISIONS[name])
        assert need >= FLOOR_SM and any(t.sm >= need for t in TARGETS.values()), (name, backend.name)
        assert need == PRECISIONS[name].min_sm_for(backend.export) >= PRECISIONS[name].min_sm
    exports = {b.export for b in BACKENDS.values()}
    for export, sm in PRECISIONS[name].export_min_sm.items():  # each raises the floor for an export some backend makes
        assert export in exports and sm > PRECISIONS[name].min_sm, (name, export)


@pytest.mark.parametrize("name", list(PRECISIONS))
def test_every_precision_names_modelopt_configs_that_exist(name):
    mtq = pytest.importorskip("modelopt.torch.quantization")
    for recipe in recipes_for(name):
        assert isinstance(getattr(mtq, recipe.modelopt_config, None), dict), recipe.modelopt_config


# -- backend --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(BACKENDS))
def test_every_backend_has_its_compile_step_runner_toolchain_readers_and_runtime(name):
    b = BACKENDS[name]
    assert b.name == name and b.title and b.status and b.export in ("hf", "trtllm")
    assert b.load("compiler").name == name
    assert callable(b.load("runner"))
    assert set(b.toolchain) <= set(READERS), f"no reader for {set(b.toolchain) - set(READERS)}"
    for target in [t for t in ALL_TARGETS if not (b.gpu_only and t == CPU)]:
        assert set(b.runtime) <= set(toolchain_for(name, target)), "the runtime annotation names unrecorded entries"
    assert b.recipes is None or set(b.recipes) <= set(RECIPES), f"{name} names recipes that do not exist"
    assert any(name in r.backends for r in RECIPES.values()), f"no recipe is built by {name}"
    assert not b.worker_needs or b.gpu_only, "a tool only GPU workers detect is for GPU-only backends"


def test_every_backend_that_names_no_runtime_writes_serving_configs_for_every_runtime():
    from builder.serving import ANNOTATION_NAMES, RUNTIMES as SERVED

    assert set(SERVED) == set(RUNTIMES) == set(ANNOTATION_NAMES)


@pytest.mark.parametrize("target", ALL_TARGETS)
def test_the_default_backend_of_every_target_builds_for_it(target):
    assert not (BACKENDS[default_backend(target)].gpu_only and target == CPU)


def test_a_worker_with_everything_serves_every_backend_on_every_target_it_builds_for():
    from workers.capabilities import detect

    gpus = [{"index": i, "name": t.title, "sm": t.name, "memory_bytes": 1} for i, t in enumerate(TARGETS.values())]
    caps = detect(gpus, trtllm=True, cuda=True, toolchain=lambda b, t: {"tensorrt_llm": "1.2.1", "tensorrt": "10.13.3"})
    for b in BACKENDS.values():
        for target in ALL_TARGETS:
            if not (b.gpu_only and target == CPU):
                assert f"kiln.{b.name}.{target}" in caps["queues"], (b.name, target)


def test_the_support_matrix_has_every_family_precision_and_backend():
    cells = {(r["family"], r["precision"], r["backend"]) for r in support_matrix()}
    assert cells == set(itertools.product(FAMILIES, PRECISIONS, BACKENDS))


# -- KV cache -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(KV_CACHES))
def test_every_kv_cache_validates_maps_for_every_runtime_and_some_backend_builds_it(name):
    kv = KV_CACHES[name]
    assert kv.name == name and kv.title and kv_cache_error(name) is None
    assert set(kv.runtimes) == set(RUNTIMES) and all(kv.runtimes.values())
    assert kv.quantized == (kv.modelopt_config is not None) == (kv.quant_algo is not None) == bool(kv.scale_suffixes)
    assert bool(kv.trtllm_build_flags) == bool(kv.trtllm_plugins) == bool(kv.trtllm_plugins_why)
    gaps = {b: backend_gap(kv, info) for b, info in BACKENDS.items()}
    assert any(g is None for g in gaps.values()), f"no backend builds kv_cache {name}"
    for gap in filter(None, gaps.values()):
        assert gap["field"] == "kv_cache" and gap["message"] and gap["fix"]


@pytest.mark.parametrize("name", list(KV_CACHES))
def test_every_kv_cache_names_a_modelopt_config_that_exists(name):
    mtq = pytest.importorskip("modelopt.torch.quantization")
    config = KV_CACHES[name].modelopt_config
    assert config is None or isinstance(getattr(mtq, config, None), dict)


def test_the_default_kv_cache_is_unquantized_and_an_unknown_one_is_refused_with_the_choices():
    assert DEFAULT_KV_CACHE in KV_CACHES and not KV_CACHES[DEFAULT_KV_CACHE].quantized
    err = kv_cache_error("int8")
    assert err is not None and err["field"] == "kv_cache" and all(k in err["fix"] for k in KV_CACHES)
    assert not set(KV_SCALE_SUFFIXES) & {s for f in FORMATS.values() for s in f.scale_suffixes}


# -- GPU target -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(TARGETS))
def test_every_target_parses_and_some_precision_builds_for_it(name):
    t = TARGETS[name]
    assert normalize_target(name) == (name, None) and t.title and t.products and t.memory_budget[0] > 0
    assert any(b.min_sm(p) <= t.sm for p in PRECISIONS.values() for b in BACKENDS.values())


# -- every combination ----------------------------------------------------------------------------
COMBINATIONS = list(itertools.product(PRECISIONS, BACKENDS, KV_CACHES, ALL_TARGETS))


@pytest.mark.parametrize("precision, backend, kv_cache, target", COMBINATIONS,
                         ids=["-".join(c) for c in COMBINATIONS])
def test_every_combination_is_refused_with_a_fix_or_carried_by_every_rule_that_reads_the_tables(
        precision, backend, kv_cache, target):
    """The spec refuses it (each error naming a field and a fix), or each descriptor-reading rule handles it: the
    tag, the runtime annotation, the serving configs, the TensorRT-LLM plan and engine check, the queue."""
    from builder.publish import runtime_for, tag_for
    from builder.serving import serving_files
    from workers.capabilities import queue_name

    data = {"checkpoint": CHECKPOINT, "precision": precision, "backend": backend, "kv_cache": kv_cache,
            "target": target, "tp_size": 2 if BACKENDS[backend].tensor_parallel else 1}
    try:
        spec = parse_spec(data, [])
    except SpecError as exc:
        assert exc.details and all(d["field"] and d["fix"] for d in exc.details)
        return
    assert tag_for(spec).startswith(f"{precision}-{target}-")
    assert runtime_for(spec, toolchain_for(backend, target))
    assert queue_name(backend, target, tp_size=spec.tp_size).startswith(f"kiln.{backend}.{target}")
    for rung in spec.rungs:
        built = spec.with_recipe(rung)
        if BACKENDS[backend].export == "hf":
            assert serving_files(built)
        else:
            from builder.backends.trtllm import TRTLLMBackend, check_engine_config, expected_plugins

            plan = TRTLLMBackend().plan(built, Path("/q"), Path("/c"))
            assert plan["quantization"]["kv_cache_quant_algo"] == KV_CACHES[kv_cache].quant_algo
            assert check_engine_config({}, built)  # an empty engine config is told apart
            assert expected_plugins(built)["paged_kv_cache"] is True


# -- nothing outside a descriptor compares its names ----------------------------------------------
#: the descriptor modules (and the recipes, a precision's own table)
HOMES = {"kiln/precisions.py", "kiln/recipes.py", "kiln/backends.py", "kiln/kvcache.py", "kiln/targets.py"}
#: names that are also ordinary words elsewhere (a device "cpu", a format's activations "none", the field "checkpoint")
AMBIGUOUS = {"cpu", "none", "checkpoint"}


def _compared_names(tree, names: set[str]) -> list[tuple[int, str]]:
    import ast

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                found += [(node.lineno, i.value) for i in items
                          if isinstance(i, ast.Constant) and isinstance(i.value, str) and i.value in names]
    return found


def test_no_module_outside_the_descriptors_compares_an_axis_name():
    import ast

    repo = Path(__file__).resolve().parents[3]
    names = (set(PRECISIONS) | set(BACKENDS) | set(KV_CACHES) | set(TARGETS)) - AMBIGUOUS
    offenders = []
    for package in ("kiln", "builder", "workers", "api", "validation", "artifacts"):
        for path in sorted((repo / package).rglob("*.py")):
            rel = path.relative_to(repo).as_posix()
            if rel not in HOMES:
                offenders += [f"{rel}:{line} compares {name!r}" for line, name in
                              _compared_names(ast.parse(path.read_text(encoding="utf-8")), names)]
    assert not offenders, "ask the descriptor instead: " + "; ".join(offenders)
