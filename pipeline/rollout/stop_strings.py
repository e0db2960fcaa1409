"""Stop strings as vLLM (0.32, V1 engine) applies them, for backends that sample locally.

vLLM detokenises each new token incrementally (``tokenizers``' ``DecodeStream`` primed with the prompt's
ids, ``skip_special_tokens`` as requested) and, after each token, looks for every stop string in the text
that token could have completed (``check_stop_strings``: the match that ends earliest wins, ties by list
order). On a match the request ends with ``finish_reason="stop"`` and ``stop_reason`` the stop string; the
token ids keep every token up to and including the one that completed it, whether or not
``include_stop_str_in_output`` is set (that option changes only the text). A sequence that ends on an
end-of-sequence or stop token id is not detokenised for that last token unless
``include_stop_str_in_output`` is set, so such a token never completes a stop string otherwise.

``StopStringChecker`` follows those steps one token at a time (for a tokenizer without a fast backend it
decodes the whole completion each step, as vLLM's slow path amounts to).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any


def check_stop_strings(output_text: str, new_char_count: int, stop: Sequence[str]) -> str | None:
    """The stop string the last ``new_char_count`` characters of ``output_text`` complete, or None (vLLM's
    ``check_stop_strings``: the one ending earliest, ties broken by list order)."""
    if not new_char_count or not stop:
        return None
    best, best_end = None, sys.maxsize
    for s in stop:
        i = output_text.find(s, 1 - new_char_count - len(s))
        if i != -1 and i + len(s) < best_end:
            best, best_end = s, i + len(s)
    return best


class StopStringChecker:
    """One completion's stop-string state: feed it each sampled token (``step``), it says which stop string
    the token completed, if any."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stop: Sequence[str], *,
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True) -> None:
        self.stop = [s for s in stop if s]
        self.include = include_stop_str_in_output
        self.skip = skip_special_tokens
        self.tokenizer = tokenizer
        self.text = ""
        self._ids: list[int] = []
        fast = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
        self._fast = fast if fast is not None and hasattr(fast, "decode_batch") else None
        self._stream: Any = None
        if self._fast is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=skip_special_tokens)

    def _decode_next(self, token_id: int) -> str:
        self._ids.append(token_id)
        if self._stream is not None:
            return self._stream.step(self._fast, token_id) or ""
        full = str(self.tokenizer.decode(self._ids, skip_special_tokens=self.skip))
        full = full.rstrip("\ufffd")  # an incomplete character waits for its next bytes, as vLLM's does
        new = full[len(self.text):] if full.startswith(self.text) else ""
        return new

    def step(self, token_id: int, *, stop_token: bool = False) -> str | None:
        """Detokenise ``token_id`` (one sampled token; ``stop_token``: it ends the sequence as an
        end-of-sequence or stop token id) and return the stop string it completes, or None."""
        if not self.stop:
            return None
        if stop_token and not self.include:
            return None
        before = len(self.text)
        self.text += self._decode_next(token_id)
        return check_stop_strings(self.text, len(self.text) - before, self.stop)
