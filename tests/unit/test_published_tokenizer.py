"""A published weights version is a model directory a user loads with plain transformers:
its tokenizer reports the base model's eos, pad and chat template (without
tokenizer_config.json, AutoTokenizer fell back to defaults and reported the wrong eos)."""
from __future__ import annotations

from astraflow.models.factory import make_model
from astraflow.models.tokenizer import load_hf_tokenizer
from astraflow.weights.fs import path_of
from astraflow.weights.publisher import Publisher

CORPUS = ["Anna has 12 pencils. She gives 5 to Tom. How many pencils does Anna have now? \\boxed{7}"] * 30


def test_published_weights_carry_the_tokenizer(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = make_model("qwen2.5", "tiny", tmp_path / "base", corpus=CORPUS)
    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    published = path_of(Publisher(tmp_path / "weights", "policy", base).publish(model.state_dict(), 3).uri)
    want, got = load_hf_tokenizer(base), AutoTokenizer.from_pretrained(str(published))
    assert got.eos_token == want.eos_token and got.eos_token_id == want.eos_token_id
    assert got.pad_token == want.pad_token and got.chat_template == want.chat_template
