"""Real model directories: the tokenizer contract (eos lists, no bos, pad falling back to eos,
chat templates), family fixtures from `make-model --like`, directories assembled by hand the
way checkpoints on a site's filesystem are, and directories that must be refused."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from astraflow.config.loader import ConfigError, parse_config
from astraflow.launch.inputs import check_inputs
from astraflow.models.directory import ModelDirError, check_model_dir
from astraflow.models.factory import make_model
from astraflow.models.families import LLAMA3_TEMPLATE, QWEN25_TEMPLATE
from astraflow.models.tokenizer import ModelTokenizer, TokenizerError

CORPUS = ["Anna has 12 pencils. She gives 5 to Tom. How many pencils does Anna have now? \\boxed{7}"] * 30


def hand_made(out, family: str):
    """A directory the way a downloaded checkpoint has it, written without make_model: a
    byte-level BPE whose special tokens sit at the END of the vocabulary (as in the real
    Qwen2.5 and Llama-3), the family's config class, its eos list and chat template."""
    out.mkdir(parents=True)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if family == "qwen2.5":
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        tok.add_special_tokens(specials)
        ids = {t: tok.token_to_id(t) for t in specials}
        gen = {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "pad_token_id": ids["<|endoftext|>"]}
        tcfg = {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                "bos_token": None, "chat_template": QWEN25_TEMPLATE}
        config = Qwen2Config(vocab_size=tok.get_vocab_size() + 5, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                             tie_word_embeddings=True, eos_token_id=ids["<|im_end|>"], rope_theta=1e6)
    else:
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
        tok.add_special_tokens(specials)
        ids = {t: tok.token_to_id(t) for t in specials}
        tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                           special_tokens=[("<|begin_of_text|>", ids["<|begin_of_text|>"])])
        gen = {"bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": [ids["<|end_of_text|>"], ids["<|eot_id|>"]]}
        tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                "eos_token": "<|end_of_text|>", "chat_template": LLAMA3_TEMPLATE}
        config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                             bos_token_id=ids["<|begin_of_text|>"], eos_token_id=ids["<|end_of_text|>"])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg))
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps(gen))  # after: save_pretrained writes its own
    return out, ids


@pytest.mark.parametrize("family", ["qwen2.5", "llama3"])
def test_special_tokens_come_from_the_directory(tmp_path, family):
    """eos is the generation config's list, bos only where the tokenizer has one, pad the
    tokenizer's or the first eos; a chat completion ends with the template's turn end."""
    out, ids = hand_made(tmp_path / family, family)
    tok = ModelTokenizer(out, chat=True)
    if family == "qwen2.5":
        assert tok.eos_ids == (ids["<|im_end|>"], ids["<|endoftext|>"]) and tok.bos_id is None
        assert tok.pad_id == ids["<|endoftext|>"] and tok.turn_end_id == ids["<|im_end|>"]
        assert tok.encode_prompt("2+2?")[:1] == tok.encode_text("<|im_start|>")  # no bos in front
    else:
        assert tok.eos_ids == (ids["<|end_of_text|>"], ids["<|eot_id|>"]) and tok.bos_id == ids["<|begin_of_text|>"]
        assert tok.pad_id == ids["<|end_of_text|>"]  # no pad token: the first eos
        assert tok.turn_end_id == ids["<|eot_id|>"] and tok.stop_ids == tok.eos_ids
        assert tok.encode_prompt("2+2?").count(ids["<|begin_of_text|>"]) == 1  # the template's, not twice
        assert tok.encode_text("x") and ids["<|begin_of_text|>"] not in tok.encode_text("x")
        assert ModelTokenizer(out).encode_prompt("2+2?")[0] == ids["<|begin_of_text|>"]  # plain: the tokenizer adds it
    assert tok.encode_completion("7")[-1] == tok.turn_end_id
    assert "What is 12 + 7?" in tok.decode(tok.encode_prompt("What is 12 + 7?"))
    plain = ModelTokenizer(out)
    assert plain.decode(plain.encode_prompt("What is 12 + 7?")) == "What is 12 + 7?"  # special tokens skipped


@pytest.mark.parametrize("like", ["qwen2.5", "llama3"])
def test_family_fixtures_carry_the_real_fields_and_round_trip_chat(tmp_path, like):
    out = make_model(like, "tiny", tmp_path / like, corpus=CORPUS)
    cfg = json.loads((out / "config.json").read_text())
    rope_theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]  # transformers 5 nests it
    info = check_model_dir(out)
    assert info.kv_heads < info.heads and info.head_dim == 32  # GQA, a head size vLLM's CPU kernels take
    if like == "qwen2.5":
        assert cfg["model_type"] == "qwen2" and rope_theta == 1e6 and cfg["tie_word_embeddings"] is True
    else:
        assert cfg["model_type"] == "llama" and rope_theta == 5e5 and cfg["tie_word_embeddings"] is False
        assert cfg["attention_bias"] is False
    gen = json.loads((out / "generation_config.json").read_text())
    tok = ModelTokenizer(out, chat=True, system_prompt="Answer in \\boxed{}.")
    assert list(tok.eos_ids) == gen["eos_token_id"] and len(tok.eos_ids) == 2
    messages = [{"role": "user", "content": CORPUS[0][:-10]}]
    ids = tok.encode_prompt("", messages)
    rendered = tok.hf.apply_chat_template([{"role": "system", "content": "Answer in \\boxed{}."}, *messages],
                                          tokenize=False, add_generation_prompt=True)
    assert tok.hf.decode(ids) == rendered  # the template's text, token for token
    # a multi-turn episode: completion, tool turn, next generation prompt == the template of all turns
    answer = tok.encode_completion("12 - 5 = 7")
    turns = tok.encode_turns([{"role": "user", "content": "Check it."}], completion_ended=True)
    whole = tok.hf.apply_chat_template([{"role": "system", "content": "Answer in \\boxed{}."}, *messages,
                                        {"role": "assistant", "content": "12 - 5 = 7"},
                                        {"role": "user", "content": "Check it."}], tokenize=False,
                                       add_generation_prompt=True)
    assert tok.hf.decode(ids + answer + turns) == whole


def test_a_bpe_fixture_has_a_real_vocabulary_and_a_char_one_keeps_spaces(tmp_path):
    bpe = ModelTokenizer(make_model("qwen2.5", "tiny", tmp_path / "bpe", corpus=CORPUS))
    assert len(bpe.encode_text(CORPUS[0])) < len(CORPUS[0]) / 2  # merged words
    char = ModelTokenizer(make_model("qwen2.5", "tiny", tmp_path / "char", corpus=CORPUS, tokenizer="char"), chat=True)
    text = "Anna  has 12\tpencils."
    assert char.decode(char.encode_text(text)) == text and len(char.encode_text(text)) == len(text)


def test_missing_and_unloadable_directories_are_refused(tmp_path):
    good = make_model("qwen2.5", "tiny", tmp_path / "good", corpus=CORPUS)
    with pytest.raises(ModelDirError, match=r"does not exist"):
        check_model_dir(tmp_path / "nowhere")
    bad = shutil.copytree(good, tmp_path / "no-tok")
    (bad / "tokenizer.json").unlink()
    with pytest.raises(ModelDirError, match=r"no tokenizer"):
        check_model_dir(bad)
    gpt2 = shutil.copytree(good, tmp_path / "gpt2")
    cfg = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelDirError, match=r"architecture \['GPT2LMHeadModel'\] is not supported"):
        check_model_dir(gpt2)
    # a run is refused before anything starts, and nothing is built in place of a missing model
    with pytest.raises(ConfigError, match=r"model.path: model directory .*nowhere: does not exist"):
        check_inputs(parse_config(f"model: {{path: {tmp_path / 'nowhere'}}}\npolicies: [{{name: policy}}]"))
    assert not (tmp_path / "nowhere").exists()
    plain = make_model("qwen2", "tiny", tmp_path / "plain", corpus=CORPUS)
    with pytest.raises(TokenizerError, match="has none"):
        ModelTokenizer(plain, chat=True)
    with pytest.raises(ConfigError, match=r"tasks.chat_template: prompts go through a chat template, but the model"):
        check_inputs(parse_config(f"model: {{path: {plain}}}\ntasks: {{chat_template: true}}\npolicies: [{{name: policy}}]"))


def test_published_tied_weights_reload_into_the_hf_engine(tmp_path):
    """Publication writes a tied weight once; the engine's lm_head is the new embedding."""
    from astraflow.weights.publisher import Publisher
    from tests.conftest import hf_engine

    out = make_model("qwen2.5", "tiny", tmp_path / "m", corpus=CORPUS)
    engine = hf_engine(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(0.5)
    Publisher(tmp_path / "w", "policy", out).publish(model.state_dict(), 1)
    engine.install(engine.read_weights(tmp_path / "w" / "policy" / "v1"))
    assert torch.equal(engine.model.lm_head.weight, model.model.embed_tokens.weight)
