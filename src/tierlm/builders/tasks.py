"""A run's tasks as its config names them: `synthetic:<name>` environments from the tasks registry, every
other task read through the data pipeline's one path (question / answer columns, the answer pattern,
splits or a held-out tail) like the data of every other stage."""

from __future__ import annotations

import importlib
import inspect
import os
import sys

from tierlm.builders.loaders import open_splits
from tierlm.config import RLConfig, TierlmConfig
from tierlm.data import SourceOptions, open_examples
from tierlm.errors import ConfigError, DataError, first_line
from tierlm.loops.teachers import check_routes
from tierlm.tasks import Environment, ExamplesTask, Task, is_environment, synthetic_name, synthetic_task
from tierlm.tasks.rewards import format_reward
from tierlm.tasks.verifiers import open_environment, verifiers_name


def is_environment_spec(spec: str | None) -> bool:
    """Does `spec` name a multi-turn environment of the tasks registry?"""
    return spec is not None and synthetic_name(spec) is not None and issubclass(synthetic_task(spec), Environment)


def open_task(spec: str, split: str, count: int, seed: int) -> Task | Environment:
    """`synthetic:<name>` (a generated task or environment), or any data source of question / answer rows with
    the default columns (`open_tasks` opens a config's with its columns).

    >>> task = open_task("synthetic:arithmetic", "val", 3, seed=0)
    >>> len(task), task.example(0).prompt
    (3, 'What is 47 + 40?')
    """
    if is_environment_spec(spec):
        return synthetic_task(spec)(split, count, seed)
    return ExamplesTask(open_examples(spec, SourceOptions(split=split, kind="task", synthetic_count=count, seed=seed)))


def open_tasks(config: TierlmConfig, training: bool = True) -> tuple[Task | Environment, Task | Environment]:
    """(train, eval) tasks of an RL run or, `training` False, a pass@k evaluation (which counts the task's own
    answers: rl.reward_terms' functions are not tried, nor need they import)."""
    d, tr = config.data, config.training
    if d.mixture or d.streaming:
        raise ConfigError(
            "RL reads the prompts of one data.dataset_name into memory: drop data.mixture / data.streaming"
        )
    if config.rl.reward_terms and (verifiers_name(d.dataset_name) or is_environment_spec(d.dataset_name)):
        raise ConfigError(
            f"rl.reward_terms score a task's completions; {d.dataset_name} is an environment that scores its own "
            "episodes: drop rl.reward_terms"
        )
    if verifiers_name(d.dataset_name) is not None:
        eval_name = d.eval_dataset_name
        if eval_name is not None and verifiers_name(eval_name) is None:
            raise ConfigError(f"data.eval_dataset_name={eval_name}: verifiers environments evaluate on verifiers:<id>")
        if config.rl.reward != "auto":
            raise ConfigError(f"rl.reward={config.rl.reward}: {d.dataset_name} scores with its own rewards: drop it")
        return open_environment(d.dataset_name, eval_name, config.rl.environment_args, d.val_fraction)
    if config.rl.environment_args:
        raise ConfigError("rl.environment_args set a verifiers environment's fields: data.dataset_name=verifiers:<id>")
    if is_environment_spec(d.dataset_name) or is_environment_spec(d.eval_dataset_name):
        return (
            open_task(d.dataset_name, "train", d.num_synthetic_examples, tr.seed),
            open_task(d.eval_dataset_name or d.dataset_name, "val", d.num_synthetic_eval_examples, tr.seed),
        )
    trains, vals = open_splits(config, "task", None)
    train, val = trains[0][0], vals[0]
    reward = task_reward(config.rl, train.fetch([0])[0].format if len(train) else "number")
    if ":" in config.rl.reward and len(val):  # the user's function, tried before anything is printed or written
        try_reward(reward, val.fetch([0])[0], config.rl.reward)
    for spec, (term, _) in (reward_terms(config.rl) if training else {}).items():
        if ":" in spec and len(val):
            try_reward(term, val.fetch([0])[0], spec, "rl.reward_terms")
    return ExamplesTask(train, reward), ExamplesTask(val, reward)


def try_reward(reward, example, spec: str, setting: str = "rl.reward") -> None:
    """Call the user's reward once on a held-out example (its reference as the completion): what it raises or
    returns wrongly is one line now, not at the first step of a run already under way."""
    try:
        reward(example.prompt, str(example.reference), example.reference)
    except DataError:
        raise
    except Exception as e:  # the user's code: whatever it raises is theirs to fix
        raise ConfigError(
            f"{setting} {spec} raised {type(e).__name__}: {first_line(e)} when tried on a held-out example "
            f"(prompt {example.prompt[:60]!r})"
        ) from None


REWARD_NAMES = ("number", "math", "choice", "code")
"""The rewards of the task formats (`tierlm.tasks.rewards.format_reward`), by name."""


def task_reward(rl: RLConfig, task_format: str):
    """rl.reward: the task format's own reward (auto), a named one, or the user's `module:function`."""
    if ":" in rl.reward:
        return user_reward(rl.reward)
    name = task_format if rl.reward == "auto" else rl.reward
    if name not in REWARD_NAMES:
        raise ConfigError(f"rl.reward must be auto, number, math, choice, code or module:function, got {rl.reward!r}")
    return format_reward(name, rl.sandbox_workers)


def reward_terms(rl: RLConfig) -> dict[str, tuple]:
    """rl.reward_terms: each spec -> (its reward function, its weight); a name of `REWARD_NAMES` or the user's
    `module:function`, checked as rl.reward's (`user_reward`).

    >>> from tierlm.config import RLConfig
    >>> fn, weight = reward_terms(RLConfig(reward_terms={"number": 0.5}))["number"]
    >>> fn("What is 2 + 2?", "4", 4), weight
    (1.0, 0.5)
    """
    terms = {}
    for spec, weight in rl.reward_terms.items():
        if ":" not in spec and spec not in REWARD_NAMES:
            raise ConfigError(
                f"rl.reward_terms names {spec!r}: give number, math, choice, code or a module:function of yours"
            )
        reward = user_reward(spec, "rl.reward_terms") if ":" in spec else format_reward(spec, rl.sandbox_workers)
        terms[spec] = (reward, weight)
    return terms


def user_reward(spec: str, setting: str = "rl.reward"):
    """`module:function` (importable from the working folder or the installed packages), checked once: it must
    take (prompt, completion, reference); each value it returns must be a number."""
    module_name, _, name = spec.partition(":")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the user's module: any error while importing it is theirs to fix
        raise ConfigError(f"{setting} {spec}: cannot import {module_name} ({type(e).__name__}: {e})") from None
    finally:
        sys.path.remove(os.getcwd())
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"{setting} {spec}: {module_name} has no function {name!r}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without one: trusted as called
        signature = None
    if signature is not None:
        try:
            signature.bind("prompt", "completion", "reference")
        except TypeError:
            raise ConfigError(
                f"{setting} {spec}: {name}{signature} must take (prompt, completion, reference) and return a float"
            ) from None

    def reward(prompt: str, completion: str, reference) -> float:
        value = fn(prompt, completion, reference)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise DataError(f"{setting} {spec} returned {value!r} ({type(value).__name__}); it must return a float")
        return float(value)

    return reward


def check_rl_sharing(rl, train_task, world: int) -> None:
    """How RL shares its prompts out: over the ranks (each group whole on one), over steps with partial rollouts
    (a task's completions, not an environment's episodes), and over rl.teachers by their domains (every one
    routed, every route taken: `check_routes`)."""
    if rl.prompts_per_step % world:
        raise ConfigError(f"rl.prompts_per_step ({rl.prompts_per_step}) must be divisible by the {world} ranks")
    if world > 1 and rl.kl_in_reward and rl.balance_ranks:
        raise ConfigError(
            "rl.kl_in_reward makes each group's advantages again after scoring, on the rank that sampled it; "
            "rl.balance_ranks deals the rows over the ranks first: set rl.balance_ranks=false"
        )
    rows = rl.prompts_per_step // world * rl.group_size
    if rows % rl.mini_batches:
        raise ConfigError(
            f"rl.mini_batches={rl.mini_batches} deals each rank's {rows} rollouts (rl.prompts_per_step / ranks x "
            "rl.group_size) into equal shares: make it a divisor of them"
        )
    if rl.partial_rollouts and is_environment(train_task):
        raise ConfigError(
            "rl.partial_rollouts continues a task's completions across steps; an environment's episodes are "
            "sampled whole, turn by turn: drop rl.partial_rollouts"
        )
    if rl.partial_rollouts and rl.rollout_window is not None and rl.rollout_window % world:
        raise ConfigError(f"rl.rollout_window ({rl.rollout_window}) must be divisible by the {world} ranks")
    if rl.teachers:  # and over the teachers, by the prompts' domains
        if is_environment(train_task):
            raise ConfigError(
                "rl.teachers routes a task's prompts by their domain; an environment's episodes have none: give "
                "one rl.teacher"
            )
        check_routes(rl.teachers, rl.teacher, {train_task.example(i).domain for i in range(len(train_task))})


def check_prompt_lengths(train_task, eval_task, tokenizer, max_len: int | None, name: str) -> None:
    """Every prompt of a file task must leave room to answer (synthetic prompts are short by construction)."""
    if max_len is None or synthetic_name(name) is not None or is_environment(train_task):
        return
    for task in (train_task, eval_task):
        for i in range(len(task)):
            length = len(tokenizer.render_for_completion(task.example(i).messages))
            if length + 1 > max_len:
                raise DataError(
                    f"{name}: example {i}'s prompt is {length} tokens, longer than the model's context of {max_len} "
                    "leaves room to answer; shorten or drop it"
                )


def longest_rollout(task, tokenizer, max_new_tokens: int, max_seq_length: int, sample: int = 256) -> int:
    """Prompt + completion tokens of the longest rollout, from the prompts of the first `sample`
    examples, at most data.max_seq_length (an environment's prompts are not known ahead: that bound;
    a prompt too long for the model is refused by `check_prompt_lengths`)."""
    if is_environment(task):
        return max_seq_length
    prompts = (len(tokenizer.render_for_completion(task.example(i).messages)) for i in range(min(sample, len(task))))
    return min(max(prompts, default=0) + max_new_tokens, max_seq_length)
