"""Typed configuration of an AstraFlow run.

Every section is a small frozen dataclass; `astraflow.config.loader` turns YAML into these
objects and rejects unknown keys, wrong types and missing fields before anything starts.

Invariants:
- a field with no default is required;
- a field whose metadata has `runtime=True` may be changed with `--set` on an existing run
  directory (everything else is fixed once the run directory is created, so every component
  of a run agrees on it);
- `choices` in a field's metadata lists the accepted values (the loader names them on error).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


def runtime(default: Any, **meta: Any) -> Any:
    """A field that may be changed with --set on an existing run directory."""
    return field(default=default, metadata={"runtime": True, **meta})


def choice(default: str, *choices: str) -> Any:
    return field(default=default, metadata={"choices": choices})


RELAYS = ("chain", "broadcast")  # weights.relay


@dataclass(frozen=True)
class RunConfig:
    name: str = "astraflow"  # shown in plots and reports
    seed: int = 0  # seed of sampling, workers and trainers (the tasks and the model have their own)


@dataclass(frozen=True)
class DataflowConfig:
    # "loopback" (local runs), "auto" (the node's cluster address under Slurm, loopback
    # otherwise), an interface name such as "ib0", or a literal IPv4 address.
    interface: str = "auto"
    port: int = 0  # 0 = pick a free port; the chosen one is published in rendezvous/
    lease_s: float = runtime(60.0)  # a leased task not committed within this is handed out again
    heartbeat_timeout_s: float = runtime(30.0)  # a worker silent this long is dead: its leases return
    max_message_mb: float = 64.0  # larger messages are refused before they are decoded
    # Replay window: a signed message older than this (sender's wall clock) is refused. A
    # message signed before the dataflow rank started (less 1 s) is dropped too, so the clocks
    # of a run's nodes must agree within about a second (NTP).
    max_clock_skew_s: float = 300.0
    status_window_s: float = runtime(30.0)  # rates and trainer wait fractions in `status` are over this
    # Buffered trajectories are kept in memory up to this much (about 14 bytes a token);
    # beyond it they are read back from their shard when served, so the rank's memory does
    # not grow with the buffer.
    payload_cache_mb: float = 1024.0
    # A commit with a longer trajectory is refused (astraflow/dataflow/validate.py): one
    # million-token record would otherwise be stored and served to a trainer.
    max_trajectory_tokens: int = runtime(131072)
    # Every this many seconds (while the journal grows) a process beside the rank folds the
    # shards and journal lines written since into RUN_DIR/journal/compact-state.npz, so that
    # a restart reads only what came after it (astraflow/dataflow/recovery.py); 0: never.
    compact_every_s: float = runtime(600.0)


@dataclass(frozen=True)
class StoreConfig:
    compression: str = choice("none", "none", "lzf", "gzip")
    gzip_level: int = 4  # with compression gzip: 1 (fast) to 9 (small)
    shard_max_mb: float = 512.0  # a new shard is started once the active one holds this much data
    chunk_tokens: int = 1 << 16  # HDF5 chunk size of the per-token datasets
    # HDF5 file locking fails on some Lustre/NFS mounts; turn it off there.
    locking: bool = True
    # fsync the shard and the journal at every flush, before any reply: an acknowledged commit
    # survives a node crash or power loss, not only a killed process (without it, "stored"
    # means "in the page cache"). One fsync per flush covers every request of a loop turn;
    # its cost is in docs/benchmarks.md (bench dataflow --fsync). Off only for throwaway runs.
    fsync: bool = True
    # Shards the dataflow rank keeps open for reading back samples (one file descriptor each;
    # the least recently used is closed first). Recovery and serving never hold more, however
    # many shards a run has; keep it well under the open-file limit (`ulimit -n`).
    max_open_shards: int = runtime(64)
    # The dataflow rank stops (cleanly, saying why) before a flush that would leave its
    # filesystem less free space than this, rather than let a full disk cut a shard or the
    # journal short mid-write (HDF5 crashed the process on ENOSPC here). The flush's own size
    # is counted on top, so 0 still protects the rank's writes; the margin is for the other
    # writers on the filesystem (logs, checkpoints, weights).
    min_free_mb: float = 64.0


# The roles each workflow's episodes need, one policy per role (`PolicyConfig.role`).
WORKFLOW_ROLES: dict[str, tuple[str, ...]] = {
    "rlvr": ("policy",),
    "solver_verifier": ("solver", "verifier"),
    "solve_and_check": ("solver", "verifier"),
    "multi_turn_tool": ("agent",),
    "code": ("policy",),
    "search": ("agent",),
}


@dataclass(frozen=True)
class TaskSourceConfig:
    """Where prompts come from (astraflow/tasks/): a generator or a data set, split into a
    held-out, a warm-up and a training part, and how each completion is scored."""
    kind: str = choice("arithmetic", "arithmetic", "word_problems", "code_problems", "search_facts", "jsonl", "parquet",
                       "hf_disk")
    # jsonl / parquet: a file; hf_disk: a directory written by `datasets` `save_to_disk`
    path: str = ""
    split: str = ""  # hf_disk: the split of a saved DatasetDict ("" for a saved Dataset)
    # data sets: the fields that hold the prompt (text), the reference answer, and, instead of
    # the prompt, chat messages (a list of {role, content}); other fields reach user rewards
    prompt_key: str = "prompt"
    answer_key: str = "answer"  # see prompt_key
    messages_key: str = ""  # see prompt_key
    solution_key: str = ""  # a worked solution: the warm-up's target and reference guidance ("" = the answer)
    # render plain prompts through the model's chat template as a user message (prompts that
    # are messages always are), with this system prompt when the messages have none
    chat_template: bool = False
    system_prompt: str = ""  # see chat_template
    seed: int = 0  # seed of the generated tasks and of the splits
    # arithmetic: operands are drawn from [0, max_operand]; the answer is the full result, its
    # units digit or its parity. word_problems: the largest quantity in a story.
    # code_problems: the constants k in the problems (1..max_operand per template).
    max_operand: int = 20
    answer: str = choice("full", "full", "units", "parity")
    ops: str = "+-"  # which of + and - to generate (two operands)
    operands: int = 2  # arithmetic: more than 2 sums that many; word_problems: quantities in a story
    # word_problems: the warm-up's target and the reference answer work the story out line by
    # line ("7 - 2 = 5") before "The answer is \boxed{5}."; false: the boxed answer alone
    worked_solution: bool = True
    pad_operands: bool = False  # "07+15=" instead of "7+15="
    # search_facts: people in the generated encyclopedia (towns: a quarter as many), and the
    # searches a question may need (1, or 2: "the town where X lives" mixed in)
    entities: int = 200
    hops: int = 1  # see entities
    # the search workflow: a JSONL file of documents to search ({"text": ..., "title": ...}
    # per line); "" with kind search_facts: its generated encyclopedia
    corpus: str = ""
    reverse_answer: bool = False  # answer digits least significant first
    # Prompts never handed out for training (evaluation split) and prompts reserved for the
    # supervised warm-up; the three splits are disjoint. A value >= 1 is a count, below 1 a
    # fraction of the rows (data sets: by a hash of each row's content, so a row keeps its
    # split when rows are appended).
    heldout: float = 200
    warmup: float = 0  # see heldout
    # Rollouts per task (one GRPO group).
    group_size: int = 8
    # Stop handing out tasks after this many (0 = unlimited, cycling through the source).
    max_tasks: int = 0
    workflow: str = choice("rlvr", "rlvr", "solver_verifier", "solve_and_check", "multi_turn_tool", "code", "search")
    # a registered reward (workflows/rewards.py: exact_match, token_f1, math_verify, boxed_math, code_tests)
    # or a user's `package.module:function`, called as f(completion, answer) or
    # f(completion, answer, row); sync or async. One that raises or outlasts the timeout
    # scores 0 and is counted.
    reward: str = "exact_match"
    reward_timeout_s: float = 10.0  # see reward


@dataclass(frozen=True)
class PolicyConfig:
    name: str  # the policy's name: its trainer, metrics file, weights and --set path
    max_staleness: int = runtime(2)  # max version lag at lease and at consumption
    # samples ready plus in flight before leases pause; where generation outpaces the trainer,
    # the surplus a deep buffer admits mostly ages into stale drops (docs/benchmarks.md)
    buffer_capacity: int = runtime(4096)
    # Which ready samples a batch takes first: "oldest" (FIFO) or "newest" (the last stored;
    # stale ones are dropped from the other end), so that a standing queue ages nothing served
    serve_order: str = runtime("oldest", choices=("oldest", "newest"))
    filter_zero_advantage: bool = runtime(True)  # drop groups whose rewards are all equal (no signal)
    # GRPO divides a group's advantages by its reward std; false: mean baseline only
    # (Dr. GRPO), so the scale of rewards across groups counts (a verifier's class weights)
    advantage_std: bool = runtime(True)
    keep_versions: int = runtime(3)  # weight retention: last K published versions
    # The workflow role this policy plays in an episode: rlvr needs "policy",
    # solver_verifier and solve_and_check "solver" and "verifier", multi_turn_tool "agent".
    role: str = "policy"
    # This policy's own trainer settings; unset ones come from the `trainer` section.
    lr: float | None = None  # trainer.lr for this policy
    batch_size: int | None = None  # trainer.batch_size for this policy
    steps: int | None = None  # trainer.steps for this policy
    minibatches: int | None = None  # trainer.minibatches for this policy
    ref_kl: float | None = None  # trainer.ref_kl for this policy


@dataclass(frozen=True)
class ModelConfig:
    """The policies' starting model: a Hugging Face directory (Qwen2/Qwen2.5/Qwen3, Llama,
    Mistral), or one built from config into RUN_DIR/model (astraflow/models/families.py)."""
    path: str = ""  # a Hugging Face model directory; empty: build `like` at `size`
    like: str = choice("qwen2", "qwen2", "llama", "qwen2.5", "llama3")
    size: str = "tiny"  # tiny, small; the real shapes 0.5b, 1.5b (qwen2.5) and 1b (llama3)
    tokenizer: str = choice("", "", "bpe", "char")  # "": the family's (char for qwen2/llama, bpe otherwise)
    tied: bool | None = None  # tied input/output embeddings; None: as the family at that size
    seed: int = 0  # seed of a built model's random initial weights
    # Training precision: auto = bf16 compute with fp32 master weights and optimizer state on a
    # GPU, fp32 on a CPU. Published weights are in this dtype.
    dtype: str = choice("auto", "auto", "bfloat16", "float32")


@dataclass(frozen=True)
class WarmupConfig:
    """Short supervised warm-up on the task format, so RL starts weak but not from zero."""
    steps: int = 0  # supervised steps on tasks.warmup prompts before RL (0: none)
    lr: float = 3e-3  # its learning rate
    batch_size: int = 64  # its samples per step


@dataclass(frozen=True)
class EngineConfig:
    # the rollout engine: Hugging Face transformers, vLLM (continuous batching), or vLLM's
    # offline engine in batches (batch-synchronous: the baseline of `astraflow bench rollout`)
    kind: str = choice("hf", "hf", "vllm", "vllm-batch")
    max_tokens: int = 8  # tokens generated per completion at most
    temperature: float = 1.0  # sampling temperature of rollouts (the evaluation is greedy)
    threads: int = 1  # OpenMP threads per engine process (OMP_NUM_THREADS, unless the environment sets it)
    max_batch: int = 256  # sequences one engine batch holds at most
    batch_wait_ms: float = 5.0  # how long a batch may wait to fill (see engines/batching.py)
    # auto: bf16 on a GPU, fp32 on a CPU (vLLM's CPU kernels die with SIGILL in bf16 here)
    dtype: str = choice("auto", "auto", "bfloat16", "float32")
    max_model_len: int = 0  # vllm: longest prompt + completion; 0 = the model's max_position_embeddings
    gpu_memory_utilization: float = 0.85  # vllm on a GPU
    tensor_parallel_size: int = 1  # vllm
    enforce_eager: bool | None = None  # vllm; None: eager on a CPU, CUDA graphs on a GPU


@dataclass(frozen=True)
class PoolConfig:
    """Rollout workers that host the same policies."""
    workers: int  # workers in this pool
    policies: tuple[str, ...]  # the policies each of them hosts


@dataclass(frozen=True)
class RolloutConfig:
    workers: int = 1  # rollout worker processes (local runs; on Slurm the job's rollout tasks)
    concurrency: int = 16  # tasks in flight per worker
    # A worker learns of new weights from its lease, commit, renew and heartbeat replies
    # (`latest`; a refused lease carries it too) and from the collective channel; it asks the
    # rank (`Weights`) only after this long without such a reply, a fallback: at 1,000 workers
    # a 5 s poll alone is 200 requests a second.
    weight_poll_s: float = runtime(30.0)
    # Partial rollouts (engine.kind vllm): a new weight version pauses the generations in
    # flight and they resume under it, instead of the version waiting for them to end; each
    # token records the version that produced it, and staleness counts a record's oldest token.
    partial: bool = False
    # Which policies each worker hosts, pool by pool (workers 0..n0-1 the first pool, ...);
    # empty: every worker hosts every policy. The pools' workers add up to `workers`.
    pools: tuple[PoolConfig, ...] = ()
    # A directory of standby workers (`astraflow rollout --standby DIR`) that `astraflow
    # run` invites to join this run, besides its own `workers` (which may then be 0); they
    # keep their engines from run to run (rollout/standby.py). Empty: none.
    standby: str = ""


@dataclass(frozen=True)
class WorkflowConfig:
    """Parameters of the multi-policy and agentic workflows."""
    retry: bool = False  # solver_verifier: the solver answers once more after a rejection
    # rlvr, code, search, solver_verifier (its solver): a group whose sampled answers all
    # scored 0 gets the reference answer (search: the row's searches, then the answer) as one
    # more member, scored (not sampled) by the engine, so a prompt the policy cannot yet solve
    # still teaches it something instead of being filtered (off-policy guidance, as in LUFFY,
    # arXiv 2504.14945). Its reward is never counted as a generated reward.
    reference_guidance: bool = False
    # solver_verifier: a group whose answers are all wrong (all right) also has the verifier
    # judge the reference answer (a drawn wrong answer), so that its verdicts cannot be read
    # off the question; those judgments are trained, never counted in its reward
    verifier_contrast: bool = False
    # multi_turn_tool and search: agent turns per episode; code: attempts, each after the first
    # seeing the previous attempt's first failing test
    max_turns: int = 3
    # search: the documents each search returns, best first (BM25; environments/retrieval.py)
    search_top_k: int = 1
    # multi_turn_tool: "builtin" (an environment server each worker starts on loopback) or
    # the http:// URL of an environment server
    environment: str = "builtin"
    # solver_verifier: one environment round-trip per answer before the verifier judges it
    # (where an agentic workflow would run the answer's code or query a remote tool)
    env_check: bool = False
    # The load that makes agentic RL slow, put onto a tiny model (0 = off). Each generation
    # decodes L ~ lognormal(median, p99/median) tokens, capped at engine.max_tokens, past
    # EOS; the completion is cut at its first EOS, so what is trained and rewarded is
    # sampled from the unchanged distribution.
    decode_len_median: int = 0
    decode_len_p99_ratio: float = 8.0  # see decode_len_median
    # Talking to the environment server (docs/environments.md): each request's timeout;
    # retries of idempotent calls (/cancel, /health; /start and /step only when nothing was
    # sent) per call, and the budget they draw on (each request earns this fraction of a
    # retry); the whole episode's deadline from /start (0 = none); pooled keep-alive
    # connections at most. A failure costs the episode (handed back, counted), never the worker.
    env_request_timeout_s: float = 30.0
    env_retries: int = 2  # see env_request_timeout_s
    env_retry_budget: float = 0.1  # see env_request_timeout_s
    env_episode_deadline_s: float = 0.0  # see env_request_timeout_s
    env_connections: int = 64  # see env_request_timeout_s
    # Latency of each environment step (server side), lognormal by median and p99.
    env_latency_median_s: float = 0.0
    env_latency_p99_s: float = 2.0  # see env_latency_median_s


@dataclass(frozen=True)
class ScheduleConfig:
    # async: generation and training overlap, bounded by each policy's max_staleness.
    # sync: the conventional trainer-centred loop, on the same components: generate one
    # batch for every policy with the latest weights, then train, then push weights.
    mode: str = choice("async", "async", "sync")
    # Lock-step versions in async mode: no trainer starts step s+1 before every policy has
    # finished step s.
    barrier: bool = False


@dataclass(frozen=True)
class SelectionConfig:
    """Pre-rollout prompt selection (astraflow/dataflow/selection.py)."""
    # Skip a prompt whose last z groups were all filtered for zero advantage, except with
    # probability explore ** min(z, max_streak); rewards of kept prompts are weighted back.
    skip_zero_advantage: bool = runtime(False)
    explore: float = runtime(0.5)  # see skip_zero_advantage
    max_streak: int = runtime(4)  # see skip_zero_advantage


@dataclass(frozen=True)
class TrainerConfig:
    # torch: a Hugging Face model replicated on every rank (data parallel, DDP);
    # megatron: megatron-core, tensor, pipeline and data parallel (trainer/megatron/)
    backend: str = choice("torch", "torch", "megatron")
    steps: int = 50  # training steps; the run ends when every policy has done its steps
    batch_size: int = 64  # samples per step, all ranks together
    lr: float = 1e-3  # peak learning rate (AdamW)
    lr_schedule: str = choice("constant", "constant", "cosine")  # trainer/lr.py
    lr_warmup_steps: int = 0  # linear ramp from 0 to lr over these steps
    lr_min_ratio: float = 0.1  # cosine: the last step's rate, as a fraction of lr
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # gradient norm clipping
    clip_eps: float = 0.2  # PPO clipping of the probability ratio
    is_cap: float = 2.0  # truncation of the behaviour importance weight (decoupled PPO)
    # Weight of KL(starting policy || policy) per trained token (trainer/loss.py): keeps
    # answers the policy rarely gets right from dying out early (trainer/loss.py).
    ref_kl: float = 0.0
    minibatches: int = 1  # optimizer steps per training step (each rank's share cut this many times)
    checkpoint_every: int = 10  # steps between checkpoints (a restarted trainer resumes from the last)
    # Trainer ranks per policy: tp x pp x dp (unset: tp x pp x max(dp, 1)). The layout may
    # change when a run is resumed: a checkpoint loads into another one (the megatron backend
    # cuts it again, trainer/megatron/reshard.py; a torch checkpoint is a whole replica).
    world: int = runtime(1)
    # megatron: tensor-parallel ranks, which must divide the attention and kv heads (the tp
    # ranks of a model replica train on the same rows), and pipeline stages, which must divide
    # the layers (micro-batches through megatron's 1F1B schedule); the torch backend has 1 and 1.
    tp: int = runtime(1)
    pp: int = runtime(1)  # see tp
    dp: int = runtime(0)  # data-parallel replicas; 0: world / (tp x pp)
    # megatron: shard the fp32 master weights and AdamW state over the data-parallel
    # replicas (Megatron's distributed optimizer, ZeRO stage 1): 12 bytes a parameter
    # divided by the replicas, for one broadcast of the parameters per step
    distributed_optimizer: bool = runtime(False)
    # megatron, tp > 1: split the activations between layers along the sequence over the
    # tensor-parallel ranks (Megatron's sequence parallelism: activation memory / tp, the
    # same traffic as tensor parallelism's all-reduces)
    sequence_parallel: bool = runtime(False)
    threads: int = 1  # torch CPU threads per trainer rank
    # Memory at LLM scale: a minibatch is cut into micro-batches of at most this many tokens
    # (padding included; sequences of similar length go together) whose gradients accumulate;
    # 0: one pass per minibatch. Logits exist for `logprob_chunk_tokens` trained positions at
    # a time, never for the whole (batch, length, vocabulary).
    max_tokens_per_microbatch: int = 0
    logprob_chunk_tokens: int = 1024  # see max_tokens_per_microbatch
    activation_checkpointing: bool = False  # recompute activations in the backward pass: less memory, more time


@dataclass(frozen=True)
class WeightsConfig:
    """The weight channel (astraflow/weights/): how versions reach the engines."""
    # Every version is written to RUN_DIR/weights/ (`filesystem`); a full copy every
    # `full_every` versions (and whenever a delta would be over half of one), a sparse delta
    # against the previous version otherwise. 1: every version full.
    full_every: int = 10
    # `auto` / `collective`: the trainer's rank 0 also broadcasts each version to the rollout
    # workers started with it (gloo over CPU tensors; a local run's workers, a het job's
    # rollout tasks), `weights/collective.py`. Workers that join later (arrays, standby workers, restarts) and
    # every version once a broadcast has failed take the filesystem, which always has them.
    # Opt-in (default `filesystem`) until it has run longer than the quickstart's few runs.
    channel: str = choice("filesystem", "auto", "filesystem", "collective")
    # How the collective channel moves a version's payload: `chain` (rank 0 sends each bucket
    # to the first worker, which forwards it to the next as soon as it has arrived, and so
    # on: rank 0 sends the payload once, whatever the number of workers) or `broadcast`
    # (rank 0 sends each bucket to every worker itself), `weights/collective.py`.
    relay: str = choice("chain", *RELAYS)
    # The payload moves flattened into buckets of at most this size. A chain of n workers
    # takes one payload's time plus n - 1 buckets': small buckets fill it sooner.
    bucket_mb: float = 32.0
    # Every collective operation gives up after this long: a dead or stopped worker delays the
    # trainer by at most this much, and the version goes over the filesystem.
    broadcast_timeout_s: float = 30.0


@dataclass(frozen=True)
class LauncherConfig:
    max_restarts: int = 3  # restarts of a crashed component before the run fails
    backoff_s: float = 1.0  # delay before the first restart, doubling at each further one


@dataclass(frozen=True)
class ElasticConfig:
    """The automatic controller of the rollout pool (Slurm runs): it grows the pool with
    rollout arrays while trainers wait for data and drains it while they do not."""
    enabled: bool = False  # run the controller (Slurm runs only)
    min_workers: int = 0  # array workers beyond the het job's own rollout tasks
    max_workers: int = 4  # array workers at most
    step: int = 1  # workers added or removed per decision
    grow_above: float = 0.5  # max trainer wait fraction (over dataflow.status_window_s) to grow
    shrink_below: float = 0.1  # ... and to shrink: the gap between the two is the hysteresis
    cooldown_s: float = 60.0  # no decision, least of all the opposite one, this soon after one
    interval_s: float = 5.0  # seconds between decisions
    partition: str = ""  # where arrays go (empty: the het job's rollout partition)


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases: each trainer also logs its rows (and sample completions) to a W&B run
    of its own, named by the policy and grouped by the run directory. Needs `pip install
    wandb` (or the `tracking` extra); the run refuses to start when it is missing."""
    enabled: bool = runtime(False)  # log to W&B besides the CSV and TensorBoard
    project: str = ""  # the W&B project ("" = run.name)
    entity: str = ""  # the W&B user or team ("" = the account's default)
    # offline: written under RUN_DIR/metrics/wandb/ only, no network (upload later with
    # `wandb sync`); online: streamed to the W&B server too (needs `wandb login` or WANDB_API_KEY)
    mode: str = runtime("offline", choices=("offline", "online"))


@dataclass(frozen=True)
class MlflowConfig:
    """MLflow: each trainer also logs its rows (and sample completions, as text artifacts) to
    an MLflow run of its own, named by the run directory and the policy. Needs `pip install
    mlflow-skinny` (or `mlflow`, or the `tracking` extra); the run refuses to start when it is
    missing."""
    enabled: bool = runtime(False)  # log to MLflow besides the CSV and TensorBoard
    # where: "" = file:RUN_DIR/metrics/mlflow (no server, no network; `mlflow ui
    # --backend-store-uri` reads it), or a server's http(s):// URI, sqlite:///, databricks
    tracking_uri: str = ""
    experiment: str = ""  # the MLflow experiment ("" = run.name)


@dataclass(frozen=True)
class MetricsConfig:
    """Where trainers' metrics go besides RUN_DIR/metrics/<policy>.csv and TensorBoard
    (astraflow/analysis/sinks.py). A backend may be turned on (or W&B's mode changed) when a
    run is resumed; where it logs is fixed, so that a restarted trainer logs on to the same
    W&B or MLflow run."""
    wandb: WandbConfig = WandbConfig()
    mlflow: MlflowConfig = MlflowConfig()


@dataclass(frozen=True)
class Config:
    policies: tuple[PolicyConfig, ...]
    run: RunConfig = RunConfig()
    dataflow: DataflowConfig = DataflowConfig()
    store: StoreConfig = StoreConfig()
    tasks: TaskSourceConfig = TaskSourceConfig()
    model: ModelConfig = ModelConfig()
    warmup: WarmupConfig = WarmupConfig()
    engine: EngineConfig = EngineConfig()
    rollout: RolloutConfig = RolloutConfig()
    trainer: TrainerConfig = TrainerConfig()
    launcher: LauncherConfig = LauncherConfig()
    elastic: ElasticConfig = ElasticConfig()
    workflow: WorkflowConfig = WorkflowConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    selection: SelectionConfig = SelectionConfig()
    weights: WeightsConfig = WeightsConfig()
    metrics: MetricsConfig = MetricsConfig()

    def policy(self, name: str) -> PolicyConfig:
        for p in self.policies:
            if p.name == name:
                return p
        raise KeyError(f"unknown policy {name!r}; configured: {[p.name for p in self.policies]}")

    @property
    def policy_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.policies)

    def trainer_for(self, name: str) -> TrainerConfig:
        """The trainer settings of one policy: its own where set, the `trainer` section's otherwise."""
        p = self.policy(name)
        own = {k: getattr(p, k) for k in ("lr", "batch_size", "steps", "minibatches", "ref_kl")
               if getattr(p, k) is not None}
        return replace(self.trainer, **own)

    def worker_policies(self, index: int) -> tuple[str, ...]:
        """The policies rollout worker `index` hosts (pools in order, then wrapping around)."""
        if not self.rollout.pools:
            return self.policy_names
        slots = [pool.policies for pool in self.rollout.pools for _ in range(pool.workers)]
        return slots[index % len(slots)]

    @property
    def roles(self) -> dict[str, str]:
        """role -> policy for this run's workflow (the loader checks that it is one to one)."""
        return {p.role: p.name for p in self.policies}

    @property
    def task_policies(self) -> tuple[str, ...]:
        """The policies every episode needs: a task goes only to a worker hosting all of them."""
        return tuple(self.roles[r] for r in WORKFLOW_ROLES[self.tasks.workflow])
