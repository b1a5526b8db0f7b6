"""The post-training stages' own sections: `engine` (what generates), `rl` (policy-gradient losses, rollouts,
rewards), `dpo` (preference losses) and `rm` (reward models)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from tierlm.config.model import Section, true_false_or


class EngineConfig(Section):
    """What generates text: RL's rollouts and pass@k, `tierlm eval`; `tierlm chat` and `tierlm serve` fill it from
    their --engine / --vllm-url flags. (rl.engine, rl.vllm_url and rl.vllm_gpu_memory_utilization, its fields'
    earlier names, still load.)"""

    kind: Literal["native", "vllm"] = "native"
    """tierlm's own KV-cache engine, or vLLM (in this process, or the server at engine.vllm_url); in RL the
    trainer's weights are pushed into it after every optimizer step."""
    vllm_url: str | None = None
    """engine.kind=vllm: the base URL of a vLLM server (scripts/vllm_server.sh) that reads the weights the trainer
    writes to RUN/sampler (shared storage); None: vLLM runs in the trainer's process."""
    gpu_memory_utilization: float = Field(0.3, gt=0, lt=1)
    """engine.kind=vllm in this process on a GPU: the share of GPU memory vLLM may take (weights and KV cache; in RL
    it sleeps, giving the KV cache back, while the trainer trains)."""
    compile: bool = False
    """engine.kind=native: `torch.compile` the decode step (the native GPT's fixed-shape step, on CUDA inside its CUDA
    graph): fused kernels, a faster step for runs that sample many, after tens of seconds compiling each new shape."""

    @model_validator(mode="after")
    def _check_url(self) -> "EngineConfig":
        if self.compile and self.kind != "native":
            raise ValueError("engine.compile compiles tierlm's own engine (vLLM compiles its own): drop it or set "
                             "engine.kind=native")  # fmt: skip
        if self.vllm_url is not None and self.kind != "vllm":
            raise ValueError(
                "engine.vllm_url names a vLLM server for engine.kind=vllm: set engine.kind=vllm or drop the URL"
            )
        if self.vllm_url is not None and not self.vllm_url.startswith(("http://", "https://")):
            raise ValueError(f"engine.vllm_url must be an http:// or https:// URL, got {self.vllm_url!r}")
        return self


class RLConfig(Section):
    loss: str | None = None
    """The policy-gradient loss, a row of `tierlm.strategies.rl_losses.RL_LOSSES` (None: rl.algorithm, else
    reinforce): reinforce, grpo, dapo, dr_grpo, gspo, cispo, rloo, reinforce_pp, ppo (a critic optional), distill
    (on-policy distillation from rl.teacher / rl.teachers on the sampled tokens), distill_topk (the same over the
    teacher's top-k tokens). The docs' RL losses page has each one's formula and defaults; a run
    resolves the loss's defaults (clip bounds, std division, dynamic sampling) once, before anything is written."""
    teacher: str | None = None
    """rl.loss=distill / distill_topk: the teacher (a tierlm or transformers model folder, run directory or hub id)
    sharing the student's tokenizer; it scores every sampled token (with rl.teachers: the prompts whose domain has
    no teacher of its own)."""
    teachers: dict[str, str] = Field(default_factory=dict)
    """rl.loss=distill / distill_topk with several teachers: a prompt's domain (data.domain_column of its row; a
    synthetic task's name) -> the teacher that scores its samples, e.g. {arithmetic: runs/math_rl, sums:
    runs/sums_rl}; every teacher shares the student's tokenizer, and a domain with none goes to rl.teacher."""
    distill_top_k: int = Field(20, gt=0)
    """rl.loss=distill_topk: the teacher's k likeliest tokens at each sampled position, over which the reverse KL
    is computed exactly (both distributions renormalised over them)."""
    reward: str = "auto"
    """The task's reward: auto (its format's: exact number, math-verify, the option letter, or the tests passing in
    the sandbox), one of number | math | choice | code, or `module:function`, your own function(prompt,
    completion, reference) -> float (imported from the working folder or the installed packages)."""
    sandbox_workers: int = Field(4, gt=0)
    """Code rewards: programs run at once in the sandbox's pool."""
    reward_model: str | None = None
    """A reward model folder (`tierlm rm` writes one; any transformers ...ForSequenceClassification with one label
    and the policy's tokenizer): each rollout's reward becomes rl.task_reward_weight x the task's rule reward +
    rl.reward_model_weight x the model's score of the prompt and completion."""
    reward_model_weight: float = Field(1.0, gt=0)
    """rl.reward_model: the weight of its score in the reward."""
    task_reward_weight: float = Field(1.0, ge=0)
    """The weight of the task's own (rule) reward: 0 trains on the reward model (or rl.reward_terms) alone (pass@k
    still checks the task's answers)."""
    reward_terms: dict[str, float] = Field(default_factory=dict)
    """More rewards added to the task's, each times its weight (TRL's reward_funcs with reward_weights), e.g.
    {mymodule:format_bonus: 0.2}: a reward rl.reward names (number, math, choice, code) or your own
    module:function(prompt, completion, reference) -> float. Train lines log each one's mean (reward_<function>);
    pass@k still counts the task's own answers. For tasks, not multi-turn environments."""
    algorithm: Literal["reinforce", "grpo", "ppo"] | None = None
    """The older name of rl.loss (its first three values)."""
    clip_low: float | None = Field(None, gt=0, lt=1)
    """The ratio's lower clip 1 - clip_low (None: the loss's default: rl.clip_range; DAPO 0.2; GSPO 3e-4)."""
    clip_high: float | None = Field(None, gt=0)
    """The ratio's upper clip 1 + clip_high (None: rl.clip_range; DAPO 0.28; GSPO 4e-4; CISPO's weight cap 4.0)."""
    dynamic_sampling: bool | None = None
    """Drop groups whose rewards are all equal (no gradient signal) and sample more prompts until the step's groups
    are full (None: on for dapo); the extra draws are logged."""
    max_extra_draws: int = Field(4, ge=0)
    """Dynamic sampling: at most this many rounds of extra prompts per step (then the step trains on what it has,
    padded with signal-free groups)."""
    overlong_buffer: int = Field(0, ge=0)
    """DAPO's soft overlong punishment: a completion longer than max_new_tokens - overlong_buffer loses reward
    linearly, down to -1 at max_new_tokens (0: off)."""
    mask_truncated: bool = False
    """DAPO's overlong filtering (TRL's mask_truncated_completions): a completion cut at rl.max_new_tokens (or the
    context) before it ended trains nothing; its reward still counts in its group's baseline."""
    group_size: int = Field(8, ge=2)
    """Samples per prompt (the group whose mean reward is the baseline)."""
    prompts_per_step: int = Field(8, gt=0)
    """Prompts per optimizer step (each sampled group_size times)."""
    max_new_tokens: int = Field(32, gt=0)
    """Generation budget per sample."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature for rollouts (log-probs are taken under the same temperature)."""
    top_k: int | None = Field(None, gt=0)
    """Sample only from the k most likely tokens (None: all)."""
    top_p: float | None = Field(None, gt=0, le=1)
    """Nucleus sampling threshold (None: off)."""
    min_p: float | None = Field(None, ge=0, le=1)
    """Min-p sampling (Nguyen et al., 2024): only tokens at least min_p times as likely as the most likely one, after
    the temperature and (as transformers orders them) top-k / top-p; vLLM applies it before them (None: off)."""
    critic: bool = False
    """ppo: train a value model beside the policy (a copy of it with a one-column head) for per-token
    GAE advantages and a clipped value loss, instead of the group-mean baseline."""
    gae_gamma: float = Field(1.0, gt=0, le=1)
    """ppo with a critic: the discount of GAE."""
    gae_lambda: float = Field(0.95, ge=0, le=1)
    """ppo with a critic: GAE's lambda (1: the reward minus the value; 0: one-step TD)."""
    value_clip_range: float = Field(0.2, gt=0)
    """ppo with a critic: how far the value may move from its value at sampling time in the clipped loss."""
    ppo_epochs: int = Field(1, gt=0)
    """Passes over each rollout batch (rl.mini_batches optimizer steps each); after the first step, the clipped
    ratio against the stored old log-probs applies."""
    mini_batches: int = Field(1, gt=0)
    """Optimizer steps per pass over a step's rollouts (TRL's steps_per_generation; verl's train batch over its
    ppo_mini_batch_size): each rank's rows dealt into this many equal shares (row i to share i mod this), one
    optimizer step each, so every share after the first trains off-policy and PPO's clip bites. The LR schedule counts
    rl.ppo_epochs x rl.mini_batches optimizer steps per RL step."""
    clip_range: float = Field(0.2, gt=0)
    """PPO/GRPO ratio clip epsilon."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL penalty to the frozen starting model (0: no reference model is kept)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """The penalty's per-token estimate of KL(policy || reference) on the sampled tokens (Schulman, 2020): k3 =
    ref/p - 1 - log(ref/p) (TRL's, DeepSeekMath's GRPO), k2 = log(p/ref)^2 / 2, k1 = log(p/ref). As a loss on
    on-policy samples k2's gradient is the reverse KL's own, k3's is KL(reference || policy)'s, k1's is 0 in
    expectation (its variance alone)."""
    unbiased_kl: bool = False
    """The KL penalty weighted by the loss's importance ratio to the sampling policy, p / p_old per token (the
    sequence's ratio for gspo and luspo), its gradient kept: DeepSeek-V3.2's unbiased KL estimate (TRL's
    use_bias_correction_kl, on by default there): k3's gradient becomes the reverse KL's own, on-policy too (the
    ratio is 1 there, its gradient adds k3 x grad log p). Needs rl.kl_coef > 0."""
    kl_in_reward: bool = False
    """The KL penalty as a reward instead of a loss term (TRL's RLOOTrainer, verl's algorithm.use_kl_in_reward, the
    RLOO paper's and PPO-RLHF's form): each completion's reward less rl.kl_coef x its rl.kl_estimator estimate summed
    over its sampled tokens (TRL's RLOO: k1, log p - log ref), taken before the baseline (group, leave-one-out or the
    step's), so the KL moves the advantages and the loss has no KL term. Needs rl.kl_coef > 0; a loss whose
    advantages come from rewards (no critic, no teacher); under torchrun, rl.balance_ranks=false (each group whole on
    its rank)."""
    reference_sync_steps: int | None = Field(None, gt=0)
    """The KL reference follows the policy (TRL's sync_ref_model with ref_model_sync_steps; TR-DPO's update): every
    this many optimizer steps ref <- alpha policy + (1 - alpha) ref (alpha: rl.reference_mixup_alpha); checkpoints
    then carry the reference's weights. None: the reference stays the starting model."""
    reference_mixup_alpha: float | None = Field(None, gt=0, le=1)
    """rl.reference_sync_steps' alpha (None: 0.6, TRL's)."""
    normalize_std: bool | Literal["group", "batch"] | None = None
    """Divide the group-mean advantages by a std: true or group, each group's (GRPO); batch, the whole step's
    rewards' over every rank (Lite PPO, Liu et al., 2025; TRL's scale_rewards="batch"); false, none (None: the
    loss's default, true for grpo, dapo, gspo, cispo, bnpo and the like)."""
    reward_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """How several rewards (the task's beside rl.reward_terms, a reward model's score, DAPO's overlong penalty) become
    advantages (TRL's multi_objective_aggregation): sum_then_normalize adds them, weighted, then takes the group
    baseline; normalize_then_sum (GDPO, 2026) normalises each in its group (its own mean and std), adds them weighted,
    and divides the sum by the whole step's std, so that a reward of small spread is not drowned by one of large
    spread. For the group-baseline losses."""
    micro_batch_size: int = Field(64, gt=0)
    """Rollout rows per forward/backward (memory); the step's gradient is over all rollouts."""
    balance_ranks: bool = True
    """Under torchrun: every rank's rollouts dealt over the ranks by their training FLOPs (6 N + 12 L d T per token),
    each rank keeping its number of rows, so no rank waits for one that drew the long completions; the gradient
    sums over the ranks, so the step is the same. `rank_imbalance` (the costliest rank over the mean) and
    `rank_imbalance_before` in the train lines."""
    group_by_length: bool = True
    """With more rollouts than rl.micro_batch_size: micro-batches of rows of similar length, each cut to its own
    width, so a long completion's padding is not paid by every micro-batch (the same rows train; `padding_frac`
    in the train lines is the share of computed positions that train nothing)."""
    max_off_policy_steps: int = Field(0, ge=0, le=8)
    """Asynchronous RL: the rollouts of step n are sampled with the weights of step n - k while earlier steps train
    (0: on-policy, generation and training take turns). Pending rollouts are saved with every checkpoint, so a
    resumed run continues exactly."""
    partial_rollouts: bool = False
    """Generate in chunks of rl.rollout_chunk tokens that carry over from step to step: a step trains on the first
    groups to finish (in the order they started) instead of waiting for its longest sample, and a group still
    running when new weights arrive goes on under them, each token recording the weight version that sampled it
    (`tierlm.loops.partial`). In flight groups are saved with every checkpoint."""
    rollout_chunk: int = Field(16, gt=0)
    """rl.partial_rollouts: the tokens a running group gets per round before the step looks for finished ones."""
    rollout_window: int | None = Field(None, gt=0)
    """rl.partial_rollouts: the groups in flight at most (all ranks; a multiple of them); new prompts start, oldest
    first, as groups finish (None: twice rl.prompts_per_step)."""
    max_staleness: int = Field(2, ge=0)
    """rl.partial_rollouts: no token of a trained group is more than this many optimizer steps older than the
    policy that trains on it (at least rl.max_off_policy_steps)."""
    stale_rollouts: Literal["drop", "finish"] = "drop"
    """rl.partial_rollouts: a group in flight that would pass rl.max_staleness is dropped (as TRL's async GRPO
    does), or finish: ended where it is when it reaches the bound and trained unfinished."""
    importance: Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] | None = None
    """How samples drawn by another policy than the trainer's (older weights, a sampler whose arithmetic differs) are
    corrected, with r = p_trainer / p_sampler of each sampled token: token_truncate weights each token's loss by
    r truncated into [rl.importance_floor, rl.importance_cap] (TIS); token_mask by r inside that band and 0 outside
    it (IcePop); sequence_truncate / sequence_mask do the same with the product of the row's ratios (one weight per
    sequence); none: no correction. None: token_truncate when rl.max_off_policy_steps > 0 or rl.partial_rollouts, else
    none."""
    importance_floor: float | None = Field(None, gt=0)
    """rl.importance: the band's lower end (None: no lower end; IcePop uses 0.5)."""
    importance_cap: float | None = Field(2.0, gt=0)
    """rl.importance: the band's upper end (None: no upper end; IcePop uses 5, TRL's vLLM correction 3)."""
    entropy_coef: float = Field(0.0, ge=0)
    """An entropy bonus: the loss less this times the mean entropy of the policy over each micro-batch's trained
    completion tokens (those rl.top_entropy_quantile keeps), at the sampling temperature; TRL's entropy_coef (its
    fixed form; with rl.entropy_target, the adaptive control's first coefficient). 0: off. When on, the train lines
    show the entropy (entropy_mean)."""
    entropy_target: float | None = Field(None, gt=0)
    """Adaptive entropy control (Skywork-OR1, He et al., 2025; TRL's use_adaptive_entropy with entropy_target): after
    each step the coefficient rises by rl.entropy_coef_delta while the step's mean entropy over every rank (nats, the
    trained tokens) is at or below this target and falls by it above, within rl.entropy_coef_min..max; the bonus
    applies only in a step after one at or below the target (none in the first). Set it near the entropy of the first
    steps (entropy_mean). None: the coefficient stays rl.entropy_coef."""
    entropy_coef_delta: float = Field(0.005, gt=0)
    """rl.entropy_target: the coefficient's step up or down (TRL's)."""
    entropy_coef_min: float = Field(0.0, ge=0)
    """rl.entropy_target: the coefficient's floor."""
    entropy_coef_max: float = Field(1.0, gt=0)
    """rl.entropy_target: the coefficient's ceiling."""
    two_sided_clip: float | None = Field(None, gt=1)
    """INTELLECT-2's two-sided clipping (TRL's delta): the importance ratio is capped at this before PPO's clipped
    surrogate, which bounds a token's loss when its advantage is negative (the clip alone leaves r A unbounded
    there); above 1 + rl.clip_high. None: off. For the losses with a clipped ratio (grpo, dapo, dr_grpo,
    rloo, reinforce_pp, bnpo, ppo, gspo, luspo)."""
    top_entropy_quantile: float = Field(1.0, gt=0, le=1)
    """Train only on this share of each micro-batch's completion tokens, those of highest entropy (Wang et al., 2025,
    "Beyond the 80/20 rule": 0.2; TRL's top_entropy_quantile); the loss's normaliser still counts every token. 1: all
    of them."""
    off_policy_mask: float | None = Field(None, gt=0)
    """DeepSeek-V3.2's off-policy sequence mask: a sequence with a negative advantage whose mean KL(sampler || policy)
    per token exceeds this trains nothing (None: off; e.g. 0.5)."""
    sapo_temperature_pos: float = Field(1.0, gt=0)
    """rl.loss=sapo: the gate's temperature for tokens with a positive advantage."""
    sapo_temperature_neg: float = Field(1.05, gt=0)
    """rl.loss=sapo: the gate's temperature for the others (higher: their gradient fades faster)."""
    vespo_k_pos: float = Field(2.0, ge=0)
    """rl.loss=vespo: the weight's shape k for sequences with a non-negative advantage."""
    vespo_lambda_pos: float = Field(3.0, gt=0)
    """rl.loss=vespo: its rate lambda for them."""
    vespo_k_neg: float = Field(3.0, ge=0)
    """rl.loss=vespo: k for sequences with a negative advantage."""
    vespo_lambda_neg: float = Field(2.0, gt=0)
    """rl.loss=vespo: lambda for them."""
    routing_replay: bool = False
    """Rollout routing replay (R3) for a mixture-of-experts policy: the trainer's forward sends each token to the
    experts the sampler chose for it (recorded by tierlm's engine) instead of its router's own top-k, so the
    trainer scores what the sampler sampled; the router still learns from its scores of those experts. The train
    lines report routing_token_agreement / routing_decision_agreement either way."""
    parity_tolerance: float = Field(0.05, gt=0)
    """`tierlm rl --check-parity` refuses when the sampler's log-probs differ from the trainer's by more than this
    (mean |difference| per sampled token, in nats): past it the importance ratio is noise (bf16 samplers are near
    1e-2, float32 near 1e-7)."""
    max_turns: int = Field(8, gt=0)
    """Multi-turn environments: assistant turns per episode before it ends."""
    max_episode_tokens: int | None = Field(None, gt=0)
    """Multi-turn environments: the tokens an episode's completion may hold (its turns, the environment's messages
    and tool results; None: up to the context)."""
    tools: list[Literal["calculator", "python"]] = Field(default_factory=list)
    """Tools the model may call during generation (results are spliced in and masked from the loss): calculator
    (arithmetic), python (a program run in the sandbox; it answers what the program printed). A request
    `name: argument` picks a tool; a bare one goes to the first listed."""
    environment_args: dict[str, Any] = Field(default_factory=dict)
    """A verifiers environment's settings (`data.dataset_name: verifiers:<id>`, or `rl.environment`): its taskset
    config's fields, as verifiers' `--env.taskset.*` takes them (e.g. {num_tasks: 200})."""
    log_rollouts: int = Field(0, ge=0)
    """The first this many rollouts of each logged step (training.logging_steps) written to metrics.jsonl as "rollout"
    lines beside its train line (TRL's log_completions, verl's rollout_data_dir): the prompt and completion as text,
    the answer the reward read, the reward and its parts, the advantage trained on, the tokens, whether it finished,
    its tool calls and weight version. Rank 0's rollouts; 0: none."""
    eval_problems: int = Field(100, gt=0)
    """Held-out problems for pass@k."""
    eval_k: int = Field(4, gt=0)
    """Samples per held-out problem: pass@1 is their mean accuracy, pass@k whether any is right."""
    eval_temperature: float = Field(1.0, ge=0)
    """Sampling temperature for pass@k (0: greedy, then pass@1 == pass@k)."""

    @field_validator("normalize_std", mode="before")
    @classmethod
    def _std_scope(cls, value):
        return true_false_or(
            value,
            ("group", "batch"),
            "rl.normalize_std is true or group (each group's std), batch (the step's) or false",
        )

    @model_validator(mode="after")
    def _check_loss(self) -> "RLConfig":
        if self.algorithm is not None and self.loss is not None and self.algorithm != self.loss:
            raise ValueError(
                f"rl.algorithm={self.algorithm} and rl.loss={self.loss} disagree: rl.algorithm is rl.loss's older "
                "name, give one"
            )
        object.__setattr__(self, "loss", self.loss or self.algorithm or "reinforce")  # (validate_assignment would
        object.__setattr__(self, "algorithm", None)  # re-enter this validator); the loss's own rules: resolve_rl
        if self.clip_low is not None and self.clip_high is not None and self.clip_low > self.clip_high:
            raise ValueError(
                f"rl.clip_low ({self.clip_low}) > rl.clip_high ({self.clip_high}): the decoupled clip widens the "
                "upper side (DAPO: 0.2 / 0.28)"
            )
        if self.overlong_buffer >= self.max_new_tokens:
            raise ValueError(
                f"rl.overlong_buffer ({self.overlong_buffer}) must be below rl.max_new_tokens ({self.max_new_tokens})"
            )
        if self.partial_rollouts and self.max_staleness < self.max_off_policy_steps:
            raise ValueError(
                f"rl.max_staleness ({self.max_staleness}) is below rl.max_off_policy_steps "
                f"({self.max_off_policy_steps}): every rollout is that many steps old; raise rl.max_staleness"
            )
        if self.partial_rollouts and self.rollout_window is not None and self.rollout_window < self.prompts_per_step:
            raise ValueError(
                f"rl.rollout_window ({self.rollout_window}) must hold a step's groups (rl.prompts_per_step "
                f"{self.prompts_per_step})"
            )
        adaptive = ("entropy_coef_delta", 0.005), ("entropy_coef_min", 0.0), ("entropy_coef_max", 1.0)
        if self.entropy_target is None and any(getattr(self, name) != default for name, default in adaptive):
            raise ValueError(
                "rl.entropy_coef_delta / min / max steer the adaptive entropy coefficient: set rl.entropy_target, or "
                "drop them"
            )
        if not self.entropy_coef_min <= self.entropy_coef <= self.entropy_coef_max and self.entropy_target:
            raise ValueError(
                f"rl.entropy_coef ({self.entropy_coef}) starts the adaptive coefficient: keep it within "
                f"rl.entropy_coef_min..max ({self.entropy_coef_min}..{self.entropy_coef_max})"
            )
        if self.reward_model is None and self.reward_model_weight != 1.0:
            raise ValueError(
                "rl.reward_model_weight weighs a reward model's score: give rl.reward_model=FOLDER, or drop it"
            )
        if self.reward_model is None and not self.reward_terms and self.task_reward_weight != 1.0:
            raise ValueError(
                "rl.task_reward_weight weighs the task's reward against a reward model's score or rl.reward_terms: "
                "give one of them, or drop it"
            )
        return self


class DPOConfig(Section):
    beta: float = Field(0.1, gt=0)
    """Strength of the implicit KL constraint: rewards are beta * (policy - reference) log-probs."""
    reference: Literal["frozen", "precomputed"] = "frozen"
    """frozen: a copy of the starting model scores every batch; precomputed: the data's ref_chosen_logp /
    ref_rejected_logp, or where the data carry none, the starting model scores every pair once before training
    (TRL's precompute_ref_log_probs): training then holds no second model."""
    loss_type: str | list[str] = "sigmoid"
    """The preference loss, a row of `tierlm.strategies.preference_losses.PREFERENCE_LOSSES`: sigmoid (DPO),
    sigmoid_norm (DPO on per-token averaged log-probs), ipo (IPO's squared loss on them), hinge (SLiC's), robust (DPO
    under label noise, dpo.label_smoothing), exo_pair (EXO, dpo.label_smoothing its epsilon), nca_pair, bco_pair,
    sppo_hard, aot and aot_unpaired (AOT: the batch's sorted margins), apo_zero, apo_down, discopop
    (dpo.discopop_tau), sft (the chosen responses' NLL) — each as TRL's DPOTrainer computes it —, simpo and orpo
    (reference-free: no reference model is loaded), kto (KTO on unpaired replies: {prompt, completion, label} rows,
    TRL's format, instead of pairs). A list trains the losses together, added with dpo.loss_weights (TRL's lists:
    MPO is [sigmoid, bco_pair, sft] with weights [0.8, 0.2, 1.0])."""
    loss_weights: list[float] | None = None
    """The weight of each loss of a dpo.loss_type list, in its order (None: 1 each)."""
    use_weighting: bool = False
    """WPO (Zhou et al., 2024; TRL's use_weighting): each pair's loss weighed by how likely the policy finds its two
    responses now, exp of each response's mean token log-prob under the policy's renormalised distribution
    (log p - log sum p^2), chosen times rejected, without gradient: off-policy pairs count less."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """robust: the assumed share of pairs whose preference is flipped; exo_pair: EXO's epsilon (its paper: 1e-3)."""
    ld_alpha: float | None = Field(None, ge=0, le=1)
    """LD-DPO (Liu et al., 2024; TRL's ld_alpha): each response's tokens past the shorter response of its pair count
    this much in its log-prob (policy's and reference's alike), so a longer answer is not preferred for its length; 1:
    plain DPO, 0: only the shared length. None: off. For the pairwise losses with a reference model."""
    rpo_alpha: float = Field(0.0, ge=0)
    """RPO (Pang et al., 2024, iterative reasoning preference optimisation): adds this times the chosen responses'
    token-mean NLL to the pairwise loss (TRL's loss_type [..., "sft"] with loss_weights [1, rpo_alpha]; its paper
    uses 1). 0: off."""
    discopop_tau: float | None = Field(None, gt=0)
    """discopop: the temperature of DiscoPOP's blend of the logistic and exponential losses (None: 0.05, TRL's)."""
    simpo_gamma: float | None = Field(None, ge=0)
    """simpo: the target reward margin gamma (None: 0.5). SimPO's paper uses beta about 2 (dpo.beta)."""
    f_divergence_type: Literal["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"] = "reverse_kl"
    """f-DPO (Wang et al., 2023; TRL's name): the divergence to the reference whose f' scores each response's
    policy / reference ratio u, h = f'(u_chosen) - f'(u_rejected): reverse_kl log u (DPO), forward_kl 1 - 1/u,
    js_divergence log(2u / (1 + u)), alpha_divergence (u^(alpha - 1) - 1) / (alpha - 1). For sigmoid, hinge, robust,
    exo_pair and discopop."""
    f_alpha_divergence_coef: float = 0.5
    """alpha_divergence's alpha (TRL's default; 1 is the reverse KL)."""
    reference_sync_steps: int | None = Field(None, gt=0)
    """TR-DPO (Gorbatovski et al., 2024; TRL's sync_ref_model with ref_model_sync_steps): every this many optimizer
    steps the frozen reference moves toward the policy, ref <- alpha policy + (1 - alpha) ref (alpha:
    dpo.reference_mixup_alpha); checkpoints then carry the reference's weights. None: the reference never moves."""
    reference_mixup_alpha: float | None = Field(None, gt=0, le=1)
    """dpo.reference_sync_steps' alpha (None: 0.6, TRL's); 1 copies the policy (TR-DPO's hard update)."""

    desirable_weight: float = Field(1.0, gt=0)
    """kto: the weight of desirable replies' losses (KTO's lambda_D; raise it when they are outnumbered)."""
    undesirable_weight: float = Field(1.0, gt=0)
    """kto: the weight of undesirable replies' losses (lambda_U)."""

    @field_validator("loss_type")
    @classmethod
    def _some_loss(cls, loss_type):
        if not loss_type:
            raise ValueError("dpo.loss_type is empty: name a preference loss, or a list of them")
        return loss_type


class RewardModelConfig(Section):
    """`tierlm rm`: a reward model trained on preference pairs (the data's optional `margin` column is used)."""

    center_rewards_coefficient: float = Field(0.0, ge=0)
    """Adds this times mean((r_chosen + r_rejected)^2) to the loss, keeping scores centred on 0 (TRL's name; 1e-2 in
    Eisenstein et al., 2023): an RL reward then sits near 0 on average."""
