"""Tokenizer helpers for the API: prompt encoding, the chat template, and per-token strings and
bytes for logprobs (cached, so streaming logprobs cost a dict lookup per token)."""

from __future__ import annotations

import functools
import re
from typing import Any

from server.errors import APIError

# token-id lists at least this long are decoded with the GIL released (see TokenText.decode)
_GIL_FREE_DECODE_MIN = 4096
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # sentencepiece byte fallback


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """The GPT-2 byte-level alphabet (printable stand-ins for the 256 bytes), inverted."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes, strict=True)}


class TokenText:
    """Wraps a transformers tokenizer for the server. With ``max_model_len``, a text too long to
    fit the context whatever its tokens is refused before it is tokenized."""

    def __init__(self, tokenizer: Any, max_model_len: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        # No token stands for more characters than its vocabulary entry spells (byte-level and
        # sentencepiece entries: one character per byte or character); twice that bound leaves
        # room for normalizers that fold characters together.
        self.max_model_len = max_model_len
        longest = max((len(piece) for piece in tokenizer.get_vocab()), default=1)
        self.max_text_chars = None if max_model_len is None else 2 * longest * max_model_len
        self._byte_level = self._detect_byte_level()
        self.text = functools.lru_cache(maxsize=65536)(self._text)
        self.bytes = functools.lru_cache(maxsize=65536)(self._bytes)

    def _detect_byte_level(self) -> bool:
        probe = self.tokenizer.encode(" é", add_special_tokens=False)
        pieces = self.tokenizer.convert_ids_to_tokens(probe)
        decoder = _byte_decoder()
        return all(isinstance(p, str) and all(c in decoder for c in p) for p in pieces)

    def encode(
        self, text: str, add_special_tokens: bool = True, param: str = "prompt"
    ) -> list[int]:
        if self.max_text_chars is not None and len(text) > self.max_text_chars:
            raise APIError(
                400,
                f"the {param} has {len(text)} characters, more than any text that fits this "
                f"model's context ({self.max_text_chars} characters at most)",
                param=param,
                code="context_length_exceeded",
            )
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        # A fast tokenizer's ``decode`` holds the GIL throughout (~50 ms for 378k ids), which
        # stalls the event loop's thread; its ``decode_batch`` releases it while it works and
        # gives the same text, unless transformers' space clean-up must run after it.
        backend = getattr(self.tokenizer, "_tokenizer", None)
        if (
            len(token_ids) < _GIL_FREE_DECODE_MIN
            or backend is None
            or getattr(self.tokenizer, "clean_up_tokenization_spaces", False)
        ):
            return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return backend.decode_batch([token_ids], skip_special_tokens=skip_special_tokens)[0]

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Renders the model's chat template (with ``tools`` for templates that render them),
        then encodes it (the template adds specials)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; use /v1/completions")
        rendered = self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
        )
        return self.encode(rendered, add_special_tokens=False, param="messages")

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _bytes(self, token_id: int) -> list[int]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            match = _BYTE_TOKEN.match(piece)
            if match:
                return [int(match.group(1), 16)]
            if self._byte_level:
                decoder = _byte_decoder()
                if all(c in decoder for c in piece):
                    return [decoder[c] for c in piece]
        return list(self._text(token_id).encode("utf-8"))
