"""verifiers environments (`data.dataset_name: verifiers:<id>` / `rl.environment`): an environment package written
here in the layout `vf-init` scaffolds, loaded through verifiers' own loader, its tasks and rewards trained on."""

import json
import textwrap

import pytest

pytest.importorskip("verifiers.v1")

from conftest import RL  # noqa: E402
from tierlm.builders.tasks import open_task, open_tasks  # noqa: E402
from tierlm.commands.cli import main  # noqa: E402
from tierlm.config import TierlmConfig  # noqa: E402
from tierlm.errors import ConfigError  # noqa: E402
from tierlm.rollout.tools import call_tool  # noqa: E402

TASKSET = '''
import verifiers.v1 as vf

from tierlm.builders.tasks import open_task
from tierlm.tasks.answers import extract_final_number


class ArithData(vf.TaskData):
    answer: float


class Doubler(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "arith"

    @vf.tool
    def double(self, x: int) -> int:
        """Twice x."""
        return 2 * x

    @vf.tool
    async def add(self, a: float, b: float) -> float:
        """a + b."""
        return a + b


class ArithTask(vf.Task[ArithData]):
    @classmethod
    def toolsets(cls, config):
        return [Doubler(vf.ToolsetConfig())]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(extract_final_number(trace.last_reply) == self.data.answer)

    @vf.reward(weight=0.25)
    async def digits(self, trace: vf.Trace) -> float:
        return float(sum(c.isdigit() for c in trace.last_reply))


class ArithConfig(vf.TasksetConfig):
    count: int = 8
    held_out: int = 2


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    """tierlm's own synthetic:arithmetic problems as a verifiers environment: its train split, then its val split."""

    def load(self):
        for split, count in (("train", self.config.count), ("val", self.config.held_out)):
            problems = open_task("synthetic:arithmetic", split, count, 0)
            for i in range(len(problems)):
                example = problems.example(i)
                yield ArithTask(ArithData(prompt=example.prompt, answer=example.reference), self.config.task)
'''


@pytest.fixture
def environment(tmp_path, monkeypatch):
    """The package `arith_env` on the import path, as `pip install -e` of a `vf-init` scaffold would leave it."""
    package = tmp_path / "envs" / "arith_env"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from arith_env.taskset import ArithTaskset\n\n__all__ = ['ArithTaskset']\n")
    (package / "taskset.py").write_text(textwrap.dedent(TASKSET))
    monkeypatch.syspath_prepend(str(tmp_path / "envs"))
    return "verifiers:arith_env"


def test_an_environments_prompts_rewards_and_tools(environment):
    config = TierlmConfig.load("tiny_rl", ["rl.environment=verifiers:arith_env", "data.val_fraction=0.2"])
    assert config.data.dataset_name == environment
    train, val = open_tasks(config)
    native, held_out = open_task("synthetic:arithmetic", "train", 8, 0), open_task("synthetic:arithmetic", "val", 2, 0)
    assert (len(train), len(val)) == (8, 2)
    assert [train.example(i).messages for i in range(8)] == [native.example(i).messages for i in range(8)]
    assert [val.example(i).messages for i in range(2)] == [held_out.example(i).messages for i in range(2)]
    example = train.example(0)
    right, wrong = f"the answer is {native.example(0).reference}", "the answer is 1000"
    digits = sum(c.isdigit() for c in right)
    assert train.rewards([(example.prompt, right, 0), (example.prompt, wrong, 0)]) == [1 + digits / 4, 1.0]
    # the toolset's @vf.tool methods answer tierlm's tool calls, by verifiers' <server>_<tool> names
    assert sorted(train.tools) == ["arith_add", "arith_double"]
    assert call_tool(train.tools, "arith_double: 21") == "42"
    assert call_tool(train.tools, 'arith_add: {"a": 1.5, "b": 2}') == "3.5"
    assert call_tool(train.tools, "arith_double: many").startswith("error: ValidationError")
    assert call_tool(train.tools, "arith_add: 1 2").startswith("error: ValueError: arith_add takes ['a', 'b']")


def test_rl_on_a_verifiers_environment_trains_as_on_the_same_native_task(environment, tiny_runs, tmp_path):
    """The environment serves tierlm's synthetic:arithmetic problems (train, then val as its held-out tail): RL on it
    samples the same prompts, scores the same rewards (its weighted sum, given to the native run as
    rl.reward=module:function), takes the same steps and evaluates the same as RL on the native task."""
    (tmp_path / "envs" / "same_reward.py").write_text(
        "from tierlm.tasks.answers import extract_final_number\n\n"
        "def reward(prompt, completion, reference):\n"
        "    right = float(extract_final_number(completion.strip()) == reference)\n"
        "    return right + 0.25 * sum(c.isdigit() for c in completion)\n"
    )
    base = ["rl", "--config", "tiny_rl", f"model.model_name_or_path={tiny_runs / 'sft'}", *RL]
    base += ["training.num_train_steps=2", "training.logging_steps=1", "training.eval_steps=2", "training.seed=0"]
    same = ("step", "loss", "grad_norm", "reward_mean", "reward_std", "groups_with_signal", "completion_len", "epoch")

    def train_lines(out, *overrides):
        assert main([*base, *overrides, f"infra.output_dir={out}"]) == 0
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        evals = [{k: v for k, v in r.items() if k.startswith("pass@")} for r in rows if r["type"] == "eval"]
        return [{k: r[k] for k in same} for r in rows if r["type"] == "train"] + evals

    sizes = ["data.num_synthetic_examples=8", "data.num_synthetic_eval_examples=2"]
    native = train_lines(tmp_path / "native", *sizes, "rl.reward=same_reward:reward")
    ours = train_lines(tmp_path / "vf", "rl.environment=verifiers:arith_env", "data.val_fraction=0.2")
    assert len(native) == 4 and any(r.get("reward_std", 0) > 0 for r in native), native  # rewards tell rollouts apart
    for a, b in zip(ours, native):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-7), (a, b)


def test_verifiers_refusals(environment, tiny_runs, tmp_path, capsys):
    start = f"model.model_name_or_path={tiny_runs / 'sft'}"
    for overrides, message in (
        (["rl.environment=verifiers:no_such_env"], "verifiers environment 'no_such_env' is not installed"),
        (["rl.environment=verifiers:arith_env", "rl.environment_args={count: many}"], "rl.environment_args.count"),
        (["rl.environment=verifiers:arith_env", "rl.environment_args={count: 0, held_out: 1}"], "too few to hold out"),
        (["rl.environment_args={count: 3}"], "data.dataset_name=verifiers:<id>"),
        (["rl.environment=verifiers:arith_env", "data.eval_dataset_name=synthetic:arithmetic"], "evaluate on"),
        (["rl.environment=verifiers:arith_env", "rl.reward=number"], "scores with its own rewards"),
    ):
        assert main(["rl", "--config", "tiny_rl", start, *overrides, f"infra.output_dir={tmp_path}/r"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (overrides, err)
        assert not (tmp_path / "r").exists()
    broken = tmp_path / "envs" / "broken_env"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise RuntimeError('missing API key')\n")
    with pytest.raises(ConfigError, match="'broken_env' does not load: RuntimeError: missing API key"):
        open_tasks(TierlmConfig.load("tiny_rl", ["rl.environment=verifiers:broken_env"]))
