"""The tokenizer contract: text and chat messages <-> token ids, from a Hugging Face model directory.

Every component that turns text into ids (rollout workflows, the warm-up, the evaluation)
goes through `ModelTokenizer`; the trainer and the engines see token ids only.

Special tokens come from the directory, never from names this project chose:
- `eos_ids`: `generation_config.json`'s `eos_token_id` (an int or a list: Qwen2.5-Instruct
  lists `<|im_end|>` and `<|endoftext|>`), then the tokenizer's own eos token;
- `pad_id`: the tokenizer's pad token, else generation_config's, else the first eos;
- `bos_id`: the tokenizer's bos token, or None (Qwen has none). Whether a prompt starts with
  it is the tokenizer's own business (its post-processor, or the chat template).
- with a chat template, `turn_end_id` is the token that closes an assistant turn in that
  template (`<|im_end|>`, `<|eot_id|>`), found by rendering one exchange.

Generation stops on any of `stop_ids` (the eos ids, plus the turn end when prompts go
through the chat template); a completion the project writes itself (a warm-up target, a
reference answer) ends with `stop_id`.

Prompts are plain text, or chat `messages` rendered with `apply_chat_template(...,
add_generation_prompt=True)` — when `chat` is set or the task holds messages, with the
config's system prompt in front when the messages have none. Multi-turn workflows add
turns after a completion with `encode_turns`: the template's text for those turns, so a
whole episode is token for token what the template renders for its messages.

Loading: `AutoTokenizer`, except that a directory whose `tokenizer_config.json` names
`PreTrainedTokenizerFast` is loaded with exactly that class: transformers 5.x otherwise swaps
in the model type's own tokenizer class (Qwen2Tokenizer for qwen2) and rewrites the
pre-tokenizer, and a character-level tokenizer silently loses its spaces.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Sequence

Message = dict[str, str]


class TokenizerError(ValueError):
    """A model directory whose tokenizer cannot serve (no eos token, no chat template, ...)."""


def load_hf_tokenizer(model_dir: str | Path) -> Any:
    """The directory's tokenizer as transformers loads it (see the module docstring)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    model_dir = Path(model_dir)
    config_file = model_dir / "tokenizer_config.json"
    declared = json.loads(config_file.read_text()).get("tokenizer_class") if config_file.exists() else None
    loader = PreTrainedTokenizerFast if declared == "PreTrainedTokenizerFast" else AutoTokenizer
    return loader.from_pretrained(str(model_dir))


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _unique(ids: Iterable[int]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(ids))


class ModelTokenizer:
    """Text <-> ids for one model directory, as every AstraFlow component does it."""

    def __init__(self, model_dir: str | Path, chat: bool = False, system_prompt: str = "") -> None:
        self.model_dir = Path(model_dir)
        self.hf = load_hf_tokenizer(self.model_dir)
        gen_file = self.model_dir / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.exists() else {}
        self.eos_ids = _unique([*_ids(gen.get("eos_token_id")), *_ids(self.hf.eos_token_id)])
        if not self.eos_ids:
            raise TokenizerError(f"{self.model_dir}: no end-of-sequence token (neither generation_config.json's "
                                 f"eos_token_id nor the tokenizer's eos_token)")
        pad = self.hf.pad_token_id
        pad = pad if pad is not None else gen.get("pad_token_id")
        self.pad_id = int(pad) if pad is not None else self.eos_ids[0]
        self.bos_id: int | None = self.hf.bos_token_id
        self.vocab_size = len(self.hf)
        self.chat, self.system_prompt = chat, system_prompt
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))
        if chat and not self.has_chat_template:
            raise TokenizerError(f"{self.model_dir}: prompts are to go through a chat template "
                                 f"(tasks.chat_template), but the tokenizer has none")
        self.turn_end_id, self._turn_trailer = self._turn_end() if self.has_chat_template else (None, "")
        self.stop_ids = _unique([*self.eos_ids, *([self.turn_end_id] if chat and self.turn_end_id is not None else [])])

    @property
    def stop_id(self) -> int:
        """What ends a completion this project writes (a warm-up target, a reference answer)."""
        return self.turn_end_id if self.chat and self.turn_end_id is not None else self.eos_ids[0]

    # ------------------------------------------------------------ prompts
    def encode_prompt(self, prompt: str, messages: Sequence[Message] | None = None) -> list[int]:
        """The ids a completion follows: chat messages through the template (also a plain
        prompt when `chat` is set), else the tokenizer's own encoding of the text."""
        if messages or self.chat:
            return self.encode_chat(list(messages) if messages else [{"role": "user", "content": prompt}])
        return self.hf(prompt, add_special_tokens=True)["input_ids"]

    def encode_chat(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        if not self.has_chat_template:
            raise TokenizerError(f"{self.model_dir}: a task holds chat messages, but the tokenizer has no chat template")
        if self.system_prompt and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def encode_turns(self, messages: list[Message], completion_ended: bool) -> list[int]:
        """Ids of further turns (a tool's output, an environment's observation, each a message)
        after an assistant completion, up to the next assistant turn's start; plain text
        without a chat template. `completion_ended`: the completion ended with a stop token
        (else the template's turn end is added first)."""
        if not (self.chat and self.has_chat_template):
            return self.encode_text("".join(m["content"] for m in messages))
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
        before = self.hf.apply_chat_template(base, tokenize=False)
        after = self.hf.apply_chat_template(base + messages, tokenize=False, add_generation_prompt=True)
        if not after.startswith(before):
            raise TokenizerError(f"{self.model_dir}: the chat template renders earlier turns differently once more "
                                 f"are added; multi-turn episodes cannot be built from it")
        closing = "" if completion_ended else self.hf.convert_ids_to_tokens(self.turn_end_id)
        return self.encode_text(closing + self._turn_trailer + after[len(before):])

    def _turn_end(self) -> tuple[int | None, str]:
        """The token that closes an assistant turn in the template, and the text after it."""
        marker = "\u2063answer\u2063"
        text = self.hf.apply_chat_template([{"role": "user", "content": "u"}, {"role": "assistant", "content": marker}],
                                           tokenize=False)
        tail = text[text.rindex(marker) + len(marker):]
        for token in self.hf(tail, add_special_tokens=False)["input_ids"]:
            if token in self.hf.all_special_ids or token in self.eos_ids:
                piece = self.hf.convert_ids_to_tokens(token)
                return token, tail[tail.index(piece) + len(piece):]
        return None, ""

    # ------------------------------------------------------------ text
    def encode_text(self, text: str) -> list[int]:
        """Ids of text inside a sequence (tool output, separators): no special tokens added."""
        return self.hf(text, add_special_tokens=False)["input_ids"] if text else []

    def encode_completion(self, text: str) -> list[int]:
        return [*self.encode_text(text), self.stop_id]

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=True)
