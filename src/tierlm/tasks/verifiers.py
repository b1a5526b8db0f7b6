"""Environments written with Prime Intellect's `verifiers` (the library prime-rl's users publish environments with) as
tierlm tasks: `data.dataset_name: verifiers:<taskset id>` (or `rl.environment`) loads the installed environment
package through verifiers' own loader, its tasks' prompts are the prompts, and its tasks' weighted `@vf.reward`s
(`Task.score` on a verifiers `Trace` of the conversation) are the reward. Tools a task declares (`vf.Toolset`s with
`@vf.tool` methods) are called in this process as tierlm tools: the model's `<tool_call>name: argument` runs the
method named `<server>_<tool>`, and the reward reads the answer after the last tool result.

What needs verifiers' own agent stack is refused in one line: a task that needs a container or a runtime to score,
judges (another model as the grader), or a task without a prompt (a simulated user opening the conversation).
"""

from __future__ import annotations

import asyncio
import inspect
import json
from typing import Any

from tierlm.errors import ConfigError
from tierlm.tasks.base import TaskExample

PREFIX = "verifiers:"


def verifiers_name(spec: str | None) -> str | None:
    """The taskset id a data spec names (`verifiers:<id>` -> id), None for any other source.

    >>> verifiers_name("verifiers:gsm8k"), verifiers_name("synthetic:arithmetic")
    ('gsm8k', None)
    """
    return spec[len(PREFIX) :] if spec is not None and spec.startswith(PREFIX) else None


def _vf():
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise ConfigError("a verifiers environment needs its package: pip install 'tierlm[verifiers]'") from None
    return vf


def load_tasks(spec: str, args: dict[str, Any]) -> list:
    """The verifiers tasks of `spec`, its taskset config built from `args` (verifiers' `--env.taskset.*`)."""
    _vf()
    name = verifiers_name(spec)
    from pydantic import ValidationError
    from verifiers.v1.utils.loaders import load_taskset, taskset_config_type

    where = f"verifiers environment {name!r}"
    try:
        config = taskset_config_type(name).model_validate({**args, "id": name})
    except ModuleNotFoundError as e:
        raise ConfigError(f"{where} is not installed ({e}): pip install its package, or check the id") from None
    except ValidationError as e:
        first = e.errors()[0]
        raise ConfigError(f"{where}: rl.environment_args.{'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    except Exception as e:  # the environment package's own import-time error: the user's to fix
        raise ConfigError(f"{where} does not load: {type(e).__name__}: {e}") from None
    taskset = load_taskset(config)
    if not taskset.bounded:
        raise ConfigError(f"{where} yields tasks forever: bound it with its own setting (rl.environment_args)")
    tasks = list(taskset)
    if not tasks:
        raise ConfigError(f"{where} holds no tasks")
    kind = type(tasks[0])
    if kind.NEEDS_CONTAINER:
        raise ConfigError(f"{where}: its tasks need a container (verifiers' runtime); tierlm scores in this process")
    needs_runtime = [fn.__name__ for fn in tasks[0].hooks("reward") if _requires(fn, "runtime")]
    if needs_runtime:
        raise ConfigError(f"{where}: rewards {needs_runtime} score in a runtime (verifiers' sandbox), not supported")
    if tasks[0].config.judges:
        raise ConfigError(f"{where}: its judges grade with another model; tierlm trains on rule rewards: drop them")
    if any(task.data.prompt is None for task in tasks):
        raise ConfigError(f"{where}: a task has no prompt (a simulated user opens it), not supported")
    return tasks


def _requires(fn, name: str) -> bool:
    parameter = inspect.signature(fn).parameters.get(name)
    return parameter is not None and parameter.default is inspect.Parameter.empty


def _messages(data) -> list[dict]:
    """A verifiers task's opening conversation as chat messages (its system prompt first)."""
    prompt = data.prompt
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = [m.model_dump(include={"role", "content"}) for m in prompt]
        for m in messages:
            if not isinstance(m["content"], str):
                parts = m["content"]
                if any(part.get("type") != "text" for part in parts):
                    raise ConfigError("a verifiers task's prompt holds images: tierlm trains text models")
                m["content"] = "\n".join(part["text"] for part in parts)
    return ([{"role": "system", "content": data.system_prompt}] if data.system_prompt else []) + messages


class VerifiersTask:
    """Some of an environment's tasks (`indices` into `tasks`) as a tierlm `Task`: the reference of each example
    is its task's index; its reward is the weighted sum of the task's rewards for the completion.

    Doctest-free: a verifiers environment is a package to install (tests/test_verifiers.py writes one)."""

    def __init__(self, tasks: list, indices: list[int], tools: dict | None = None):
        self.tasks, self.indices, self.tools = tasks, indices, tools or {}

    def __len__(self) -> int:
        return len(self.indices)

    def example(self, index: int) -> TaskExample:
        i = self.indices[index]
        return TaskExample(_messages(self.tasks[i].data), i, format="verifiers")

    def reward(self, prompt: str, completion: str, reference: Any) -> float:
        return self.rewards([(prompt, completion, reference)])[0]

    def rewards(self, items: list[tuple[str, str, Any]]) -> list[float]:
        """Every item scored by its task at once (async rewards run concurrently)."""

        async def score_all():
            return await asyncio.gather(*(self._score(self.tasks[i], completion) for _, completion, i in items))

        return asyncio.run(score_all())

    @staticmethod
    async def _score(task, completion: str) -> float:
        vf = _vf()
        from pydantic import TypeAdapter
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.trace import TraceTask
        from verifiers.v1.types import Message

        trace = vf.Trace(
            task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            agent=vf.AgentInfo(config=vf.AgentConfig(), name="tierlm"),
        )
        adapter = TypeAdapter(Message)
        conversation = _messages(task.data) + [{"role": "assistant", "content": completion}]
        trace.nodes = [
            MessageNode(parent=i - 1 if i else None, message=adapter.validate_python(m), sampled=m is conversation[-1])
            for i, m in enumerate(conversation)
        ]
        trace.is_completed = trace.ok = True
        await task.score(trace)
        return trace.reward


class ToolsetTool:
    """One `@vf.tool` method of a verifiers toolset as a tierlm tool: the request is its one argument, or a JSON
    object of its arguments; what it returns (or the error) is the answer."""

    def __init__(self, name: str, fn):
        from pydantic import TypeAdapter

        self.name, self.fn = name, fn
        self.parameters = inspect.signature(fn).parameters
        self.types = {
            key: TypeAdapter(p.annotation if p.annotation is not inspect.Parameter.empty else Any)
            for key, p in self.parameters.items()
        }

    def __call__(self, request: str) -> str:
        try:
            arguments = self._arguments(request.strip())
            result = self.fn(**arguments)
            if inspect.isawaitable(result):
                result = asyncio.run(_await(result))
        except Exception as e:  # the tool's own failure is the model's answer, as in verifiers' MCP servers
            return f"error: {type(e).__name__}: {e}"
        return result if isinstance(result, str) else json.dumps(result, default=str)

    def _arguments(self, request: str) -> dict:
        if request.startswith("{"):
            raw = json.loads(request)
        elif len(self.parameters) == 1:
            raw = {next(iter(self.parameters)): request}
        else:
            raise ValueError(f"{self.name} takes {list(self.parameters)}: send a JSON object")
        return {key: self.types[key].validate_python(value, strict=False) for key, value in raw.items()}


async def _await(result):
    return await result


def task_tools(tasks: list) -> dict[str, ToolsetTool]:
    """The tools the environment's tasks declare, by their verifiers name (`<server>_<tool>`), each toolset set up
    once in this process."""
    from verifiers.v1.utils.decorators import discover_decorated

    tools = {}
    for toolset in type(tasks[0]).toolsets(tasks[0].config):
        asyncio.run(toolset.setup())
        for fn in discover_decorated(toolset, "tool"):
            bare = getattr(fn, "tool_name", None) or fn.__name__
            name = f"{toolset.server_name}_{bare}" if toolset.server_name else bare
            tools[name] = ToolsetTool(name, fn)
    return tools


def open_environment(spec: str, eval_spec: str | None, args: dict, val_fraction: float) -> tuple:
    """(train, eval) tasks of a verifiers environment: its own tasks split by a held-out tail of `val_fraction`,
    or all of `eval_spec`'s for evaluation."""
    tasks = load_tasks(spec, args)
    tools = task_tools(tasks)
    if eval_spec is not None:
        held = load_tasks(eval_spec, args)
        return VerifiersTask(tasks, list(range(len(tasks))), tools), VerifiersTask(held, list(range(len(held))), tools)
    cut = len(tasks) - max(1, round(len(tasks) * val_fraction))
    if cut < 1:
        raise ConfigError(f"{spec} holds {len(tasks)} tasks: too few to hold out data.val_fraction for evaluation")
    return VerifiersTask(tasks, list(range(cut)), tools), VerifiersTask(tasks, list(range(cut, len(tasks))), tools)
