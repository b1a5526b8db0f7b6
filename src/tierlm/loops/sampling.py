"""How RL samples, for its steps and for pass@k alike: prompts rendered for completion, each prompt's random stream
keyed by what is sampled (never by rank, so N ranks draw exactly what one process draws), a task's prompts sampled
in one batched engine call and scored by the task's reward, an environment's episodes run together in rounds
(`tierlm.loops.episodes`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierlm.config import RLConfig
from tierlm.data.tokenizer import Tokenizer
from tierlm.loops.episodes import episode_generators, run_episodes
from tierlm.loops.rewards import score
from tierlm.rollout.engine import Rollout, SamplingEngine
from tierlm.rollout.sampling import SamplingParams
from tierlm.rollout.text import answer_text
from tierlm.tasks import Environment, Task, is_environment


@dataclass
class RolloutSampler:
    engine: SamplingEngine
    tokenizer: Tokenizer
    rl: RLConfig
    seed: int = 0

    def prompt(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.render_for_completion(messages)

    def generator(self, *key: int) -> torch.Generator:
        """The sampling randomness of one prompt, keyed by what is sampled (the step and the prompt's place in the
        step's global batch; an eval problem)."""
        return torch.Generator(device=self.engine.device).manual_seed(hash((self.seed, *key)) % 2**62)

    def groups(
        self, task: Task | Environment, indices: list[int], generators: list, size: int, temperature: float
    ) -> list[list[Rollout]]:
        """`size` scored samples of each index of `task` (each index with its generator): a task's completions, or
        an environment's episodes."""
        if is_environment(task):
            return self.episode_groups(task, indices, generators, size, temperature)
        return self.collect(task, [task.example(i) for i in indices], generators, size, temperature)

    def collect(self, task: Task, examples: list, generators: list, size: int, temperature: float):
        """`size` samples of each example (with its own generator), scored by the task's reward."""
        prompts = [self.prompt(example.messages) for example in examples]
        rl = self.rl
        batches = self.engine.generate_many(
            [(prompt, size, generator) for prompt, generator in zip(prompts, generators)],
            rl.max_new_tokens,
            SamplingParams.of(rl, temperature),
        )
        return self.scored(task, examples, prompts, batches)

    def scored(self, task: Task, examples: list, prompts: list[list[int]], batches: list[list]) -> list[list[Rollout]]:
        """The completions of each example (its prompt's `batches` entry) as rollouts with the task's rewards."""
        texts = [[answer_text(self.tokenizer, c.tokens) for c in completions] for completions in batches]
        items = [(e.prompt, text, e.reference) for e, group in zip(examples, texts) for text in group]
        rewards = iter(score(task, items))  # at once: code runs in the sandbox's pool
        return [
            [Rollout(prompt, c, next(rewards), text, domain=e.domain) for c, text in zip(completions, group)]
            for e, prompt, completions, group in zip(examples, prompts, batches, texts)
        ]

    def episode(self, env: Environment, index: int, temperature: float, generator: torch.Generator) -> Rollout:
        """One multi-turn episode (`tierlm.loops.episodes`)."""
        return run_episodes(self.engine, self.tokenizer, self.rl, [(env, index, generator)], temperature)[0]

    def episode_groups(self, env: Environment, indices, generators, size: int, temperature: float):
        """`size` episodes of each index, every one with its own stream drawn from its index's generator, all
        sampled together in rounds; grouped by index."""
        starts = [(env, i, g) for i, parent in zip(indices, generators) for g in episode_generators(parent, size)]
        rollouts = run_episodes(self.engine, self.tokenizer, self.rl, starts, temperature)
        return [rollouts[j : j + size] for j in range(0, len(rollouts), size)]
