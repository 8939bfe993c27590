"""The megatron trainer backend against the HF model it was loaded from, in real processes
(tensor or pipeline parallelism: two ranks over gloo; with both, or with data parallelism,
four): logprobs equal an HF forward pass (fp32, max |diff| <= 1e-5) at tp = 1, tp = 2,
tp = 2 x dp = 2, pp = 2 and tp = 2 x pp = 2 with sequence parallelism (at pp = 2 through
megatron's pipeline schedule, forward only; the rows' odd lengths padded for the sequence
split), the model gathered back to HF layout is bit-exact (tied embeddings split over two
stages included), and one training step (micro-batches, the KL term, gradient clipping)
gives the loss, statistics, clipped gradients and updated weights of the torch backend on
the same batch, with the optimizer whole or sharded over two replicas (with dp = 2 each
replica trains on its half of the batch, as the dataflow rank deals it, and the statistics
are those of the halves together). (The step is one optimizer step; the proximal policy of
later minibatches is the shared `trainer/step.py` scoring through the same `scores` compared
above.) The trained model is checkpointed (a collective: one file per tensor-parallel rank,
stage and optimizer shard in `step-<N>/`), moved by another step, and loaded back bit for
bit; saved at tp = 2 it loads into tp = 2 x dp = 2 with a sharded optimizer and into pp = 2
(resharded), bit for bit.

Updated weights agree within 1e-5 wherever the gradient is above 1e-7: AdamW's first
update is lr * g / (|g| + 1e-8), so where |g| is near its eps, fp32 noise in g (the two
backends sum in different orders) moves the update itself; there the bound is lr / 10.

Every backend runs in a process of its own: megatron's parallel state and torch.distributed
are process-global, and the test process keeps neither. The processes fork from a forkserver
that has imported megatron-core, transformers and this module once (`start_ranks`): a
spawned rank spent ~12 s of CPU importing them, and this file starts 52 ranks."""
from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from astraflow.config.loader import parse_config
from astraflow.models.factory import make_model
from astraflow.protocol import messages as m
from astraflow.trainer.batch import TokenBatch
from astraflow.trainer.torch_backend import TorchBackend
from tests.unit.test_trainer_memory import served_batch

TEMPERATURE = 0.7
CONFIG = """
policies: [{{name: policy}}]
engine: {{temperature: {temperature}}}
trainer: {{backend: {backend}, tp: {tp}, pp: {pp}, world: {world}, distributed_optimizer: {sharded}, lr: {lr},
           sequence_parallel: {sp},
           ref_kl: 0.1, max_tokens_per_microbatch: 120,
           logprob_chunk_tokens: 7}}
"""
LR = 1e-3
RANK_TIMEOUT_S = 240


def config(backend: str, tp: int = 1, world: int = 1, pp: int = 1, sharded: bool = False, sp: bool = False):
    return parse_config(CONFIG.format(temperature=TEMPERATURE, backend=backend, tp=tp, pp=pp, world=world, lr=LR,
                                      sharded=str(sharded).lower(), sp=str(sp).lower()))


def masters(backend) -> dict[str, torch.Tensor]:
    """The fp32 master weights this rank's optimizer shard owns, by parameter name."""
    return {k: v["master"] for k, v in backend.optim.state().items()}


def score_rows(vocab: int) -> TokenBatch:
    g = torch.Generator().manual_seed(1)
    return TokenBatch.of_rows([torch.randint(0, vocab, (n,), generator=g).tolist() for n in (9, 17, 4, 12)])


def share(reply: m.BatchReply, rank: int, world: int) -> m.BatchReply:
    """A data-parallel rank's rows of a served batch, as the dataflow rank deals them (rank::world)."""
    rows = list(range(rank, len(reply.sample_ids), world))
    return dataclasses.replace(
        reply, trajectories=m.TrajectoryBatch.gather([(reply.trajectories, i) for i in rows]),
        sample_ids=reply.sample_ids[rows], task_ids=reply.task_ids[rows], advantages=reply.advantages[rows],
        group_mean=reply.group_mean[rows], group_std=reply.group_std[rows])


def rank_main(rank: int, world: int, tp: int, pp: int, options: dict, store: str, model_dir: str, out: str) -> None:
    """One rank: score, gather to HF layout, train one step on its replica's rows, gather again;
    rank 0 saves it all, with every rank's statistics."""
    import torch.distributed as dist

    from astraflow.trainer.megatron.backend import MegatronBackend

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    backend = MegatronBackend(Path(model_dir), config("megatron", tp, world, pp, **options), "policy", rank, world)
    result = {"logp": backend.score(score_rows(backend.spec.vocab)), "hf": backend.hf_state_dict(),
              "sequence_parallel": backend.model.config.sequence_parallel}
    served = share(served_batch(backend.spec.vocab), backend.data_rank, backend.data_world)
    stats = (backend.data_rank, backend.train_step(served, 4, LR))
    result["stats"] = [None] * world
    if world > 1:
        dist.all_gather_object(result["stats"], stats)
    else:
        result["stats"] = [stats]
    result["after"] = backend.hf_state_dict()
    if not options.get("sharded"):
        result["exp_avg"] = first_moment(backend)
    result["grad"] = backend.gather_hf({k: p.grad for k, p in backend.model.named_parameters()})
    ckpt = backend.save(Path(out).parent / "checkpoints", 4)
    backend.train_step(served, 5, LR)  # moves the weights away from the checkpoint
    result["loaded_step"] = backend.load(ckpt)
    result["reloaded"] = backend.hf_state_dict()
    result["files"] = sorted(p.name for p in ckpt.iterdir())
    if rank == 0:
        torch.save(result, out)


def start_ranks(target, world: int, *args: object) -> None:
    """`target(rank, world, *args)` in `world` new processes; every one must exit 0. They fork
    from a server that imported the heavy modules once: forked before any of them ran a torch
    op, a rank holds no thread pool, process group or megatron state."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, "astraflow.trainer.megatron.backend"])
    procs = [ctx.Process(target=target, args=(r, world, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(RANK_TIMEOUT_S)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0] * world


def run_ranks(tmp_path: Path, model_dir: Path, tp: int, dp: int, pp: int = 1, **options: bool) -> dict:
    """Every rank of a tp x pp x dp group (`options`: `config`'s sharded, sp); rank 0's result."""
    out = tmp_path / f"tp{tp}-pp{pp}-dp{dp}.pt"
    start_ranks(rank_main, tp * pp * dp, tp, pp, options, str(tmp_path / f"store-{tp}-{pp}-{dp}"), str(model_dir), str(out))
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module", params=["qwen2.5", "llama3"])
def model_dir(request, tmp_path_factory):
    """Small shapes (8 heads, 2 kv heads: tp = 2 splits both). Qwen2.5: q/k/v biases, tied
    embeddings and, with one more character, an odd vocabulary (padded at tp = 2); Llama-3:
    no biases, untied."""
    corpus = ["é"] if request.param == "qwen2.5" else []
    return make_model(request.param, "small", tmp_path_factory.mktemp(request.param) / "model", tokenizer="char",
                      corpus=corpus)


@pytest.fixture(scope="module")
def torch_reference(model_dir):
    """HF forward logprobs, the HF weights, and one torch-backend step on the same batch."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    vocab = hf.config.vocab_size
    batch = score_rows(vocab)
    with torch.no_grad():
        logits = hf(batch.input_ids).logits[:, :-1].float() / TEMPERATURE
    logp = torch.log_softmax(logits, -1).reshape(-1, vocab)[batch.positions].gather(-1, batch.targets[:, None])[:, 0]
    weights = {k: v.clone() for k, v in hf.state_dict().items()}
    backend = TorchBackend(model_dir, config("torch"), "policy", 0, 1)
    stats = backend.train_step(served_batch(vocab), 4, LR)
    grad = {k: p.grad for k, p in backend.model.named_parameters()}
    return {"vocab": vocab, "logp": logp, "hf": weights, "stats": stats, "after": backend.model.state_dict(),
            "grad": grad}


def token_mean(stats: list[dict], key: str) -> float:
    """A statistic of the data-parallel ranks' shares together: weighted by their trained tokens
    (`completion_len` is a share's trained tokens per row; each share has the same rows here)."""
    return sum(s[key] * s["completion_len"] for s in stats) / sum(s["completion_len"] for s in stats)


@pytest.mark.parametrize("tp, pp, dp, sharded, sp", [(1, 1, 1, False, False), (2, 1, 1, False, False),
                                                      (2, 1, 2, False, False), (1, 1, 2, True, False),
                                                      (1, 2, 1, False, False), (2, 2, 1, False, True)])
def test_megatron_matches_hf_and_the_torch_backend(model_dir, torch_reference, tmp_path, tp, pp, dp, sharded, sp):
    got = run_ranks(tmp_path, model_dir, tp, dp, pp, sharded=sharded, sp=sp)
    ref = torch_reference
    assert got["sequence_parallel"] == sp
    assert (got["logp"] - ref["logp"]).abs().max().item() <= 1e-5
    # HF -> Megatron (tp ranks) -> HF: every tensor bit for bit
    assert sorted(got["hf"]) == sorted(ref["hf"])
    unequal = [k for k in ref["hf"] if not torch.equal(got["hf"][k], ref["hf"][k])]
    assert unequal == []
    # one step: the same loss, statistics and updated weights
    # (the members of a replica agree; the replicas' shares together are the batch)
    replicas = [dict(got["stats"])[d] for d in range(dp)]
    assert all(stats == replicas[d] for d, stats in got["stats"])
    for key in ("loss", "entropy", "kl_ref", "clip_frac", "is_weight"):
        assert token_mean(replicas, key) == pytest.approx(ref["stats"][key], abs=1e-5, rel=1e-5), key
    assert replicas[0]["grad_norm"] == pytest.approx(ref["stats"]["grad_norm"], abs=1e-5, rel=1e-5)
    grad = max((got["grad"][k] - g).abs().max().item() for k, g in ref["grad"].items())
    assert grad <= 1e-6
    moved = max((got["after"][k] - ref["hf"][k]).abs().max().item() for k in ref["hf"])
    assert moved > LR / 2  # the step changed the weights, so the comparison below means something
    diff = {k: (got["after"][k] - ref["after"][k]).abs() for k in ref["grad"]}
    above_eps = max((d * (ref["grad"][k].abs() > 1e-7)).max().item() for k, d in diff.items())
    anywhere = max(d.max().item() for d in diff.values())
    assert above_eps <= 1e-5 and anywhere <= LR / 10, json.dumps({"above_eps": above_eps, "anywhere": anywhere})
    # the checkpoint: a file per tensor-parallel rank, loaded back bit for bit
    shards = dp if sharded else 1  # the distributed optimizer: a file per replica's shard
    assert got["loaded_step"] == 4 and got["files"] == sorted(f"tp{t}-pp{p}-dp{d}.pt" for t in range(tp)
                                                              for p in range(pp) for d in range(shards))
    assert [k for k in got["after"] if not torch.equal(got["reloaded"][k], got["after"][k])] == []


def load_main(rank: int, world: int, tp: int, pp: int, sharded: bool, store: str, model_dir: str, ckpt: str,
              out: str) -> None:
    """One rank of a group of another layout: load a checkpoint, gather it (and, unsharded,
    AdamW's first moment) to HF layout, and take one step (every replica must then hold the
    same model)."""
    import torch.distributed as dist

    from astraflow.trainer.megatron.backend import MegatronBackend

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    backend = MegatronBackend(Path(model_dir), config("megatron", tp, world, pp, sharded), "policy", rank, world)
    step = backend.load(Path(ckpt))
    result = {"step": step, "loaded": backend.hf_state_dict()}
    if not sharded:
        result["exp_avg"] = first_moment(backend)
    served = share(served_batch(backend.spec.vocab, seed=3), backend.data_rank, backend.data_world)
    backend.train_step(served, step + 1, LR)
    result["stepped"] = [None] * world
    dist.all_gather_object(result["stepped"], backend.hf_state_dict())
    if rank == 0:
        torch.save(result, out)


def first_moment(backend) -> dict[str, torch.Tensor]:
    """AdamW's first moment of every parameter, in HF layout (a collective; optimizer unsharded)."""
    return backend.gather_hf({k: v["adam"]["exp_avg"] for k, v in backend.optim.state().items()})


@pytest.mark.parametrize("tp, pp, dp, sharded", [(2, 1, 2, True), (1, 2, 1, False)])
def test_a_checkpoint_resumes_at_another_layout(model_dir, tmp_path, tp, pp, dp, sharded):
    """Saved by one replica of tp = 2, loaded by two (tp = 2 x dp = 2) whose optimizer is
    sharded over them, or by two pipeline stages (pp = 2: the checkpoint cut again,
    `reshard.py`): every rank holds the saved model (and, resharded, AdamW's moments) bit for
    bit, and after a step the replicas still agree (each parameter stepped by its owner from
    the saved state, then broadcast)."""
    saved = run_ranks(tmp_path, model_dir, tp=2, dp=1)
    out = tmp_path / "resumed.pt"
    start_ranks(load_main, tp * pp * dp, tp, pp, sharded, str(tmp_path / "store-resume"), str(model_dir),
          str(tmp_path / "checkpoints" / "step-4"), str(out))
    got = torch.load(out, weights_only=False)
    assert got["step"] == 4
    assert [k for k in saved["after"] if not torch.equal(got["loaded"][k], saved["after"][k])] == []
    if not sharded:
        assert sorted(got["exp_avg"]) == sorted(saved["exp_avg"])
        assert [k for k in saved["exp_avg"] if not torch.equal(got["exp_avg"][k], saved["exp_avg"][k])] == []
    first = got["stepped"][0]
    assert max((first[k] - saved["after"][k]).abs().max().item() for k in first) > LR / 2  # it stepped
    for other in got["stepped"][1:]:
        assert [k for k in first if not torch.equal(other[k], first[k])] == []


def bf16_main(rank: int, world: int, model_dir: str, out: str) -> None:
    """A group of one (`rank` 0 of `world` 1) in bf16 with Megatron's full recompute: score, two steps, a checkpoint
    saved, a third step, the checkpoint loaded back."""
    from astraflow.trainer.megatron.backend import MegatronBackend

    torch.set_num_threads(1)
    cfg = config("megatron")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="bfloat16"),
                              trainer=dataclasses.replace(cfg.trainer, activation_checkpointing=True))
    backend = MegatronBackend(Path(model_dir), cfg, "policy", 0, 1)
    params = dict(backend.model.named_parameters())
    result = {"dtypes": {p.dtype for p in params.values()}, "logp": backend.score(score_rows(backend.spec.vocab)),
              "masters_before": masters(backend)}
    result["stats"] = backend.train_step(served_batch(backend.spec.vocab), 4, LR)
    backend.train_step(served_batch(backend.spec.vocab, seed=1), 5, LR)
    result["masters"] = masters(backend)
    result["params"] = {k: p.detach().clone() for k, p in params.items()}
    ckpt = backend.save(Path(out).parent / "checkpoints", 5)
    backend.train_step(served_batch(backend.spec.vocab, seed=2), 6, LR)
    backend.load(ckpt)
    result["reloaded"] = masters(backend)
    result["reloaded_params"] = {k: p.detach().clone() for k, p in params.items()}
    torch.save(result, out)


def test_megatron_in_bf16_trains_bf16_parameters_from_fp32_masters(model_dir, torch_reference, tmp_path):
    """bf16 parameters (as Megatron runs them: its recompute re-runs layers outside autocast)
    stepped through fp32 masters: the masters move by less than a bf16 ulp can show, the
    parameters are the masters rounded, and a checkpoint keeps the masters bit for bit."""
    start_ranks(bf16_main, 1, str(model_dir), str(tmp_path / "bf16.pt"))
    got = torch.load(tmp_path / "bf16.pt", weights_only=False)
    assert got["dtypes"] == {torch.bfloat16}
    assert (got["logp"] - torch_reference["logp"]).abs().max().item() < 0.05  # bf16 against the fp32 HF pass
    assert got["stats"]["loss"] == pytest.approx(torch_reference["stats"]["loss"], abs=1e-3)
    assert got["stats"]["grad_norm"] == pytest.approx(torch_reference["stats"]["grad_norm"], rel=0.05)
    masters, before = got["masters"], got["masters_before"]
    assert all(v.dtype == torch.float32 for v in masters.values())
    assert max((masters[k] - before[k]).abs().max().item() for k in masters) > LR / 2
    assert [k for k, p in got["params"].items() if not torch.equal(p, masters[k].to(torch.bfloat16))] == []
    assert [k for k in masters if not torch.equal(got["reloaded"][k], masters[k])] == []
    assert [k for k in masters if not torch.equal(got["reloaded_params"][k], got["params"][k])] == []
