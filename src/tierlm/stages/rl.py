"""Reinforcement learning from a trained chat model: sample a group of completions per prompt, reward
them, and update the policy with REINFORCE, GRPO or PPO (with a critic), with pass@k on held-out tasks.

    tierlm rl --config configs/tiny_rl.yaml
"""

from __future__ import annotations

import torch

from tierlm.builders.backend import build_backend
from tierlm.builders.companions import beside_policy
from tierlm.builders.engine import ENGINES, EngineSettings, build_engine
from tierlm.builders.model import build_model, model_context
from tierlm.builders.stage import Stage
from tierlm.builders.tasks import check_prompt_lengths, check_rl_sharing, longest_rollout, open_tasks
from tierlm.config import TierlmConfig
from tierlm.errors import ConfigError
from tierlm.loops.rl import RLTrainer
from tierlm.loops.rl_figures import check_parity
from tierlm.models import model_max_seq_len
from tierlm.plan.scaling import PromptPasses, optimizer_schedule
from tierlm.run import Run, extras_writer
from tierlm.strategies.rl import GRPOStrategy, policy_gradient_strategy
from tierlm.strategies.rl_losses import resolve_rl


class RL(Stage):
    measures_core = False  # its loop measures pass@k on held-out problems
    name = "rl"
    section = "rl"
    example_kind = "task"
    chat = True
    starts_from_trained = True
    no_dropout = True
    needs_chat_template = True
    packing = None
    token_rows = False
    also_reads = ("engine",)
    micro_batch_key = "rl.micro_batch_size"

    def resolve_section(self, config: TierlmConfig) -> TierlmConfig:
        """rl.* with its loss's defaults (`resolve_rl`: a loss without a JAX twin refused on the JAX backend)."""
        return config.model_copy(update={"rl": resolve_rl(config.rl, jax=config.infra.backend == "jax")})

    def parallelism(self, config: TierlmConfig, launched: bool) -> TierlmConfig:
        """Under torchrun each rank samples its share of the prompts and trains on them: DDP (auto), or FSDP2
        (infra.distributed_type=fsdp) for a policy that does not fit one rank, its sampler a whole copy."""
        kind, infra = config.infra.distributed_type, config.infra
        if infra.model_parallel or infra.expert_parallel_size > 1:
            raise ConfigError(
                "tierlm rl shards the data (ddp) or the weights (fsdp) over ranks, not tensor / pipeline / context / "
                "expert parallel layers: drop those sizes"
            )
        kind = ("ddp" if launched else "none") if kind == "auto" else kind
        return config.model_copy(update={"infra": infra.model_copy(update={"distributed_type": kind})})

    def reference_model(self, config: TierlmConfig | None) -> str | None:
        rl = config.rl if config is not None else None
        return "beside" if rl is not None and (rl.kl_coef > 0 or rl.teacher or rl.teachers) else None

    def micro_batch(self, config: TierlmConfig, world_size: int) -> tuple[int, int]:
        rl = config.rl
        return min(
            rl.micro_batch_size, max(1, rl.prompts_per_step // world_size) * rl.group_size
        ), config.data.max_seq_length

    def generation(self, config: TierlmConfig, world_size: int, row_tokens: int) -> tuple[int, int]:
        return config.rl.group_size, row_tokens

    def trace_batch(self, config: TierlmConfig, rows: int, tokens: int):
        batch, _ = super().trace_batch(config, rows, tokens)
        batch.update(advantages=torch.zeros(rows), old_logprobs=torch.zeros(rows, tokens))
        if config.rl.kl_coef > 0:
            batch["ref_logprobs"] = torch.zeros(rows, tokens)
        return batch, GRPOStrategy(config.rl.clip_range, config.rl.kl_coef).compute_loss

    def memory_fixes(self, config: TierlmConfig) -> dict[str, str]:
        fixes = {
            "reference model": "set rl.kl_coef=0",
            "sampler weights": "use infra.distributed_type=ddp where the policy fits one rank",
            "generation KV cache": "lower rl.group_size or rl.max_new_tokens",
        }
        if config.infra.activation_checkpointing:
            fixes["activations"] = fixes["allocator retention"] = "lower rl.micro_batch_size or rl.max_new_tokens"
        return fixes

    def run(self, run: Run, callbacks: list | None = None) -> dict:
        assert not callbacks, "callbacks are for the pretrain / SFT / DPO loop"
        run.choose_batch_size()  # refuses auto: RL's micro-batch is rl.micro_batch_size
        config, tokenizer, world = run.config, run.tokenizer, run.world_size
        rl, d = config.rl, config.data
        train_task, eval_task = open_tasks(config)
        check_rl_sharing(rl, train_task, world)
        rows = min(rl.micro_batch_size, rl.prompts_per_step // world * rl.group_size)  # rollouts per forward/backward
        context = model_context(config, tokenizer.vocab_size, run.pretrained)  # the data is checked before planning
        check_prompt_lengths(train_task, eval_task, tokenizer, context, d.dataset_name)
        longest = longest_rollout(train_task, tokenizer, rl.max_new_tokens, d.max_seq_length)
        run.check_memory(len(train_task), rows, longest, least_tokens=rl.max_new_tokens)
        model = build_model(config, tokenizer, run.device, run.pretrained)
        if context is None:  # a hub id: its context is known once it is downloaded
            check_prompt_lengths(train_task, eval_task, tokenizer, model_max_seq_len(model), d.dataset_name)
        config = run.resolve(model, PromptPasses(len(train_task), rl.prompts_per_step))
        parallel = config.model_copy(update={"training": optimizer_schedule(config, world)})  # LR: optimizer steps
        beside = beside_policy(parallel, model, tokenizer, run.device, run.ctx, run.output_dir / "critic_checkpoints")
        sharded = parallel.infra.distributed_type == "fsdp"  # before the policy is wrapped: the engine may copy it
        sampling = EngineSettings.of(config)
        engine = build_engine(sampling, model, tokenizer, run.scratch_dir("sampler"), sharded, world, train_task)
        run.note(f"rollouts: {ENGINES[sampling.kind].describe(sampling)}")
        backend = build_backend(parallel, model, run.checkpoint_dir, run.device, run.ctx)
        strategy = policy_gradient_strategy(rl)
        beside["write_extra"] = extras_writer(config, tokenizer, self.name)
        trainer = RLTrainer(backend, strategy, engine, tokenizer, train_task, eval_task, rl, config.training, **beside)
        try:
            if run.preflight:  # tierlm rl --check-parity: step 0's rollouts through the sampler and the trainer
                return check_parity(trainer.parity(), rl)
            run.begin(trainer)
            return run.finish(model, run.train(trainer))
        finally:
            engine.close()
