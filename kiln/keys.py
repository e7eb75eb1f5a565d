"""Keys. Each is the sha256 of the canonical JSON of every input that can change the bytes it names.

- ``quantize_key``: checkpoint content × precision × KV cache × calibration × quantizer toolchain. No batch
  profile, backend, target or tensor-parallel size, so a profile-only or backend-only change reuses the
  calibration.
- ``compile_key``: quantize_key × profile × target × backend × tensor-parallel size × compiler toolchain: the
  engine directory, a kernel with its weights.
- ``kernel_key``: what shapes an engine's compiled code and nothing that is only a value — the architecture
  (config.json less :data:`VALUE_ONLY_CONFIG`), the recipe and its quantization layout, the profile's limits, target,
  backend, tensor-parallel size, toolchain (the ``cpu`` entry included) and what the backend adds (aot-inductor: the
  traced graph's digest and the C++ compiler). A fine-tune of a built architecture shares it; its weights are the
  quantize stage's output (keyed by ``quantize_key``).
- ``build_key`` (the BuildKey): compile_key × evaluation data × effective gates × recipe version; equal key ⇒
  the existing artifact answers, no stage runs. A forced rebuild (``kiln build --force``) puts a nonce in the
  quantize key and in the BuildKey's data, so every stage after resolve runs again and both engines are kept.

A checkpoint enters only through its content digest, never a path or a branch name.
"""

from __future__ import annotations

from typing import Any

from kiln.digests import sha256_json
from kiln.spec import BuildSpec

# Bump when a stage's recipe changes in a way that changes its output bytes.
# 2: the quantize stage exports the unified checkpoint and the calibration (no TensorRT-LLM checkpoint); engines
#    are transformers' model of the family.
# 3: aot-inductor GPU engines compute in the checkpoint's dtype (bf16 for bf16 checkpoints), activation fake-quant in
#    float32.
# 4: a spec names its quantization recipe (kiln/recipes.py) and the layers it keeps unquantized; ``auto`` runs its
#    precision's ladder; the cpu target's compute dtype follows the build CPU's native bf16 support.
# 5: accuracy gates are decided on paired intervals, evaluated sequentially; evaluation tasks; TPOT only with a KV
#    cache.
# 6: the quantize key carried RECIPE_VERSION under a key the recipe's name overwrote (a dict literal with "recipe"
#    twice), so no bump reached the quantize stage; the version is now its own field. The default backend is
#    aot-inductor for every target, GPU targets included (kiln/backends.default_backend).
# 7: aot-inductor engines run plain causal layers' attention with ``is_causal`` (kiln/hfmodel.py CAUSAL_SDPA), quantize
#    an input shared by several linears once, and round to e4m3 by arithmetic on CPU (kiln/precisions.round_e4m3).
# 8: a bf16 aot-inductor engine's per-token FP8 quantizer reads the bf16 activation (its amax taken in bf16), so the
#    activation is rounded to bf16 before it is quantized, as in eager (kiln/precisions.fake_quant_fp8_per_token).
# 9: aot-inductor engines return logits in the dtype they compute in (bf16 for a bf16 engine), not widened to float32
#    (kiln/hfmodel.LogitsOnly); engine.json's ``output.dtype`` says which.
# 10: aot-inductor engines look rotary cos/sin up in tables made at export (kiln/hfmodel.tabulate_rotary), rounded
#     to the compute dtype as transformers rounds them, instead of recomputing them unrounded in every layer.
# 11: calibration and evaluation text goes through the checkpoint's tokenizer as runtimes send it (its BOS first in
#     every window where it adds one, never scored: validation/text.py); accuracy is evaluated at the evaluation's
#     window length and at the profile's max_seq_len.
# 12: aot-inductor engines keep their weights outside the compiled code (weights.safetensors beside model.pt2, loaded
#     at run time) and static activation scales are constants (kiln/hfmodel.py INPUT_SCALE), not literals in the code.
RECIPE_VERSION = "kiln-recipe-12"


def quantize_key(checkpoint_digest: str, spec: BuildSpec, toolchain: dict[str, str], calibration_data: str,
                 rebuild: str | None = None) -> str:
    """``rebuild``: a forced rebuild's nonce (``kiln build --force``): a new key, so nothing cached answers it."""
    return sha256_json({
        **({"rebuild": rebuild} if rebuild else {}),
        "stage": "quantize", "kiln_recipe": RECIPE_VERSION, "checkpoint": checkpoint_digest,
        "precision": spec.precision, "recipe": spec.recipe_name, "unquantized_layers": list(spec.unquantized_layers),
        "kv_cache": spec.kv_cache,
        "calibration": spec.calibration.model_dump(exclude={"dataset"}), "calibration_data": calibration_data,
        "toolchain": {k: toolchain.get(k) for k in ("torch", "modelopt", "transformers")},
    })


def compile_key(qkey: str, spec: BuildSpec, toolchain: dict[str, str]) -> str:
    return sha256_json({
        "stage": "compile", "recipe": RECIPE_VERSION, "quantize": qkey,
        "profile": spec.batch_profile.limits(), "target": spec.target, "backend": spec.backend,
        "tp_size": spec.tp_size, "toolchain": toolchain,
    })


#: config.json fields that shape no compiled code: where the checkpoint came from and what wrote it, initialisation,
#: the KV-cache switch (an engine runs without a cache), and ``quantization_config`` (keyed as the quantization
#: layout, :func:`quantization_layout`); token ids (``*_token_id``, ``*_token_ids``) are a runtime's business too
VALUE_ONLY_CONFIG = frozenset({"_name_or_path", "transformers_version", "initializer_range", "use_cache",
                               "quantization_config"})


def code_config(config: dict) -> dict:
    """The fields of a config.json that shape an engine's code: every field not known to be only a value (a field
    Kiln does not know shapes the code until it is listed in :data:`VALUE_ONLY_CONFIG`)."""
    return {k: v for k, v in config.items()
            if k not in VALUE_ONLY_CONFIG and not k.endswith(("_token_id", "_token_ids"))}


def quantization_layout(block: dict) -> dict:
    """The quantization block of an exported checkpoint (kiln/quantformat.py ``quantization_block``: algorithm, KV
    cache algorithm, group size, excluded modules, …) less its producer (the quantizer's version, not a layout)."""
    return {k: v for k, v in block.items() if k != "producer"}


def kernel_key(config: dict, quantization: dict, spec: BuildSpec, toolchain: dict[str, str], code: dict) -> str:
    """``config``: the exported checkpoint's config.json; ``quantization``: its quantization block; ``code``: what
    the backend knows shapes its code besides (aot-inductor: the traced graph's digest, the C++ compiler)."""
    return sha256_json({
        "stage": "kernel", "recipe": RECIPE_VERSION, "config": code_config(config),
        "quantization": quantization_layout(quantization), "recipe_name": spec.recipe_name,
        "precision": spec.precision, "unquantized_layers": list(spec.unquantized_layers), "kv_cache": spec.kv_cache,
        "profile": spec.batch_profile.limits(), "target": spec.target, "backend": spec.backend,
        "tp_size": spec.tp_size, "toolchain": toolchain, "code": code,
    })


def build_key(checkpoint_digest: str, spec: BuildSpec, toolchain: dict[str, str], gates: dict[str, float],
              data: dict[str, str]) -> str:
    """``data``: content digests of the calibration and evaluation texts."""
    fields: dict[str, Any] = spec.key_fields()
    return sha256_json({
        "recipe": RECIPE_VERSION, "checkpoint": checkpoint_digest, "spec": fields,
        "toolchain": toolchain, "gates": gates, "data": data,
    })


def reference_key(checkpoint_digest: str, spec: BuildSpec, toolchain: dict[str, str], data: dict[str, Any],
                  layout: dict[str, Any]) -> str:
    """The unquantized reference's results on a build's evaluation (validation/reference.py): checkpoint content ×
    evaluation text and tasks (digests) × the evaluation's shape (``layout``: window length, windows, task length
    limit, what is kept) × the reference's toolchain. No precision, recipe, backend or target: every build of the
    checkpoint with that evaluation shares it."""
    return sha256_json({
        "stage": "reference", "recipe": RECIPE_VERSION, "checkpoint": checkpoint_digest,
        "evaluation": data.get("evaluation"), "tasks": data.get("tasks", []), "layout": layout,
        "toolchain": {k: toolchain.get(k) for k in ("torch", "transformers", "lm_eval")},
    })


def request_key(checkpoint_digest: str, spec: BuildSpec, gates: dict[str, float], data: dict[str, str]) -> str:
    """The BuildKey without the toolchain: what the service can compute before it knows which worker builds.
    Identical active requests share it (one build); the worker then computes the full BuildKey."""
    return sha256_json({
        "recipe": RECIPE_VERSION, "checkpoint": checkpoint_digest, "spec": spec.key_fields(),
        "gates": gates, "data": data,
    })
