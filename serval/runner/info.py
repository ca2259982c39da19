"""RunnerInfo: what is served and how, fixed once the model is loaded, as plain values the layers above read
(the start-up line, /version, /metrics, the engine client) without touching the runner.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunnerInfo:
    """What the engine needs to know about the runner to plan: sizes, not tensors."""

    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    dtype: str
    device: str
    kv_cache_dtype: str = (
        ""  # what the KV cache holds: the compute dtype, "bfloat16", "float8_e5m2" or "int8"; "": as dtype
    )
    max_loras: int = 0  # adapter slots; 0: LoRA is not enabled
    architecture: str = ""  # e.g. "LlamaForCausalLM"
    weight_format: str = ""  # the checkpoint's matrices, most weights first: "Q4_1+Q8_0", "BF16"
    kernel_variant: str = "none"  # the native CPU kernels in use (kernels.VARIANTS' names), or none
    # Whether the int8 path takes whole tiles of 16 rows through AMX (kernels/int8_rows_amx.h: Sapphire Rapids on)
    amx_tiles: bool = False
    attention_backend: str = "sdpa"  # runner/attention/selector.py's choice: "native-cpu", "triton" or "sdpa"
    packed_weights: bool = False  # block-quantized matrices run packed (runner/quantization.py)
    # How packed 4-bit matmuls take x (every row count, wherever AVX2 is), in effect:
    # "int8" (x rounded per block, the default where the kernels have it) or "float32" (exact products: asked
    # for, or no packed weights or int8 kernel).
    batch_activations: str = "float32"
    num_threads: int = 1  # per rank under tensor parallelism
    tensor_parallel_size: int = 1  # processes the model is split over (runner/parallel/)
    # An embedding model's pooling (runner/pooling.py: "lasttoken", "mean", "cls", "max") and whether its
    # vectors are L2-normalized; None: a generative model.
    pooling: str | None = None
    normalizes_embeddings: bool = False
    hidden_size: int = 0  # the width of an embedding model's vectors
    # Speculative decoding as the engine runs it (SpeculativeConfig.describe()): not the runner's own fact,
    # filled in by the engine's client so that every report of what runs (start-up line, /version, the info
    # gauge, a replica's hello) carries it.
    speculative_decoding: str = "off"

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        """The one start-up line that says what is being served and how."""
        return (
            f"{self.architecture}, weights {self.weight_format}{self._packed_text()},"
            f" compute dtype {self.dtype} on {self.device},"
            f" CPU kernels {self.kernel_variant}, {self.num_threads} threads{self._parallel_text()},"
            f" KV cache {self.kv_cache_tokens}"
            f" tokens ({self.num_blocks} blocks of {self.block_size}{self._kv_dtype_text()}),"
            f" max context {self.max_model_len},"
            f" speculative decoding {self.speculative_decoding}"
        )

    @property
    def cache_dtype(self) -> str:
        """The KV cache's dtype name (kv_cache_dtype, or the compute dtype where it is not given)."""
        return self.kv_cache_dtype or self.dtype

    def _kv_dtype_text(self) -> str:
        return "" if self.cache_dtype == self.dtype else f", {self.cache_dtype}"

    def _packed_text(self) -> str:
        if not self.packed_weights:
            return ""
        if self.batch_activations != "int8":
            return " (packed)"
        return (
            " (packed, int8 batch activations, AMX tiles)"
            if self.amx_tiles
            else " (packed, int8 batch activations)"
        )

    def _parallel_text(self) -> str:
        return (
            ""
            if self.tensor_parallel_size == 1
            else f" in each of {self.tensor_parallel_size} tensor-parallel ranks"
        )
