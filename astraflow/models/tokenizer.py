"""A character-level tokenizer trained locally with `tokenizers` (WordLevel over characters).

Why characters: the synthetic tasks are arithmetic, and a tiny model learns digit-by-digit
far more easily than over merged multi-digit tokens. The vocabulary is learned from a
corpus that always includes printable ASCII, so any ASCII prompt (JSONL sources) encodes.
AstraFlow loads `tokenizer.json` with the `tokenizers` library itself and hands engines
token ids, never text: transformers 5.x `AutoTokenizer` rewrites the pre-tokenizer of some
model types (qwen2) and would silently drop spaces.
"""
from __future__ import annotations

import string
from pathlib import Path
from typing import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = [PAD, BOS, EOS, UNK]


def train_char_tokenizer(corpus: Iterable[str]) -> Tokenizer:
    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIALS, min_frequency=1)
    tok.train_from_iterator([string.printable, *corpus], trainer)
    return tok


class TextCodec:
    """Prompt text <-> token ids, the way every AstraFlow component does it."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        self.tok = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
        self.pad_id = self.tok.token_to_id(PAD)
        self.bos_id = self.tok.token_to_id(BOS)
        self.eos_id = self.tok.token_to_id(EOS)
        self.vocab_size = self.tok.get_vocab_size()

    def encode_prompt(self, text: str) -> list[int]:
        return [self.bos_id, *self.tok.encode(text, add_special_tokens=False).ids]

    def encode_text(self, text: str) -> list[int]:
        """Ids of text inside a sequence (tool output, separators): no BOS, no EOS."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_completion(self, text: str) -> list[int]:
        return [*self.tok.encode(text, add_special_tokens=False).ids, self.eos_id]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([i for i in ids if i not in (self.pad_id, self.bos_id, self.eos_id)])
