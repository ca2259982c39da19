"""Frozen configuration built once at the edge (CLI, config file, `LLM(...)`) and passed down explicitly.

A leaf module: every layer may import it. Validation raises ValueError; nothing patches a config later.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True)
class ModelConfig:
    # Path to a .gguf file or a Hugging Face directory; None means the embedded default model.
    model: str | None = None
    # "auto" picks bf16 where the CPU has native bf16 dot products (or on CUDA), fp32 otherwise.
    dtype: str = "auto"
    # "auto": CUDA when available, else the CPU.
    device: str = "auto"
    # Longest prompt + completion; None: the model's own context length.
    max_model_len: int | None = None
    seed: int = 0  # seeds the global generator used by unseeded sampling
    # CPU threads for a decode step of one lone sequence; 0: all of torch's. Such a step is bound by memory,
    # not arithmetic, and in a server the event loop and the clients need a core meanwhile: `serval serve`
    # uses 1 (same median latency as 2 threads on 2 cores, lower p99:
    # docs/benchmarks/2026-11-29-to-12-01.md).
    single_sequence_threads: int = 0
    # How matmuls over packed 4-bit weights take x, at every row count (one path, so that a row's numbers do
    # not depend on its batch): "int8", x rounded per block of 32 as llama.cpp does, outliers kept exact (twice the products an
    # instruction of the exact paths; teacher-forced divergence from fp32 on the default model below
    # llama.cpp's own, docs/benchmarks/2026-12-04.md); "float32", int16 x, closer to the file's exact
    # products; "auto", the faster of the two for the kernel variant (kernels.default_batch_activations).
    batch_activations: str = "auto"
    # The attention backend (runner/attention/selector.py): "auto" picks by device (native-cpu on the CPU with
    # the kernels built, triton on CUDA, sdpa otherwise); "sdpa", "native-cpu" or "triton" force one, and
    # start-up fails where it cannot run (tests force "triton" on the CPU under TRITON_INTERPRET=1).
    attention_backend: str = "auto"
    # CUDA only: decode-only steps of up to this many sequences replay captured CUDA graphs
    # (runner/decode_graphs.py); 0 runs every step eagerly. Ignored on the CPU.
    cuda_graph_max_batch: int = 256
    # Dense matrices are batch-invariant by default (kernels.dense_linear: one order over K at every row
    # count) wherever that measured no slower: fp32 weights, GGUF F16/BF16 matrices, LoRA deltas. True also
    # sends bf16 weights in bf16 compute (a safetensors model on a CPU with native bf16) through it, at
    # 0.86x oneDNN's whole decode steps at 64 rows (docs/architecture.md, "Batch invariance").
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.cuda_graph_max_batch < 0:
            raise ValueError(f"cuda_graph_max_batch must be >= 0, got {self.cuda_graph_max_batch}")
        if self.attention_backend not in ("auto", "native-cpu", "sdpa", "triton"):
            raise ValueError(
                f"attention_backend must be auto, native-cpu, sdpa or triton, got {self.attention_backend!r}"
            )
        if self.batch_activations not in ("auto", "float32", "int8"):
            raise ValueError(
                f"batch_activations must be auto, float32 or int8, got {self.batch_activations!r}"
            )
        if self.single_sequence_threads < 0:
            raise ValueError(f"single_sequence_threads must be >= 0, got {self.single_sequence_threads}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")


# "fp8": e5m2, as vLLM's CPU backend reads it.
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e5m2", "int8")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Memory for the paged KV cache; the number of blocks follows from it and the model's shape.
    kv_cache_memory_bytes: int = 1 * GIB
    # Overrides the memory budget with an exact block count (tests use it to force preemption).
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    # Most of the KV cache explicit prompt caching (cache_control) may pin. The rest always stays free for
    # running requests, so the context limit shrinks by it; pins need the prefix cache, without it none.
    max_pinned_kv_fraction: float = 0.25
    # What the KV cache holds (runner/attention/cache_dtype.py): "auto", the model's compute dtype; "bfloat16",
    # half an fp32 cache's bytes where the compute dtype is fp32 (CPUs without bf16 arithmetic); one byte a
    # value, so twice a bf16 cache's tokens in the same memory and half the bytes a decode step's attention
    # reads: "fp8_e5m2" (or "fp8", as vLLM's CPU backend takes it), each value rounded to 2 mantissa bits;
    # "int8", each row of head_dim values as codes and one scale (4 bytes more a row), far closer to the
    # compute dtype (docs/benchmarks.md has both losses).
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be {' or '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
                + (" (fp8_e4m3 is not supported: fp8_e5m2 is)" if "fp8" in self.kv_cache_dtype else "")
            )
        if not 0.0 <= self.max_pinned_kv_fraction < 1.0:
            raise ValueError(f"max_pinned_kv_fraction must be in [0, 1), got {self.max_pinned_kv_fraction}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    # Most requests running at once.
    max_num_seqs: int = 64
    # Token budget of one step, shared by decodes and prefill chunks.
    max_num_batched_tokens: int = 512
    # Requests waiting beyond this are refused (the API answers 429).
    max_queue_len: int = 1024

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.max_queue_len < 1:
            raise ValueError("max_queue_len must be positive")


@dataclass(frozen=True)
class LoraModule:
    """An adapter to load at start-up (`--lora-modules name=path`, MindIE's LoraModules)."""

    name: str  # what clients put in `model`
    path: str  # a PEFT directory: adapter_config.json + adapter_model.safetensors
    base_model_name: str | None = None  # the `parent` /v1/models reports; None: the served model's name

    def __post_init__(self) -> None:
        if not self.name or not self.path:
            raise ValueError("a LoRA module needs a non-empty name and path")


@dataclass(frozen=True)
class LoraConfig:
    # Adapter slots are preallocated (max_loras * max_lora_rank per targeted matrix), so LoRA costs memory
    # only when asked for: with --enable-lora, or implied by adapters given at start-up.
    enable_lora: bool = False
    # Adapters loaded at once; every loaded adapter owns a slot, and all may share one batch.
    max_loras: int = 4
    # Largest adapter rank accepted; the slots are sized for it.
    max_lora_rank: int = 16
    lora_modules: tuple[LoraModule, ...] = ()

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be positive, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be positive, got {self.max_lora_rank}")
        names = [m.name for m in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"LoRA module names must be unique, got {names}")
        if len(names) > self.max_loras:
            raise ValueError(f"{len(names)} LoRA modules given but max_loras is {self.max_loras}")

    @property
    def is_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)


@dataclass(frozen=True)
class ParallelConfig:
    # Processes the model is split over (runner/parallel/, docs/deploy/tensor-parallel.md): each holds 1/N
    # of the attention heads and of the MLP. 1: one process, no split.
    tensor_parallel_size: int = 1
    # Torch threads of each rank; 0: torch's count (the machine's cores) divided by the size.
    threads_per_rank: int = 0
    # Seconds one all-reduce may wait for the other ranks before the step fails: a hung (not dead) worker.
    # A dead one is seen at once (its connections close) or by the process watch.
    collective_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be positive, got {self.tensor_parallel_size}")
        if self.threads_per_rank < 0:
            raise ValueError(f"threads_per_rank must be >= 0, got {self.threads_per_rank}")
        if self.collective_timeout_s <= 0:
            raise ValueError("collective_timeout_s must be positive")


SPECULATIVE_METHODS = ("ngram", "draft_model")
# The most running sequences a step speculates with, by method, where the config does not say (measured on the
# grounded workload, 2 cores: docs/speculative.md). n-gram drafts cost next to nothing to propose and paid up
# to 16 sequences. A draft model costs ~40% of its target a token (the 135M Q4_1 copy drafting for its F16
# file): 1.5-1.7x alone, but with two streams its drafting and its prompts' catching up left 0.87x the
# throughput, 0.71x at 16.
MAX_SPECULATING_SEQS = {"ngram": 16, "draft_model": 1}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/speculation/), vLLM's --speculative-config keys. A decoding sequence gets
    up to num_speculative_tokens drafts a step; the model checks them all in the one forward pass that makes
    its next token, and the answer is the one plain decoding gives (greedy: the same tokens; sampled: the same
    distribution)."""

    method: str | None = None  # "ngram" (prompt lookup), "draft_model"; None: off
    num_speculative_tokens: int = 4  # the most drafts a sequence gets a step
    # serval's: each sequence's draft length follows its own acceptance (Speculator.draft_length): it starts
    # at up to 4, doubles after a step whose drafts were all kept and halves after one with a rejection, up to
    # num_speculative_tokens. False: every step drafts num_speculative_tokens.
    adaptive_draft_length: bool = True
    # ngram: the longest and shortest suffix of the sequence looked up earlier in its prompt and output. A
    # longer suffix names its place better: on the grounded workload 8 (not 4) kept more of the drafts.
    prompt_lookup_max: int = 8
    prompt_lookup_min: int = 2
    model: str | None = None  # draft_model: a smaller GGUF/HF model with the target's vocabulary
    # Speculation runs in a step only while at most this many sequences decode: past it the batch already
    # keeps the machine busy and drafts cost more than they save. None: the method's measured default
    # (MAX_SPECULATING_SEQS; docs/speculative.md).
    max_num_seqs: int | None = None

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}"
            )
        if not 1 <= self.num_speculative_tokens <= 15:
            # NOTE: 15 keeps a step's drafts inside what a grammar can take back (MAX_ROLLBACK_TOKENS).
            raise ValueError(
                f"num_speculative_tokens must be between 1 and 15, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("a draft model is given exactly when the method is draft_model")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if not isinstance(self.adaptive_draft_length, bool):
            # NOTE: ValueError, as every config check: the CLI and the config file turn it into their message.
            message = f"adaptive_draft_length must be true or false, got {self.adaptive_draft_length!r}"
            raise ValueError(message)  # noqa: TRY004

    @property
    def is_enabled(self) -> bool:
        return self.method is not None

    @property
    def max_speculating_seqs(self) -> int:
        """The most running sequences a step speculates with: max_num_seqs, or the method's default."""
        if self.max_num_seqs is not None:
            return self.max_num_seqs
        return MAX_SPECULATING_SEQS.get(self.method, 1)

    def describe(self) -> str:
        """What runs, in a few words: "off", "ngram (up to 4 drafts, n-grams of 2-8; ...)", "draft_model (4
        drafts, PATH; ...)" (fixed draft length)."""
        if self.method is None:
            return "off"
        source = (
            f"n-grams of {self.prompt_lookup_min}-{self.prompt_lookup_max}"
            if self.method == "ngram"
            else self.model
        )
        drafts = f"{'up to ' if self.adaptive_draft_length else ''}{self.num_speculative_tokens} drafts"
        return f"{self.method} ({drafts}, {source}; up to {self.max_speculating_seqs} sequences)"

    @classmethod
    def from_dict(cls, fields: object) -> SpeculativeConfig:
        """vLLM's --speculative-config object ({"method": "ngram", "num_speculative_tokens": 4, ...}), keys
        checked: ValueError names one it does not know."""
        if not isinstance(fields, dict):
            raise ValueError("the speculative config must be a JSON object")  # noqa: TRY004
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"unknown speculative config key(s) {unknown}; known: {sorted(known)}")
        try:
            return cls(**fields)
        except TypeError as e:
            raise ValueError(f"bad speculative config: {e}") from None


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    lora: LoraConfig = LoraConfig()
    parallel: ParallelConfig = ParallelConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
