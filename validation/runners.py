"""Loading artifacts the way a deployer loads them, behind one small interface (token ids in, logits out).

- ``aot-inductor``: the compiled ``model.pt2`` through ``torch._inductor.aoti_load_package``, then its weights.
- ``checkpoint``: the exported unified HF checkpoint as its consumers load it — transformers' implementation of
  its family, weights dequantized from its own tensors, activation quantization emulated from its scales
  (kiln/hfmodel.py; ModelOpt's NVFP4 forward needs CUDA, the exported tensors do not).
- reference: the unquantized checkpoint through transformers, in float32 (bfloat16 for a bfloat16 checkpoint on a
  CPU with native bf16 units: ``reference_dtype``).
Which runner a backend's artifacts load with is its descriptor's (kiln/backends.py).
- ``trtllm-engine``: the TensorRT-LLM runtime (the LLM API over the engine dir) and ``trtllm-bench``; GPU workers only.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import torch

from kiln.errors import StageFailed, ToolchainMissing


class Runner(Protocol):
    device: str
    kv_cache: bool
    #: what computed its numbers, as the report names it (``conditions.runtime``)
    runtime: str

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[batch, seq] int64 → the engine's own output, as a deployer gets it: [batch, seq, vocab] logits in the
        dtype the engine computes in, on its device. Speed and memory are measured through this
        (validation/measure.py); a runner that measures them with its own runtime (``TRTLLMRunner``) has none."""

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[batch, seq] int64 → [batch, seq, vocab] float32 on the CPU (what accuracy reads)."""


class AOTInductorRunner:
    """The kernel (``model.pt2``), then its weights (``weights.safetensors``, every constant the kernel expects, by
    name) through ``load_constants``. An engine without a weights file holds them inside its ``.so``."""

    kv_cache = False
    runtime = "torch (AOTInductor package)"

    def __init__(self, engine_dir: Path):
        meta = json.loads((engine_dir / "engine.json").read_text())
        self.device = meta.get("device", "cpu")
        weights = engine_dir / (meta.get("weights") or {}).get("file", "weights.safetensors")
        try:
            self._fn = torch._inductor.aoti_load_package(str(engine_dir / "model.pt2"))
            if weights.is_file():
                from safetensors.torch import load_file

                self._fn.load_constants(load_file(weights, device=self.device), check_full_update=True)
        except Exception as exc:
            raise StageFailed(f"the AOTInductor package does not load: {type(exc).__name__}: {exc}") from exc

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        # The compiled kernels assume contiguous inputs: a strided view (e.g. windows[:, :-1]) reads garbage.
        with torch.no_grad():
            out = self._fn(input_ids.to(self.device).contiguous())
        return out[0] if isinstance(out, (list, tuple)) else out

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.prefill(input_ids).float().cpu()


def _bf16_exact(t: torch.Tensor) -> bool:
    """Whether every value of a tensor is a bf16 value (converting it to bf16 loses nothing)."""
    return t.dtype == torch.bfloat16 or bool(torch.equal(t, t.bfloat16().to(t.dtype)))


def _this_cpu() -> str:
    """This host's ``cpu`` toolchain entry (read once per process: kiln/toolchain.py)."""
    from kiln.toolchain import toolchain_for

    return toolchain_for("aot-inductor", "cpu")["cpu"]


def _bf16_units() -> bool:
    """Whether this CPU multiplies bf16 natively (the toolchain's ``bf16`` feature: kiln/toolchain.py)."""
    from kiln.toolchain import cpu_bf16_native

    return cpu_bf16_native(_this_cpu())


@contextmanager
def _fp32_matmul_on_bf16_units():
    """oneDNN float32 matmuls on bf16 units (float32 accumulation and result) for the block, then as before."""
    knob = torch.backends.mkldnn.matmul
    before = knob.fp32_precision
    knob.fp32_precision = "bf16"
    try:
        yield
    finally:
        knob.fp32_precision = before


class LogitsHead:
    """The last step of a causal LM: hidden states → logits (its output embedding, with the family's final
    soft-capping where it has one: Gemma 2/3). The reference's hidden states are what validation stores; this
    recomputes its exact logits from them (validation/accuracy.py), in float32.

    Where both operands are exactly bf16 values (a bf16 checkpoint's head; the hidden states of a reference that
    computed in bf16) and this CPU has native bf16 units, the product runs on those units with float32
    accumulation and a float32 result (oneDNN's ``fp32_precision = "bf16"``): the operands lose nothing in the
    conversion, so the logits are the float32 product up to summation order (~1e-6 relative), 2.5 × faster on an
    AVX512-BF16 CPU (SmolLM2's head on 128 tokens: 19 ms against 47 ms). Anything else runs in plain float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, softcap: float | None = None):
        self._bf16_operands = _bf16_units() and all(t is None or _bf16_exact(t) for t in (weight, bias))
        self.weight, self.bias, self.softcap = weight.float(), None if bias is None else bias.float(), softcap

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.float()
        if self._bf16_operands and _bf16_exact(hidden):
            with _fp32_matmul_on_bf16_units():
                logits = torch.nn.functional.linear(hidden, self.weight, self.bias)
        else:
            logits = torch.nn.functional.linear(hidden, self.weight, self.bias)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @classmethod
    def of(cls, model) -> "LogitsHead":
        out = model.get_output_embeddings()
        return cls(out.weight.detach(), getattr(out, "bias", None), getattr(model.config, "final_logit_softcapping", None))

    @classmethod
    def load(cls, checkpoint_dir: Path) -> "LogitsHead":
        """The head of the checkpoint in ``checkpoint_dir``, read from its safetensors alone (the model is laid
        out on the meta device to learn which tensor its output embedding is: ``lm_head.weight``, or the input
        embedding where the two are tied)."""
        from safetensors import safe_open
        from transformers import AutoConfig, AutoModelForCausalLM

        checkpoint_dir = Path(checkpoint_dir)
        config = AutoConfig.from_pretrained(checkpoint_dir)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        out = model.get_output_embeddings()
        names = {n for n, p in model.named_parameters(remove_duplicate=False) if p is out.weight}
        bias_names = {n for n, p in model.named_parameters(remove_duplicate=False)
                      if getattr(out, "bias", None) is not None and p is out.bias}
        index = checkpoint_dir / "model.safetensors.index.json"
        files = (json.loads(index.read_text())["weight_map"] if index.is_file()
                 else {k: "model.safetensors" for k in names | bias_names})
        found: dict[str, torch.Tensor] = {}
        for wanted in (names, bias_names):
            for name in sorted(wanted):
                path = checkpoint_dir / files.get(name, "model.safetensors")
                if not path.is_file():
                    continue
                with safe_open(str(path), "pt") as f:
                    if name in f.keys():
                        found["bias" if wanted is bias_names else "weight"] = f.get_tensor(name)
                        break
        if "weight" not in found:
            raise StageFailed(f"{checkpoint_dir} holds none of {sorted(names)} (the output embedding)")
        return cls(found["weight"], found.get("bias"), getattr(config, "final_logit_softcapping", None))


def cached_greedy_decode(model, prompt: torch.Tensor, new_tokens: int) -> tuple[list[float], torch.Tensor]:
    """Greedy generation through transformers' KV cache (``DynamicCache``): the prefill (only the last position's
    logits, as runtimes compute them), then one new token per step. Returns the seconds of each step (step 0 ends
    with the first token) and the generated ids [batch, new_tokens]."""
    import time

    from transformers import DynamicCache

    cache, ids, steps, generated = DynamicCache(), prompt, [], []
    with torch.no_grad():
        for _ in range(new_tokens):
            t = time.perf_counter()
            out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            steps.append(time.perf_counter() - t)
            generated.append(nxt)
            cache, ids = out.past_key_values, nxt
    return steps, torch.cat(generated, 1)


class CheckpointRunner:
    """An exported checkpoint (or an unquantized one) as transformers computes it from its own tensors; it decodes
    with transformers' KV cache (the emulated quantization applies to every step's linears alike)."""

    kv_cache = True
    runtime = "kiln (transformers over the checkpoint's dequantized tensors)"

    def __init__(self, checkpoint_dir: Path, dtype: torch.dtype = torch.float32):
        from kiln.hfmodel import LogitsOnly, load_engine_model

        self.device = "cpu"
        self.built = load_engine_model(checkpoint_dir, dtype=dtype)
        self._model = LogitsOnly(self.built.model).eval()

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self._model(input_ids)

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.prefill(input_ids).float()

    def decode(self, prompt: torch.Tensor, new_tokens: int) -> tuple[list[float], torch.Tensor]:
        return cached_greedy_decode(self.built.model, prompt, new_tokens)


def reference_dtype(config: dict, cpu: str | None = None) -> torch.dtype:
    """What the unquantized reference computes in: a bfloat16 checkpoint in bfloat16 where this CPU has native
    bf16 units (kiln/toolchain.py ``cpu_bf16_native``: AVX512-BF16, AMX, Arm BF16) — the dtype the model is served
    in, and the one a cpu engine of it computes in on such a CPU (builder/backends/aot_inductor.compute_choice),
    so the comparison measures the quantization, not bf16's rounding — at about half float32's time; everything
    else in float32. The choice is part of the reference key (validation/reference.layout)."""
    from kiln.toolchain import cpu_bf16_native

    ckpt = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    cpu = cpu or _this_cpu()
    return torch.bfloat16 if ckpt == "bfloat16" and cpu_bf16_native(cpu) else torch.float32


class TransformersRunner:
    """The unquantized reference, exactly as transformers computes it (in ``dtype``; logits in float32)."""

    kv_cache = True
    runtime = "transformers"

    def __init__(self, checkpoint_dir: Path, dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM

        self.device, self.dtype = "cpu", dtype
        self._model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=dtype).eval()

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The final hidden states (the LM head's input, [batch, seq, hidden], float32) without running the LM
        head: the stored reference keeps these and recomputes logits when it needs them (validation/accuracy.py),
        so the head's matmul — a fifth of a small model's forward — is not paid twice."""
        with torch.no_grad():
            return self._model.get_decoder()(input_ids=input_ids).last_hidden_state.float()

    def hidden_and_logits(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The final hidden states (the LM head's input, [batch, seq, hidden]) and the logits."""
        seen = []
        hook = self._model.get_output_embeddings().register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
        try:
            logits = self.logits(input_ids)
        finally:
            hook.remove()
        return seen[0].float(), logits

    def head(self) -> "LogitsHead":
        return LogitsHead.of(self._model)

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self._model(input_ids).logits

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.prefill(input_ids).float()

    def decode(self, prompt: torch.Tensor, new_tokens: int) -> tuple[list[float], torch.Tensor]:
        return cached_greedy_decode(self._model, prompt, new_tokens)


class TRTLLMRunner:
    """A TensorRT-LLM engine through TensorRT-LLM's own runtime (the LLM API over the engine directory,
    ``tensorrt_llm._tensorrt_engine.LLM``: the executor a deployer's trtllm-serve / Triton also runs; it spawns one
    MPI rank per tensor-parallel GPU by itself). GPU workers only; **never run in this repository**.

    Accuracy reads logits without changing the engine. Kiln ships engines built without
    ``--gather_context_logits`` (that flag makes the engine compute and return logits for every context token, a
    ``max_num_tokens × vocab`` output buffer a deployer does not build), so ``logits`` asks, for every prefix
    ``x[:t+1]`` of every row, for one generated token with its generation logits (a runtime option that needs no
    build flag): those are exactly the logits at position ``t``. It costs ``seq²/2`` prefill tokens per row
    instead of ``seq`` (128-token windows: 64×), which a GPU absorbs. An engine that *was* built with
    ``--gather_context_logits`` is read the cheap way (one request per row, its context logits).

    Speed is not measured through ``logits``: ``throughput`` / ``decode_latency`` run ``trtllm-bench throughput``
    (the engine's in-flight batching, paged KV cache and streaming) on a synthetic dataset shaped by the batch
    profile and parse its report (``throughput_with_trtllm_bench``)."""

    kv_cache = True
    runtime = "tensorrt-llm (engine)"
    device = "cuda"
    END_ID = -1  # no end-of-sequence token: exactly the requested tokens are generated (trtllm-bench's default)
    BENCH_OUTPUT_TOKENS = 64
    BENCH_TIMEOUT_S = 1800
    PREFIX_REQUESTS_PER_CALL = 1024

    def __init__(self, engine_dir: Path):
        import importlib.util

        if importlib.util.find_spec("tensorrt_llm") is None:
            raise ToolchainMissing("TensorRT-LLM is not installed; trtllm-engine artifacts validate on GPU workers",
                                   fix="run validation on a GPU worker built from the TensorRT-LLM release container")
        self.engine_dir = Path(engine_dir)
        try:
            config = json.loads((self.engine_dir / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise StageFailed(f"{self.engine_dir} is not a TensorRT-LLM engine directory: {exc}") from exc
        pretrained, build = config.get("pretrained_config") or {}, config.get("build_config") or {}
        self.vocab = int(pretrained.get("vocab_size") or 0)
        self.tp_size = int((pretrained.get("mapping") or {}).get("tp_size", 1))
        self.max_input_len = int(build.get("max_input_len") or 0)
        self.max_seq_len = int(build.get("max_seq_len") or 0)
        self.mode = "context" if build.get("gather_context_logits") else "prefix"
        try:
            self.meta = json.loads((self.engine_dir / "engine.json").read_text())
        except (OSError, json.JSONDecodeError):
            self.meta = {}
        self._llm = None
        self._bench: list[dict] | None = None

    # -- the runtime ---------------------------------------------------------------------------------
    def _open(self):
        if self._llm is None:
            from tensorrt_llm._tensorrt_engine import LLM  # type: ignore[import-not-found]
            from tensorrt_llm.llmapi import KvCacheConfig  # type: ignore[import-not-found]

            try:
                self._llm = LLM(model=str(self.engine_dir), skip_tokenizer_init=True,
                                tensor_parallel_size=self.tp_size, gather_generation_logits=self.mode == "prefix",
                                kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=0.3))
            except Exception as exc:  # the plan-file / device incompatibilities surface here
                raise StageFailed(f"the TensorRT-LLM engine does not load: {type(exc).__name__}: {exc}") from exc
        return self._llm

    def close(self) -> None:
        """Release the GPU (trtllm-bench loads the engine in its own process)."""
        if self._llm is not None:
            try:
                self._llm.shutdown()
            finally:
                self._llm = None

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[batch, seq] → [batch, seq, vocab] float32 on the CPU."""
        from tensorrt_llm import SamplingParams  # type: ignore[import-not-found]

        x = input_ids.long().cpu()
        b, s = x.shape
        if (self.max_input_len and s > self.max_input_len) or (self.max_seq_len and s + 1 > self.max_seq_len):
            raise StageFailed(f"a {s}-token window does not fit this engine (max_input_len {self.max_input_len}, "
                              f"max_seq_len {self.max_seq_len}, one token is generated)")
        llm = self._open()
        common = {"max_tokens": 1, "end_id": self.END_ID, "pad_id": self.END_ID, "detokenize": False}
        if self.mode == "context":
            outs = llm.generate([row.tolist() for row in x], SamplingParams(**common, return_context_logits=True),
                                use_tqdm=False)
            return TRTLLMRunner.assemble_context_logits([o.context_logits for o in outs], b, s, self.vocab)
        params = SamplingParams(**common, return_generation_logits=True)
        rows_per_call = max(1, self.PREFIX_REQUESTS_PER_CALL // s)  # bounds the logits held at once
        parts = []
        for i in range(0, b, rows_per_call):
            chunk = x[i : i + rows_per_call]
            outs = llm.generate(TRTLLMRunner.prefix_prompts(chunk), params, use_tqdm=False)
            parts.append(TRTLLMRunner.assemble_prefix_logits([o.outputs[0].generation_logits for o in outs],
                                                             len(chunk), s, self.vocab))
        return torch.cat(parts)

    @staticmethod
    def prefix_prompts(input_ids: torch.Tensor) -> list[list[int]]:
        """Every prefix of every row, row-major: ``x[r, :t+1]`` for r < batch, t < seq."""
        return [row[: t + 1].tolist() for row in input_ids for t in range(input_ids.shape[1])]

    @staticmethod
    def _rows(logits, vocab: int) -> torch.Tensor:
        t = torch.as_tensor(logits).float().cpu()
        t = t.reshape(-1, t.shape[-1])
        return t[:, :vocab] if vocab else t  # tensor-parallel engines pad the vocabulary

    @staticmethod
    def assemble_prefix_logits(per_request: list, batch: int, seq: int, vocab: int) -> torch.Tensor:
        """Generation logits of the first generated token of each prefix request → [batch, seq, vocab]."""
        if len(per_request) != batch * seq:
            raise StageFailed(f"the runtime answered {len(per_request)} of {batch * seq} prefix requests")
        rows = [TRTLLMRunner._rows(g, vocab)[0] for g in per_request]
        return torch.stack(rows).reshape(batch, seq, -1)

    @staticmethod
    def assemble_context_logits(per_request: list, batch: int, seq: int, vocab: int) -> torch.Tensor:
        """Context logits of one request per row ([seq, vocab] each) → [batch, seq, vocab]."""
        if len(per_request) != batch:
            raise StageFailed(f"the runtime answered {len(per_request)} of {batch} requests")
        rows = [TRTLLMRunner._rows(c, vocab) for c in per_request]
        if any(r.shape[0] < seq for r in rows):
            raise StageFailed("the engine returned fewer context logits than prompt tokens")
        return torch.stack([r[:seq] for r in rows])

    # -- speed: trtllm-bench ---------------------------------------------------------------------------
    def throughput(self, profile, vocab: int | None = None) -> list[dict]:
        """Throughput points (``batch_size``, ``seq_len``, ``tokens_per_s``, ``ttft_ms``, ``tpot_ms``…) from
        ``trtllm-bench``, one run per batch size of the profile."""
        self.close()
        self._bench = TRTLLMRunner.throughput_with_trtllm_bench(self.engine_dir, profile, vocab=vocab or self.vocab)
        return self._bench

    def decode_latency(self, profile, vocab: int | None = None) -> dict:
        """TTFT / TPOT in the shape validation.measure.decode_latency returns, from the same trtllm-bench runs."""
        points = self._bench or self.throughput(profile, vocab)
        first = points[0]
        return {"ttft_ms": first.get("ttft_ms"), "tpot_ms": first.get("tpot_ms"),
                "points": [{"batch_size": p["batch_size"], "prompt_len": p["seq_len"], "new_tokens": p["output_len"],
                            "ttft_ms": p.get("ttft_ms"), "tpot_ms": p.get("tpot_ms"),
                            "decode_tokens_per_s": p["batch_size"] * 1e3 / p["tpot_ms"] if p.get("tpot_ms") else None}
                           for p in points],
                "conditions": {"method": "trtllm-bench throughput --streaming (in-flight batching, paged KV cache), "
                                         "concurrency = batch size; averages over requests",
                               "kv_cache": True, "source": "trtllm-bench"}}

    @staticmethod
    def bench_shape(profile, output_tokens: int = BENCH_OUTPUT_TOKENS) -> tuple[int, int]:
        """(input tokens, output tokens) per request: the profile's ``max_input_len`` prompt (never more than
        ``max_num_tokens``, which a context chunk must fit, and leaving one token of ``max_seq_len``) and up to
        ``output_tokens`` generated, so that prompt + output ≤ ``max_seq_len`` (trtllm-bench refuses a dataset
        longer than the engine). The prompt has priority: a profile without room to generate measures prefill."""
        inp = max(1, min(profile.max_input_len, profile.max_num_tokens, profile.max_seq_len - 1))
        return inp, max(1, min(output_tokens, profile.max_seq_len - inp))

    @staticmethod
    def bench_dataset(*, num_requests: int, input_len: int, output_len: int, vocab: int, seed: int = 0) -> list[dict]:
        """trtllm-bench's dataset records (one JSON object per line in the file): ``task_id``, ``input_ids``
        (token ids, so no tokenizer is involved) and ``output_tokens``. Token ids are uniform random, seeded."""
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (num_requests, input_len), generator=gen)
        return [{"task_id": i, "input_ids": ids[i].tolist(), "output_tokens": output_len} for i in range(num_requests)]

    @staticmethod
    def write_bench_dataset(path: Path, records: list[dict]) -> Path:
        path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
        return path

    @staticmethod
    def bench_argv(engine_dir: Path, model_path: Path, dataset: Path, report: Path, *, concurrency: int,
                   num_requests: int, warmup: int, model: str = "kiln-engine", workspace: Path | None = None) -> list[str]:
        """``trtllm-bench --model M --model_path P throughput --backend tensorrt --engine_dir E --dataset D …``.
        ``--backend tensorrt`` because trtllm-bench's default backend is pytorch; ``--streaming`` for TTFT/TPOT;
        ``--eos_id -1`` so every request generates exactly its ``output_tokens``."""
        argv = ["trtllm-bench", "--model", model, "--model_path", str(model_path)]
        if workspace is not None:
            argv += ["--workspace", str(workspace)]
        return argv + ["throughput", "--backend", "tensorrt", "--engine_dir", str(engine_dir),
                       "--dataset", str(dataset), "--concurrency", str(concurrency),
                       "--num_requests", str(num_requests), "--warmup", str(warmup), "--eos_id", "-1",
                       "--streaming", "--report_json", str(report)]

    @staticmethod
    def parse_bench_report(report: dict, *, batch: int, input_len: int, output_len: int) -> dict:
        """One throughput point from trtllm-bench's ``--report_json``. ``tokens_per_s`` is total token throughput
        (prompt + generated tokens per second of wall time), ``output_tokens_per_s`` the generated ones;
        ``ttft_ms`` / ``tpot_ms`` are per-request averages (present with ``--streaming``)."""
        perf = report.get("performance") or {}
        if not isinstance(perf.get("system_total_throughput_tok_s"), (int, float)):
            raise StageFailed("the trtllm-bench report has no performance.system_total_throughput_tok_s")
        stream = report.get("streaming_metrics") or {}
        info = report.get("request_info") or {}

        def pct(block: str, key: str):
            return (stream.get(block) or {}).get(key)

        return {
            "batch_size": batch, "seq_len": input_len, "output_len": output_len,
            "tokens_per_s": float(perf["system_total_throughput_tok_s"]),
            "output_tokens_per_s": perf.get("system_output_throughput_tok_s"),
            "requests_per_s": perf.get("request_throughput_req_s"),
            "seconds_total": perf["total_latency_ms"] / 1e3 if perf.get("total_latency_ms") is not None else None,
            "request_latency_ms": perf.get("avg_request_latency_ms"),
            "ttft_ms": stream.get("avg_ttft_ms"), "tpot_ms": stream.get("avg_tpot_ms"),
            "ttft_p99_ms": pct("ttft_percentiles", "p99"), "tpot_p99_ms": pct("tpot_percentiles", "p99"),
            "num_requests": info.get("num_requests"), "avg_concurrency": info.get("avg_num_concurrent_requests"),
            "tensorrt_llm": (report.get("engine") or {}).get("version"),
            "gpu": (report.get("machine") or {}).get("name"), "source": "trtllm-bench",
        }

    @staticmethod
    def throughput_with_trtllm_bench(engine_dir: Path, profile, *, vocab: int | None = None,
                                     workdir: Path | None = None, batches: list[int] | None = None,
                                     output_tokens: int = BENCH_OUTPUT_TOKENS, seed: int = 0,
                                     run=None) -> list[dict]:
        """Run ``trtllm-bench throughput`` once per batch size (concurrency = batch size, 4 × batch requests,
        at least 8) on a synthetic dataset shaped by ``profile``; one point per run. ``run`` is the process
        runner (default ``subprocess.run``); the engine dir must hold ``tokenizer/`` (the trtllm-engine backend copies
        it there), which trtllm-bench reads as ``--model_path``."""
        import shutil
        import subprocess
        import tempfile

        from validation.points import batch_points

        engine_dir = Path(engine_dir)
        if run is None and shutil.which("trtllm-bench") is None:
            raise ToolchainMissing("trtllm-bench is not installed; trtllm-engine throughput is measured on GPU workers",
                                   fix="run validation on a GPU worker built from the TensorRT-LLM release container")
        model_path = engine_dir / "tokenizer"
        if not (model_path / "config.json").is_file():
            raise StageFailed(f"{engine_dir} has no tokenizer/config.json, which trtllm-bench needs as --model_path")
        try:
            meta = json.loads((engine_dir / "engine.json").read_text())
        except (OSError, json.JSONDecodeError):
            meta = {}
        if vocab is None:
            vocab = int(json.loads((engine_dir / "config.json").read_text())["pretrained_config"]["vocab_size"])
        input_len, output_len = TRTLLMRunner.bench_shape(profile, output_tokens)
        run = run or subprocess.run
        own = workdir is None
        work = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="kiln-trtllm-bench-"))
        work.mkdir(parents=True, exist_ok=True)
        points = []
        try:
            for b in batches or batch_points(profile.max_batch_size):
                n = min(max(8, 4 * b), 1024)
                dataset = TRTLLMRunner.write_bench_dataset(work / f"dataset-b{b}.jsonl", TRTLLMRunner.bench_dataset(
                    num_requests=n, input_len=input_len, output_len=output_len, vocab=vocab, seed=seed + b))
                report = work / f"report-b{b}.json"
                argv = TRTLLMRunner.bench_argv(engine_dir, model_path, dataset, report, concurrency=b,
                                               num_requests=n, warmup=min(n, max(2, b)),
                                               model=meta.get("model_name") or "kiln-engine", workspace=work)
                try:
                    proc = run(argv, capture_output=True, text=True, timeout=TRTLLMRunner.BENCH_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    raise StageFailed(f"trtllm-bench at batch {b} ran longer than {TRTLLMRunner.BENCH_TIMEOUT_S}s") from None
                if proc.returncode != 0:
                    tail = " | ".join([ln for ln in (proc.stdout + proc.stderr).strip().splitlines() if ln.strip()][-3:])
                    raise StageFailed(f"trtllm-bench at batch {b} exited {proc.returncode}: {tail}")
                try:
                    data = json.loads(report.read_text())
                except (OSError, json.JSONDecodeError) as exc:
                    raise StageFailed(f"trtllm-bench at batch {b} wrote no readable report: {exc}") from exc
                points.append({**TRTLLMRunner.parse_bench_report(data, batch=b, input_len=input_len,
                                                                 output_len=output_len),
                               "argv": argv})
        finally:
            if own:
                shutil.rmtree(work, ignore_errors=True)
        return points


def open_engine(backend: str, engine_dir: Path) -> Runner:
    from kiln.backends import BACKENDS

    if backend not in BACKENDS:
        raise StageFailed(f"no runner for backend {backend!r}")
    return BACKENDS[backend].load("runner")(engine_dir)


def open_reference(checkpoint_dir: Path, dtype: torch.dtype = torch.float32) -> Runner:
    return TransformersRunner(checkpoint_dir, dtype)
