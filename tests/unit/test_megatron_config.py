"""The trainer's parallel layout is checked before anything starts, each error naming the
field and the numbers: world = tp x pp x dp (the config alone), tp dividing the model's
attention and kv heads and pp its layers (with the model: `launch/inputs.py`), the torch
backend data parallel only, a model directory the megatron backend cannot carry. The
backend is chosen from an explicit table."""
from __future__ import annotations

import json

import pytest

from astraflow.config.loader import ConfigError, parse_config
from astraflow.launch.inputs import check_inputs
from astraflow.models.factory import make_model
from astraflow.trainer.loop import BACKENDS


def config(trainer: str, model: str = "{like: qwen2.5, size: small}"):
    return parse_config(f"model: {model}\ntrainer: {trainer}\npolicies: [{{name: policy}}]")


@pytest.mark.parametrize("trainer, match", [
    ("{backend: megatron, world: 4, tp: 2, dp: 3}",
     r"trainer\.dp: tp x pp x dp = 2 x 1 x 3 = 6 ranks, but trainer\.world is 4"),
    ("{backend: megatron, world: 3, tp: 2}",
     r"trainer\.world: 3 ranks do not make whole model replicas of tp x pp = 2 x 1 = 2 ranks"),
    ("{backend: torch, world: 2, tp: 2}", r"trainer\.tp: 2, but the torch backend is data parallel only"),
    ("{backend: megatron, tp: 0}", r"trainer\.tp: expected >= 1, got 0"),
    ("{backend: megatron, dp: -1}", r"trainer\.dp: expected >= 0, got -1"),
    ("{backend: torch, world: 2, distributed_optimizer: true}",
     r"trainer\.distributed_optimizer: true needs trainer\.backend megatron"),
    ("{backend: megatron, sequence_parallel: true}",
     r"trainer\.sequence_parallel: true .* needs trainer\.backend megatron and trainer\.tp > 1 \(backend megatron, tp 1\)"),
])
def test_a_world_that_is_not_tp_pp_dp_is_refused_by_the_config(trainer, match):
    with pytest.raises(ConfigError, match=match):
        config(trainer)


@pytest.mark.parametrize("trainer, match", [
    ("{backend: megatron, world: 4, tp: 4}",
     r"trainer\.tp: 4 does not divide the model's 8 attention heads and 2 kv heads \(model\.like qwen2\.5 at size small\)"),
    ("{backend: megatron, world: 3, pp: 3, batch_size: 63}", r"trainer\.pp: 3 does not divide the model's 4 layers"),
])
def test_tp_and_pp_must_divide_the_model(trainer, match):
    with pytest.raises(ConfigError, match=match):
        check_inputs(config(trainer))


def test_a_model_directory_the_megatron_backend_cannot_carry_is_refused(tmp_path):
    model = make_model("qwen2.5", "tiny", tmp_path / "m", tokenizer="char")
    cfg_path = model / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "architectures": ["Qwen3ForCausalLM"]}))
    check_inputs(config("{backend: torch}", f"{{path: {model}}}"))  # the torch backend loads it
    with pytest.raises(ConfigError, match=r"model\.path: .*architectures \['Qwen3ForCausalLM'\]: the megatron backend"):
        check_inputs(config("{backend: megatron}", f"{{path: {model}}}"))


def test_data_and_tensor_parallel_megatron_and_the_backends_table():
    check_inputs(config("{backend: megatron, world: 2, dp: 2}"))
    check_inputs(config("{backend: megatron, world: 4, tp: 2, batch_size: 2}"))  # 2 replicas of 1 sample
    check_inputs(config("{backend: megatron, world: 4, tp: 2, pp: 2}"))  # 2 stages of the 4 layers
    # trainer.world unset: the ranks the layout needs
    assert [config(t).trainer.world for t in ("{}", "{backend: megatron, tp: 2}", "{backend: megatron, tp: 2, dp: 4}")] \
        == [1, 2, 8]
    assert sorted(BACKENDS) == ["megatron", "torch"]
    with pytest.raises(ConfigError, match=r"trainer\.backend: 'jax' is not one of \['torch', 'megatron'\]"):
        config("{backend: jax}")
