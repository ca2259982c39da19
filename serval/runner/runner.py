"""ModelRunner: owns the model, its paged KV cache and the sampler; turns a Batch into sampled tokens.

Tensors only. The engine decides what to compute; the runner computes it.
"""

from __future__ import annotations

import torch

from serval.config import CacheConfig, LoraConfig, ModelConfig
from serval.model_source import ModelSource
from serval.runner.attention.backend import StepAttention, StepLayout
from serval.runner.attention.cache_dtype import (
    bytes_per_row,
    check_cache_dtype_runs,
    empty_cache,
    kv_cache_dtype,
    slot_views,
)
from serval.runner.attention.selector import select_attention_backend
from serval.runner.batch import Batch, SamplerOutput
from serval.runner.cuda_graph import decode_graphs_for
from serval.runner.info import RunnerInfo
from serval.runner.kernels import default_batch_activations, load_cpu_kernels
from serval.runner.layers import use_native_kernels
from serval.runner.loader.gguf_pack import NativeRepack
from serval.runner.loader.load import load_model, open_checkpoint
from serval.runner.lora import LoraAdapter, LoraBatch, LoraSlots
from serval.runner.media import MediaInput, MediaPrompt, media_step
from serval.runner.parallel.shard import TensorParallelPart, plan_shard, sharded_checkpoint
from serval.runner.placement import keeps_packed_weights, resolve_device, resolve_dtype
from serval.runner.pooling import pool, read_pooling
from serval.runner.sampler import Sampler


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        source: ModelSource,
        lora_config: LoraConfig | None = None,
        tensor_parallel: TensorParallelPart | None = None,
    ):
        """tensor_parallel: this process is one rank of a split model (runner/parallel/): it loads, computes
        and caches only its rank's heads and MLP slice, and all-reduces each block half's output."""
        self.device = resolve_device(model_config.device)
        checkpoint = self._open_checkpoint(source, lora_config, tensor_parallel)
        self.arch = checkpoint.arch
        # An embedding model (runner/pooling.py): embed() pools its final hidden states.
        self.pooling = None if source.is_gguf else read_pooling(source.path)
        self.weight_formats = checkpoint.weight_formats
        kernels = load_cpu_kernels() if self.device.type == "cpu" else None
        self.kernel_variant = "none" if kernels is None else kernels.variant
        self.amx_tiles = kernels is not None and kernels.int8_tile_rows() > 0
        self.dtype = resolve_dtype(model_config.dtype, self.device, self.weight_formats)
        self.max_model_len = min(
            model_config.max_model_len or self.arch.max_position_embeddings, self.arch.max_position_embeddings
        )
        self.model = self._load_model(checkpoint, model_config.dtype, kernels)
        self.kv_cache_dtype = kv_cache_dtype(cache_config.kv_cache_dtype, self.dtype)
        self.block_size = cache_config.block_size
        self.num_blocks = cache_config.num_blocks or self._blocks_for_budget(
            cache_config.kv_cache_memory_bytes
        )
        self.attention_backend = select_attention_backend(
            self.device, kernels, model_config.attention_backend
        )
        check_cache_dtype_runs(
            cache_config.kv_cache_dtype,
            self.dtype,
            self.attention_backend.name,
            self.model.kv_cache_spec(self.arch).is_latent,
        )
        # On CUDA one KV block past the engine's takes decode graphs' padding rows (decode_graphs.py).
        self.kv_caches = self._allocate_kv_cache(num_spare_blocks=int(self.device.type == "cuda"))
        self.decode_graphs = decode_graphs_for(
            self, model_config.cuda_graph_max_batch, lora_config, tensor_parallel
        )
        self.batch_activations = self._attach_kernels(kernels, model_config)
        if tensor_parallel is not None:
            self.model.use_tensor_parallel(tensor_parallel.all_reduce)
        self.lora_slots = None
        if lora_config is not None and lora_config.is_enabled:
            # the deltas through kernels.dense_linear where there are kernels: the same bits in any batch
            dense_kernel = None if kernels is None else kernels.dense_linear
            self.lora_slots = LoraSlots(
                self.model, lora_config.max_loras, lora_config.max_lora_rank, dense_kernel
            )
        # Threads per step kind, fixed here: a lone decode (one sequence, one token) may run on fewer
        # (--single-sequence-threads), every other step on all.
        self.num_threads = torch.get_num_threads()
        self.single_sequence_threads = model_config.single_sequence_threads or self.num_threads
        generator = torch.Generator(device=self.device)
        generator.manual_seed(model_config.seed)
        self.sampler = Sampler(generator, None if kernels is None else kernels.argmax_rows)

    def _attach_kernels(self, kernels, model_config: ModelConfig) -> str:
        """Put the loaded model on the native kernels (if any); the batch activations in effect: "int8" or
        "float32" (dense weights and the portable build, with no int8 path, keep batches exact)."""
        asked = model_config.batch_activations
        wants_int8 = (asked == "auto" and default_batch_activations(kernels) == "int8") or asked == "int8"
        if kernels is not None:
            deterministic = model_config.deterministic
            use_native_kernels(self.model, kernels, wants_int8, deterministic)
            self.model.use_kernels(
                kernels, self.kv_caches, self.block_size, self.dtype, wants_int8, deterministic=deterministic
            )
        self.has_packed_weights = any(getattr(m, "packed", None) is not None for m in self.model.modules())
        int8_batches = (
            wants_int8 and self.has_packed_weights and self.kernel_variant not in ("none", "portable")
        )
        return "int8" if int8_batches else "float32"

    def _open_checkpoint(
        self, source: ModelSource, lora_config: LoraConfig | None, tensor_parallel: TensorParallelPart | None
    ):
        """The checkpoint's reader, cut to this rank's slice when the model is split."""
        checkpoint = open_checkpoint(source)
        # The whole model's shape: the KV budget is the whole model's, so every rank gets the same block count.
        self.full_arch = checkpoint.arch
        self.tensor_parallel_size = 1
        if tensor_parallel is not None:
            self.check_can_split(checkpoint.arch, lora_config)
            shard = plan_shard(checkpoint.arch, tensor_parallel.rank, tensor_parallel.world_size)
            checkpoint = sharded_checkpoint(checkpoint, shard)
            self.tensor_parallel_size = tensor_parallel.world_size
        return checkpoint

    def _load_model(self, checkpoint, dtype_name: str, kernels) -> torch.nn.Module:
        use_quantized = keeps_packed_weights(dtype_name, self.dtype, kernels, checkpoint.has_packable_weights)
        return load_model(
            self.arch,
            checkpoint.read_weights,
            self.dtype,
            self.device,
            self.max_model_len,
            pack_low_bit=use_quantized,
            # The packed kernels serve every batch size, so the dense copies of packed matrices are dead
            # weight (2 or 4 bytes a weight against the codes' 0.56-1.06): the model keeps the file's size.
            release_packed_dense=use_quantized,
            packable_names=checkpoint.packable_names,
            repack=None if kernels is None else NativeRepack.of(kernels),
            block_types=checkpoint.block_types,
        )

    @property
    def info(self) -> RunnerInfo:
        return RunnerInfo(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            vocab_size=self.arch.vocab_size,
            dtype=str(self.dtype).removeprefix("torch."),
            kv_cache_dtype=str(self.kv_cache_dtype).removeprefix("torch."),
            device=str(self.device),
            max_loras=0 if self.lora_slots is None else self.lora_slots.max_loras,
            architecture=self.arch.architecture,
            weight_format="+".join(self.weight_formats),
            packed_weights=self.has_packed_weights,
            kernel_variant=self.kernel_variant,
            amx_tiles=self.amx_tiles and self.batch_activations == "int8" and self.has_packed_weights,
            attention_backend=self.attention_backend.name,
            batch_activations=self.batch_activations,
            num_threads=self.num_threads,
            tensor_parallel_size=self.tensor_parallel_size,
            pooling=None if self.pooling is None else self.pooling.mode,
            normalizes_embeddings=self.pooling is not None and self.pooling.normalize,
            hidden_size=self.full_arch.hidden_size,
        )

    @staticmethod
    def check_can_split(arch, lora_config: LoraConfig | None) -> None:
        """Refuse, at start-up, what tensor parallelism does not run (docs/deploy/tensor-parallel.md)."""
        if lora_config is not None and lora_config.is_enabled:
            raise ValueError(
                "LoRA adapters are not supported with tensor parallelism (--tensor-parallel-size)"
            )
        if not arch.has_lm_head:
            raise ValueError(
                f"{arch.architecture} as an embedding model is not supported with tensor parallelism"
                " (--tensor-parallel-size)"
            )
        if arch.moe is not None:
            raise ValueError(
                f"{arch.architecture} (a mixture of experts) is not supported with tensor parallelism"
                " (--tensor-parallel-size): its experts are not split"
            )
        if arch.mla is not None:
            raise ValueError(
                f"{arch.architecture} (latent attention) is not supported with tensor parallelism"
            )
        if arch.o_proj_bias:
            raise ValueError(
                f"{arch.architecture} with an attention output bias is not supported with tensor parallelism"
                " (--tensor-parallel-size): the bias of a row-split projection is not split"
            )
        if arch.vision is not None:
            raise ValueError(
                f"{arch.architecture} (a multimodal model) is not supported with tensor parallelism"
                " (--tensor-parallel-size): its vision tower is not split"
            )

    def watch(self, on_failure) -> None:
        """on_failure(message): called (on another thread) if the runner can no longer run a step. A single
        process never fails that way; a tensor-parallel runner calls it when a worker dies."""

    def close(self) -> None:
        """Release what the runner holds beyond memory: nothing for a single process."""

    # ---- LoRA adapters (runner/lora.py)

    def read_lora(self, path: str) -> LoraAdapter:
        """Read and check an adapter against the model; touches no slot, so any thread may call it."""
        if self.lora_slots is None:
            raise ValueError("LoRA is not enabled: start the server with --enable-lora or --lora-modules")
        return self.lora_slots.read(path)

    def load_lora(self, slot: int, adapter: LoraAdapter) -> None:
        assert self.lora_slots is not None
        self.lora_slots.load(slot, adapter)

    def unload_lora(self, slot: int) -> None:
        assert self.lora_slots is not None
        self.lora_slots.unload(slot)

    # ---- media (runner/media.py)

    @property
    def accepts_media(self) -> bool:
        return hasattr(self.model, "encode")

    def prepare_media(
        self, prompt_token_ids: list[int], items: tuple[MediaInput, ...], max_num_tokens: int
    ) -> MediaPrompt:
        """A prompt's media state: its items checked against the prompt and the model, its M-RoPE positions
        computed (once). max_num_tokens: the most tokens its context can reach (prompt and answer).
        ValueError for items this prompt or model cannot take."""
        if not self.accepts_media:
            raise ValueError(f"{self.arch.architecture} does not take media inputs")
        items = tuple(sorted(items, key=lambda item: item.offset))
        if items[0].offset < 0:
            raise ValueError("a media item's run starts before the prompt")
        self.model.check_media(prompt_token_ids, items)
        positions, delta = self.model.mrope_positions(len(prompt_token_ids), items)
        # Output token i sits at i + delta: the rotary tables must hold every position the context reaches.
        largest = max(int(positions.max()), max_num_tokens - 1 + delta)
        if largest > self.model.max_position:
            raise ValueError(
                f"the media's positions run to {largest} with the answer, past this model's "
                f"{self.model.max_position + 1}: ask for fewer tokens or a lower video fps"
            )
        return MediaPrompt(items, positions, delta)

    def _bytes_per_block(self) -> int:
        a = self.full_arch
        spec = self.model.kv_cache_spec(a)
        rows = spec.values_per_token() // spec.head_dim  # (K and V, or a latent) rows of kv heads a token
        return a.num_layers * self.block_size * rows * bytes_per_row(spec.head_dim, self.kv_cache_dtype)

    def _blocks_for_budget(self, budget_bytes: int) -> int:
        num_blocks = budget_bytes // self._bytes_per_block()
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory_bytes={budget_bytes} holds fewer than 2 KV blocks")
        return int(num_blocks)

    def _allocate_kv_cache(self, num_spare_blocks: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (k_cache, v_cache) as the model's KvCacheSpec says; a latent cache (MLA) is one
        tensor, the same object in both places. num_spare_blocks: past the engine's (CUDA graphs' padding)."""
        spec = self.model.kv_cache_spec(self.arch)
        shape = ((self.num_blocks + num_spare_blocks) * self.block_size, spec.num_kv_heads, spec.head_dim)
        caches = []
        for _ in range(self.arch.num_layers):
            k_cache = self._zeros(shape)
            caches.append((k_cache, k_cache if spec.is_latent else self._zeros(shape)))
        return caches

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        return empty_cache(shape, self.kv_cache_dtype, self.device)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (every layer's K and V rows) from source to destination block ids."""
        if not copies:
            return
        offsets = torch.arange(self.block_size, device=self.device)
        sources = torch.tensor([s for s, _ in copies], device=self.device)
        destinations = torch.tensor([d for _, d in copies], device=self.device)
        source_rows = (sources[:, None] * self.block_size + offsets).flatten()
        destination_rows = (destinations[:, None] * self.block_size + offsets).flatten()
        for k_cache, v_cache in self.kv_caches:
            for cache in (k_cache,) if v_cache is k_cache else (k_cache, v_cache):
                for slots in slot_views(cache):  # an int8 cache's scales too
                    slots.index_copy_(0, destination_rows, slots.index_select(0, source_rows))

    def _step_attention(self, batch: Batch) -> StepAttention:
        layout = StepLayout(
            batch.num_new_tokens,
            batch.num_computed_tokens,
            batch.block_table_tensor(),
            self.block_size,
            self.device,
        )
        return StepAttention.build(self.attention_backend, layout)

    @torch.inference_mode()
    def compute_logits(self, batch: Batch) -> torch.Tensor:
        """Run the model over the batch; logits (sum(batch.logit_row_counts()), vocab_size) float32 of the
        sampled sequences' rows (Batch.logit_rows: one each unless num_logit_rows asks for more)."""
        device = self.device
        self.copy_blocks(batch.block_copies)
        if self.decode_graphs is not None:  # a decode-only step replays its bucket's graph (CUDA)
            logits = self.decode_graphs.run(batch)
            if logits is not None:
                return logits
        media_rows = None
        if batch.media:  # a multimodal model's step with a media prompt in it (runner/media.py)
            position_ids, media_rows = media_step(
                self.model, batch.media, batch.num_new_tokens, batch.num_computed_tokens
            )
            position_ids = position_ids.to(device)
        else:
            position_ids = _positions(batch).to(device)
        logit_rows = batch.logit_rows().to(device)  # each sampled sequence's last row, or last few
        meta = self._step_attention(batch)
        input_ids = torch.tensor(batch.token_ids, dtype=torch.long, device=device)
        lora = None
        if batch.lora_slots:
            lora = LoraBatch.build(batch.lora_slots, batch.num_new_tokens, self.dtype, device)
        if media_rows is not None:
            media_rows.rows = media_rows.rows.to(device)
            return self.model(
                input_ids, position_ids, self.kv_caches, meta, logit_rows, lora, media=media_rows
            )
        return self.model(input_ids, position_ids, self.kv_caches, meta, logit_rows, lora)

    @torch.inference_mode()
    def embed(self, batch: Batch) -> list[torch.Tensor]:
        """An embedding model's vectors, (hidden_size,) float32 each, one per sequence of a batch of whole
        prompts (nothing cached before them; text only). Their K/V rows go to the batch's blocks as in any
        prefill; the engine frees those blocks right after."""
        assert self.pooling is not None, "only an embedding model embeds"
        if torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)
        positions = [p for n in batch.num_new_tokens for p in range(n)]
        meta = self._step_attention(batch)
        input_ids = torch.tensor(batch.token_ids, dtype=torch.long, device=self.device)
        position_ids = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model.hidden_states(input_ids, position_ids, self.kv_caches, meta)
        return [pool(rows, self.pooling) for rows in hidden.split(batch.num_new_tokens)]

    def _use_step_threads(self, batch: Batch) -> None:
        is_lone_decode = batch.num_seqs == 1 and batch.num_new_tokens[0] == 1
        num_threads = self.single_sequence_threads if is_lone_decode else self.num_threads
        # Changed only when the step kind changes (a run of lone decodes sets it once), not set and reset
        # around every lone decode. NOTE: compared with the process's count, not a copy kept here: the count
        # is the process's, and another runner (tests build several) may have changed it since.
        if torch.get_num_threads() != num_threads:
            torch.set_num_threads(num_threads)

    @torch.inference_mode()
    def score(self, batch: Batch) -> list[torch.Tensor]:
        """Logits without sampling: per entry of sample_indices, (num_logit_rows[i], vocab_size) float32, row
        j the distribution of the token after the sequence's j-th of its last num_logit_rows[i] new tokens.
        A speculative step scores the last accepted token and k drafts at once: k + 1 rows, the same (up to
        rounding) as k + 1 decode steps would give. The batch's `sampling` is not read."""
        self._use_step_threads(batch)
        return list(self.compute_logits(batch).split(batch.logit_row_counts()))

    @torch.inference_mode()
    def execute(self, batch: Batch) -> SamplerOutput:
        """Sample a token from every logit row the batch asks for (one per sampled sequence, or several of a
        speculating one: num_logit_rows), each with its own entry of batch.sampling."""
        self._use_step_threads(batch)
        if not batch.sample_indices:
            self.compute_logits(batch)
            return SamplerOutput(token_ids=[], logprobs=None, top_logprobs=None)
        if batch.num_logit_rows and len(batch.sampling) != sum(batch.num_logit_rows):
            raise ValueError("a batch needs one sampling row per logit row")
        logits = self.compute_logits(batch)
        return self.sampler(logits, batch.sampling)


def _positions(batch: Batch) -> torch.Tensor:
    """(num_tokens,) int64: each new token's position in its sequence."""
    if len(batch.token_ids) == batch.num_seqs:  # a decode-only step: each sequence's next position
        return torch.tensor(batch.num_computed_tokens, dtype=torch.long)
    positions: list[int] = []
    for num_new, num_computed in zip(batch.num_new_tokens, batch.num_computed_tokens):
        positions.extend(range(num_computed, num_computed + num_new))
    return torch.tensor(positions, dtype=torch.long)
