"""A trivial byte-level tokenizer, so that the worker takes text without a
real tokenizer: each UTF-8 byte is one token id, taken modulo the vocabulary.

    ids = ByteTokenizer(vocab_size=32000).encode("You are terse.")   # [89, 111, ...]

It is no model's tokenizer: a real checkpoint given these ids sees bytes,
not its own word pieces, and generates accordingly. It exists to make the
prefix machinery visible from a shell; pass token ids (--system-ids,
--prompt-ids) to drive a real model with its own tokenizer's output.
With a vocabulary below 256, different bytes share ids (the modulo), so
decode() is exact only for ids below 256 and vocabularies of 256 or more.
"""

from typing import List, Sequence

BYTE_VALUES = 256


class ByteTokenizer:
    """Text <-> token ids, one id per UTF-8 byte (modulo `vocab_size`)."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 1:
            raise ValueError("vocab_size must be positive, not %d" % vocab_size)
        self.vocab_size = vocab_size

    def encode(self, text: str) -> List[int]:
        """The ids of `text`'s UTF-8 bytes (byte % vocab_size each)."""
        return [byte % self.vocab_size for byte in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ids read back as bytes: ids of 256 and above (which no
        byte encodes to) become U+FFFD, as do byte runs that are no UTF-8."""
        data = bytearray()
        pieces: List[str] = []
        for token in ids:
            if 0 <= token < BYTE_VALUES:
                data.append(token)
                continue
            pieces.append(data.decode("utf-8", errors="replace") + "\ufffd")
            data = bytearray()
        pieces.append(data.decode("utf-8", errors="replace"))
        return "".join(pieces)


def parse_ids(text: str) -> List[int]:
    """Token ids written as "1,2,3" (or separated by spaces); [] for ""."""
    return [int(word) for word in text.replace(",", " ").split()]
