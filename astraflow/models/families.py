"""Model families that `astraflow make-model` can imitate: each one's real config fields,
special tokens, chat template and eos list, and the shapes it is built in.

A family fixture is an ordinary Hugging Face directory that nothing in AstraFlow treats
specially: the same code serves a checkpoint of that family from a site's filesystem.

- `qwen2.5`: Qwen2 architecture (bias on q/k/v, GQA, RMSNorm eps 1e-6, rope theta 1e6), no
  bos token, `<|im_start|>`/`<|im_end|>` chat template with its default system prompt,
  generation stops on `<|im_end|>` or `<|endoftext|>`, embeddings tied up to 3B (untied at 7B).
- `llama3`: Llama architecture (no biases, GQA, eps 1e-5, rope theta 5e5), a
  `<|begin_of_text|>` bos added by the tokenizer, the Llama-3 Instruct header template,
  stops on `<|end_of_text|>` or `<|eot_id|>`, untied (8B) — Llama-3.2-1B/3B are tied: build
  with `tied=True` for those.
- `qwen2`, `llama`: the plain tiny fixtures of the arithmetic quickstart (untied, full
  attention heads), with a character-level tokenizer and no chat template.

Shapes: `tiny` and `small` run on a CPU in tests; `0.5b` and `1.5b` (Qwen2.5) and `1b`
(Llama-3.2) are the real shapes, vocabulary size included, for GPU checks.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int = 0  # 0: the tokenizer's size; else the config's vocab_size (the real family's)
    tied: bool | None = None  # None: the family's default


@dataclass(frozen=True)
class Family:
    name: str
    model_type: str
    architecture: str
    tokenizer: str  # "bpe" or "char": what make-model trains by default
    tokenizer_class: str  # what tokenizer_config.json declares (as the real family's does)
    specials: tuple[str, ...]
    bos: str | None
    eos: tuple[str, ...]  # generation_config.json's eos_token_id, in order
    pad: str | None  # None: no pad token (Llama-3 has none; padding falls back to eos)
    tied: bool
    shapes: dict[str, Shape]
    fields: dict = field(default_factory=dict)  # further config.json fields of the family
    chat_template: str = ""
    max_positions: int = 512
    split_pattern: str = ""  # the pre-tokenizer's regex (words, digits, punctuation) before byte-level BPE


QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

QWEN25_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                   "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                   "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
                   "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                   "<|repo_name|>", "<|file_sep|>")
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>")
CHAR_SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
# The real families' pre-tokenizer patterns: Qwen2 splits every digit, Llama-3 groups up to three
_WORDS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2_SPLIT = _WORDS + r"\p{N}" + _REST
LLAMA3_SPLIT = _WORDS + r"\p{N}{1,3}" + _REST

TEST_SHAPES = {
    "tiny": Shape(hidden=64, intermediate=192, layers=2, heads=2, kv_heads=1),
    "small": Shape(hidden=256, intermediate=768, layers=4, heads=8, kv_heads=2),
}
PLAIN_SHAPES = {  # the quickstart's fixtures: full attention heads
    "tiny": Shape(hidden=64, intermediate=256, layers=2, heads=2, kv_heads=2),
    "small": Shape(hidden=256, intermediate=1024, layers=4, heads=4, kv_heads=2),
}

FAMILIES: dict[str, Family] = {
    "qwen2.5": Family(
        "qwen2.5", "qwen2", "Qwen2ForCausalLM", "bpe", "Qwen2Tokenizer", QWEN25_SPECIALS, bos=None,
        eos=("<|im_end|>", "<|endoftext|>"), pad="<|endoftext|>", tied=True,
        shapes={**TEST_SHAPES,
                "0.5b": Shape(hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2, vocab=151936),
                "1.5b": Shape(hidden=1536, intermediate=8960, layers=28, heads=12, kv_heads=2, vocab=151936)},
        fields={"rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "use_sliding_window": False, "hidden_act": "silu"},
        chat_template=QWEN25_TEMPLATE, max_positions=32768, split_pattern=QWEN2_SPLIT),
    "llama3": Family(
        "llama3", "llama", "LlamaForCausalLM", "bpe", "PreTrainedTokenizerFast", LLAMA3_SPECIALS,
        bos="<|begin_of_text|>", eos=("<|end_of_text|>", "<|eot_id|>"), pad=None, tied=False,
        shapes={**TEST_SHAPES,
                "1b": Shape(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, vocab=128256, tied=True)},
        fields={"rope_theta": 500000.0, "rms_norm_eps": 1e-5, "attention_bias": False, "mlp_bias": False,
                "hidden_act": "silu"},
        chat_template=LLAMA3_TEMPLATE, max_positions=8192, split_pattern=LLAMA3_SPLIT),
    "qwen2": Family("qwen2", "qwen2", "Qwen2ForCausalLM", "char", "PreTrainedTokenizerFast", CHAR_SPECIALS,
                    bos="<bos>", eos=("<eos>",), pad="<pad>", tied=False, shapes=PLAIN_SHAPES),
    "llama": Family("llama", "llama", "LlamaForCausalLM", "char", "PreTrainedTokenizerFast", CHAR_SPECIALS,
                    bos="<bos>", eos=("<eos>",), pad="<pad>", tied=False, shapes=PLAIN_SHAPES),
}
