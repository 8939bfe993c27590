"""`astraflow make-model`: a real Hugging Face model directory from config, no downloads.

Writes `config.json` (the family's real fields: GQA, rope theta, biases, tied or untied
embeddings, RMSNorm eps) + `model.safetensors` (random init, seeded) + a tokenizer trained
locally (`tokenizer.json`, `tokenizer_config.json` with the family's special tokens and chat
template) + `generation_config.json` (the family's eos list). Families and shapes:
`astraflow/models/families.py`.

Tokenizers: `bpe` is byte-level BPE (any text encodes) with `BPE_VOCAB` entries learned from
the task corpus plus generic English text (`generic_corpus`: the documentation of some of
Python's own standard library, which every machine has, so the vocabulary is a real one of
several thousand words and never depends on a download); `char` is one token per character
(printable ASCII plus the corpus), for digit tasks a tiny model learns far more easily over
characters.
"""
from __future__ import annotations

import importlib
import inspect
import json
import string
from pathlib import Path
from typing import Iterable

from astraflow.models.families import FAMILIES, Family

BPE_VOCAB = 4096
GENERIC_MODULES = ("argparse", "calendar", "collections", "csv", "datetime", "decimal", "email.message", "fractions",
                   "ftplib", "http.client", "imaplib", "json", "logging", "mailbox", "optparse", "pathlib", "pydoc",
                   "random", "shutil", "smtplib", "statistics", "string", "subprocess", "tarfile", "textwrap",
                   "threading", "turtle", "unittest", "urllib.request", "zipfile")


def generic_corpus() -> list[str]:
    """English prose of the standard library's documentation: module, class and function docstrings."""
    texts = []
    for name in GENERIC_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a Python built without it (turtle needs tkinter)
            continue
        texts.append(inspect.getdoc(module) or "")
        for _, obj in sorted(vars(module).items()):
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", "") == name:
                texts.append(inspect.getdoc(obj) or "")
    return [t for t in texts if t]


def _choices(name: str, value: str, valid: Iterable[str]) -> None:
    if value not in valid:
        raise ValueError(f"--{name} {value!r}: expected one of {sorted(valid)}")


def train_tokenizer(family: Family, kind: str, corpus: list[str]):
    """A `tokenizers.Tokenizer` of `kind` with the family's special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = list(family.specials)
    if kind == "char":
        unk = "<unk>" if "<unk>" in specials else specials[0]
        tok = Tokenizer(models.WordLevel(unk_token=unk))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        tok.decoder = decoders.Fuse()
        trainer = trainers.WordLevelTrainer(special_tokens=specials, min_frequency=1)
        tok.train_from_iterator([string.printable, *corpus], trainer)
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(family.split_pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, special_tokens=specials, min_frequency=1,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator([*generic_corpus(), *corpus], trainer)
    if family.bos is not None:  # the tokenizer adds it, as Llama's does; the chat template adds its own
        tok.post_processor = processors.TemplateProcessing(single=f"{family.bos} $A",
                                                           special_tokens=[(family.bos, tok.token_to_id(family.bos))])
    return tok


def make_model(like: str, size: str, out_dir: str | Path, seed: int = 0, corpus: list[str] | None = None,
               tokenizer: str = "", tied: bool | None = None) -> Path:
    """Build a directory imitating family `like` at `size`; `tokenizer` and `tied` override
    the family's defaults."""
    _choices("like", like, FAMILIES)
    family = FAMILIES[like]
    _choices("size", size, family.shapes)
    kind = tokenizer or family.tokenizer
    _choices("tokenizer", kind, ("bpe", "char"))
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(family, kind, list(corpus or []))
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in family.specials}
    _write_tokenizer_config(out, family, ids, kind)
    shape = family.shapes[size]
    tie = tied if tied is not None else shape.tied if shape.tied is not None else family.tied
    eos = [ids[t] for t in family.eos]
    bos = ids[family.bos] if family.bos else eos[-1]  # Qwen's config names <|endoftext|> though it never adds it
    pad = ids[family.pad] if family.pad else None
    config = AutoConfig.for_model(
        family.model_type, vocab_size=max(shape.vocab, tok.get_vocab_size()), hidden_size=shape.hidden,
        intermediate_size=shape.intermediate, num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, max_position_embeddings=family.max_positions, tie_word_embeddings=tie,
        bos_token_id=bos, eos_token_id=eos[0], pad_token_id=pad, torch_dtype="float32", **family.fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos if len(eos) > 1 else eos[0],
                                               pad_token_id=pad)
    model.save_pretrained(out, safe_serialization=True)
    return out


def _write_tokenizer_config(out: Path, family: Family, ids: dict[str, int], kind: str) -> None:
    config = {
        # a character tokenizer loads only as itself: transformers would put the family's
        # class in its place and rewrite its pre-tokenizer (spaces lost)
        "tokenizer_class": "PreTrainedTokenizerFast" if kind == "char" else family.tokenizer_class,
        "bos_token": family.bos, "eos_token": family.eos[0],
        "added_tokens_decoder": {str(i): {"content": t, "special": True, "normalized": False, "lstrip": False,
                                          "rstrip": False, "single_word": False} for t, i in ids.items()},
        "model_max_length": family.max_positions,
        "clean_up_tokenization_spaces": False,
    }
    if family.pad:
        config["pad_token"] = family.pad
    if "<unk>" in ids:
        config["unk_token"] = "<unk>"
    if family.chat_template:
        config["chat_template"] = family.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
