"""Text <-> token ids for one model, built from a Hugging Face directory or from a GGUF file's metadata.

Owns the `Tokenizer` the serving layer uses: encoding (with and without special-token parsing), decoding,
the raw bytes of a token, and the model's special ids (bos, the end-of-generation set) and chat template.
A GGUF carries no tokenizer.json: gguf_tokenizer.py rebuilds one from its metadata. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from serval.model_source import ModelSource
from serval.serving import harmony
from serval.serving.gguf_tokenizer import (
    BYTE_TOKEN,
    GGUF_TOKENIZER_KEYS,
    METASPACE,
    byte_level_symbols,
    gguf_backend,
)


def _unique(ids: Iterable[int | None]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


class Tokenizer:
    """One model's tokenizer. Thread-safe: encoding and decoding never change state."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None,
        add_bos_token: bool,
    ) -> None:
        self._backend = backend
        serialized = backend.to_str()
        # NOTE: a second copy with special-token matching off, instead of flipping the flag on the shared
        # one per call, so encode_plain is safe to call from any thread.
        self._plain = BackendTokenizer.from_str(serialized)
        self._plain.encode_special_tokens = True
        # The decoder's own JSON (a few hundred bytes), not the whole serialized tokenizer's (~0.1 s to parse).
        decoder = backend.decoder
        self._is_byte_level = decoder is not None and '"ByteLevel"' in decoder.__getstate__().decode()
        self._byte_of_symbol = {symbol: byte for byte, symbol in enumerate(byte_level_symbols())}
        added = backend.get_added_tokens_decoder()  # id -> AddedToken
        self._added_ids = frozenset(added)
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = _harmony_end_of_generation(added, tuple(eos_token_ids))
        self.special_token_ids: frozenset[int] = frozenset(
            [i for i, token in added.items() if token.special]
            + [*_unique([bos_token_id]), *self.eos_token_ids]
        )
        # The texts encode() turns into special tokens and encode_plain() never does (ChatTemplate needs them
        # to tell client strings that could spell one from those that cannot).
        self.special_token_texts: frozenset[str] = frozenset(t.content for t in added.values() if t.special)
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

    # --- construction ---------------------------------------------------------------------------------

    @classmethod
    def from_source(cls, source: ModelSource) -> Tokenizer:
        return cls.from_gguf(source.path) if source.is_gguf else cls.from_directory(source.path)

    @classmethod
    def from_directory(cls, directory: str) -> Tokenizer:
        """A Hugging Face model directory: tokenizer.json plus the configs that name special tokens."""
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(
                f"{directory} has no tokenizer.json (slow, sentencepiece-only tokenizers are not supported)"
            )
        backend = BackendTokenizer.from_file(path)
        config = _read_json(directory, "tokenizer_config.json")
        _add_missing_tokens(backend, config.get("added_tokens_decoder") or {})

        def token_id(key: str) -> int | None:
            token = config.get(key)
            token = token.get("content") if isinstance(token, dict) else token
            return backend.token_to_id(token) if token else None

        model_config = _read_json(directory, "config.json")
        generation = _read_json(directory, "generation_config.json")
        bos_token_id = token_id("bos_token")
        if bos_token_id is None:
            bos_token_id = next(iter(_as_id_list(model_config.get("bos_token_id"))), None)
        eos_token_ids = _unique(
            [
                token_id("eos_token"),
                *_as_id_list(generation.get("eos_token_id")),
                *_as_id_list(model_config.get("eos_token_id")),
            ]
        )
        add_bos_token = config.get("add_bos_token")
        if add_bos_token is None:
            # tokenizer.json's post-processor says it (Llama 3 adds <|begin_of_text|> there, not in the config)
            with_specials = backend.encode("", add_special_tokens=True).ids
            add_bos_token = bos_token_id is not None and with_specials[:1] == [bos_token_id]
        return cls(
            backend,
            bos_token_id=bos_token_id,
            eos_token_ids=eos_token_ids,
            chat_template=_directory_chat_template(directory, config),
            add_bos_token=bool(add_bos_token),
        )

    @classmethod
    def from_gguf(cls, path: str) -> Tokenizer:
        """A GGUF file: the tokenizer its tokenizer.ggml.* metadata describes (serving/gguf_tokenizer.py)."""
        from serval.runner.loader.gguf import metadata_value, open_gguf

        reader = open_gguf(path)
        meta = {key: metadata_value(reader, f"tokenizer.ggml.{key}") for key in GGUF_TOKENIZER_KEYS}
        if not meta["tokens"]:
            raise ValueError(f"{path} has no tokenizer (no tokenizer.ggml.tokens)")
        backend, default_add_bos, end_of_generation = gguf_backend(meta)
        add_bos = meta["add_bos_token"]
        return cls(
            backend,
            bos_token_id=meta["bos_token_id"],
            eos_token_ids=_unique(
                [meta["eos_token_id"], meta["eot_token_id"], meta["eom_token_id"], *end_of_generation]
            ),
            chat_template=metadata_value(reader, "tokenizer.chat_template"),
            add_bos_token=default_add_bos if add_bos is None else bool(add_bos),
        )

    # --- the interface ---------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text are parsed (chat templates rely on it).

        add_special_tokens prepends BOS when this model wants one (add_bos_token) and the text has none.
        """
        # NOTE: the backend's own post-processor is never run, so BOS is added in one place for both sources
        ids = _encode_releasing_gil(self._backend, text)
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def encode_with_post_processor(self, text: str) -> list[int]:
        """Token ids as Hugging Face's `tokenizer(text)` gives them: the tokenizer.json post-processor run
        (Qwen3-Embedding's appends <|endoftext|>, the token its last-token pooling reads). Embeddings only:
        what sentence-transformers computes, and so what an embedding model was trained on."""
        return self._backend.encode_batch([text], add_special_tokens=True)[0].ids

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of untrusted text: a user's "<|im_start|>" becomes ordinary pieces, never a control id."""
        return _encode_releasing_gil(self._plain, text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for; a token may hold part of a UTF-8 character (logprobs' `bytes`)."""
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        if token_id in self._added_ids:
            return token.encode("utf-8")  # added tokens are stored as their text
        if self._is_byte_level:
            table = self._byte_of_symbol
            return b"".join(bytes([table[c]]) if c in table else c.encode("utf-8") for c in token)
        match = BYTE_TOKEN.fullmatch(token)
        if match is not None:
            return bytes([int(match.group(1), 16)])
        return token.replace(METASPACE, " ").encode("utf-8")

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None


def _harmony_end_of_generation(
    added: dict[int, AddedToken], eos_token_ids: tuple[int, ...]
) -> tuple[int, ...]:
    """A harmony vocabulary's (gpt-oss) end-of-generation ids: <|return|> (the answer is done) and <|call|> (a
    tool call waits for its result) end it, <|end|> only ends a message. NOTE: llama.cpp drops <|end|> from
    its end-of-generation set for such vocabularies too; a GGUF's eot id or the GGUF end texts may name it."""
    special = {token.content: token_id for token_id, token in added.items() if token.special}
    if not (
        harmony.is_harmony_vocabulary(frozenset(special))
        and all(t in special for t in harmony.END_OF_GENERATION)
    ):
        return eos_token_ids
    kept = [token_id for token_id in eos_token_ids if token_id != special[harmony.END]]
    return _unique([*kept, *(special[text] for text in harmony.END_OF_GENERATION)])


# --- Hugging Face directory helpers ---------------------------------------------------------------------


def _read_json(directory: str, name: str) -> dict:
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _directory_chat_template(directory: str, config: dict) -> str | None:
    jinja = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja):  # where newer transformers versions save it
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template") or _read_json(directory, "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry["name"]: entry["template"] for entry in template}
        template = named.get("default", next(iter(named.values()), None))
    return template


def _add_missing_tokens(backend: BackendTokenizer, added_tokens_decoder: dict[str, dict]) -> None:
    # tokenizer_config.json may list added tokens tokenizer.json lacks; add those, keep the rest as they are
    present = {token.content for token in backend.get_added_tokens_decoder().values()}
    for entry in added_tokens_decoder.values():
        if entry["content"] in present:
            continue
        token = AddedToken(
            entry["content"], special=entry.get("special", False), normalized=entry.get("normalized", False)
        )
        if entry.get("special", False):
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])


# --- GGUF tokenizer builders --------------------------------------------------------------------------


def _encode_releasing_gil(backend: BackendTokenizer, text: str) -> list[int]:
    # NOTE: encode_batch of one text, not encode: the same ids, but only the batch call releases the GIL while
    # it runs, which is what lets a long prompt be tokenized in a thread while the event loop goes on
    # (serving/text_threads.py). 3 MiB: the loop ran twice in 3.2 s beside encode, 289 times beside this;
    # a short text costs ~2 us more.
    return backend.encode_batch([text], add_special_tokens=False)[0].ids
