"""Config: YAML + dotted overrides, validation once, one-line errors with exit code 2."""

import pytest

from conftest import REPO, run_main
from tierlm.config import TierlmConfig
from tierlm.errors import ConfigError


def test_yaml_overrides_and_round_trip(tmp_path):
    config = TierlmConfig.load(
        REPO / "configs" / "tiny_pretrain.yaml", ["training.learning_rate=1e-3", "model.depth=3"]
    )
    assert config.training.learning_rate == 1e-3 and config.model.depth == 3
    assert config.data.dataset_name == "synthetic:arithmetic"
    config.to_yaml(tmp_path / "c.yaml")
    assert TierlmConfig.from_yaml(tmp_path / "c.yaml") == config


def test_every_field_is_documented():
    from tierlm.config import DataConfig, InfraConfig, ModelConfig, TokenizerConfig, TrainingConfig

    for section in (ModelConfig, TokenizerConfig, DataConfig, TrainingConfig, InfraConfig):
        for name, field in section.model_fields.items():
            assert field.description, f"{section.__name__}.{name} has no docstring"


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["training.learning_rate=-1"], "training.learning_rate must be > 0.0, got -1"),
        (["training.num_train_steps=ten"], "training.num_train_steps: input should be a valid integer"),
        (["training.lr_scheduler_type=step"], "training.lr_scheduler_type must be one of"),
        (["trainig.learning_rate=1"], "unknown key trainig (did you mean training?)"),
        (["training.learnin_rate=1"], "unknown key training.learnin_rate (did you mean training.learning_rate?)"),
        (["training.output_dir=x"], "unknown key training.output_dir (did you mean infra.output_dir?)"),
        (["training.max_steps=5"], "(TRL's max_steps is training.num_train_steps in tierlm)"),
        (["rl.beta=0.1"], "(TRL's beta is rl.kl_coef in tierlm)"),
        (["training.beta=0.1"], "(TRL's beta is dpo.beta or rl.kl_coef in tierlm)"),
        (["data.lora_r=8"], "(Axolotl's lora_r is model.lora.r in tierlm)"),
        (["training.warmup_steps=5000"], "training.warmup_steps (5000) must be < training.num_train_steps"),
        (["model.depth"], "override 'model.depth' must look like section.key=value"),
    ],
)
def test_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as info:
        TierlmConfig.load(None, overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_every_other_name_points_at_a_key_of_the_config():
    """The hints for TRL's and Axolotl's names name keys that exist."""
    from tierlm.config.aliases import OTHER_NAMES
    from tierlm.config.files import _known_keys

    known = set(_known_keys(TierlmConfig))
    assert not [t for _, targets in OTHER_NAMES.values() for t in targets if t not in known]


def test_bad_yaml_and_missing_file(tmp_path):
    (tmp_path / "bad.yaml").write_text("training: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        TierlmConfig.load(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match="does not exist"):
        TierlmConfig.load(tmp_path / "none.yaml")


@pytest.mark.parametrize(
    "args",
    [
        ["pretrain", "--config", "configs/tiny_pretrain.yaml", "training.learning_rate=-1"],
        ["sft", "--config", "configs/tiny_sft.yaml", "training.bogus=1"],
        ["pretrain", "--config", "no/such.yaml"],
        ["pretrain", "infra.device_type=cuda", "infra.output_dir={tmp}/run"],
        ["sample", "--checkpoint", "/definitely/not/here", "--prompt", "hi"],
        # A missing earlier stage is a one-line error at once, never a hub download with retries.
        [
            "sft",
            "--config",
            "configs/tiny_sft.yaml",
            "model.model_name_or_path=./no_such_run",
            "infra.output_dir={tmp}/run",
        ],
        [
            "rl",
            "--config",
            "configs/tiny_rl.yaml",
            "model.model_name_or_path=tests/no_such_run",
            "infra.output_dir={tmp}/run",
        ],
        ["rl", "--config", "configs/tiny_rl.yaml", "rl.prompts_per_step=0", "infra.output_dir={tmp}/run"],
        ["eval", "--checkpoint", "./no_such_run", "--config", "configs/tiny_rl.yaml"],
        ["dpo", "--config", "configs/tiny_dpo.yaml", "dpo.beta=0", "infra.output_dir={tmp}/run"],
    ],
)
def test_cli_errors_are_one_line_exit_2(args, tmp_path):
    import torch

    if "infra.device_type=cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = run_main(*[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("tierlm: error: "), result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists(), "a failed start must not write a run directory"


def test_a_stage_receives_its_config_resolved_once_and_frozen(tiny_runs, tmp_path):
    """`run_stage` resolves the config in one place (`resolve_config`: the stage's section against its table, its
    parallelism) and the stage's `run` receives it frozen: the RL loss's defaults filled in, no field assignable."""
    from tierlm.stages import RL, run_stage

    seen = {}

    class Looking(RL):
        def run(self, run, callbacks=None):
            seen["config"] = run.config
            with pytest.raises(TypeError, match="frozen"):
                run.config.rl.kl_coef = 1.0
            with pytest.raises(TypeError, match="frozen"):
                run.config.training = run.config.training.model_copy()
            return {}

    config = TierlmConfig.load(
        "tiny_rl", [f"model.model_name_or_path={tiny_runs / 'sft'}", "rl.loss=dapo", f"infra.output_dir={tmp_path}"]
    )
    assert config.rl.clip_high is None and not config.is_frozen
    run_stage(config, Looking())
    resolved = seen["config"]
    assert resolved.is_frozen and resolved.rl.is_frozen
    assert (resolved.rl.clip_low, resolved.rl.clip_high, resolved.rl.dynamic_sampling) == (0.2, 0.28, True)
    assert resolved.infra.distributed_type == "none"  # RL's parallelism: auto without torchrun
    assert config.rl.clip_high is None  # the caller's config is left as it was


def test_the_engine_fields_earlier_names_still_load(tmp_path):
    """The engine section's fields were rl.engine, rl.vllm_url and rl.vllm_gpu_memory_utilization: a config file
    or an override with those names (a run folder's config.yaml from before) loads as the engine section; one
    that sets both names to different values is refused in one line."""
    old = TierlmConfig.load(None, ["rl.engine=vllm", "rl.vllm_url=http://h:8000", "rl.vllm_gpu_memory_utilization=0.5"])
    assert (old.engine.kind, old.engine.vllm_url, old.engine.gpu_memory_utilization) == ("vllm", "http://h:8000", 0.5)
    path = tmp_path / "old.yaml"
    path.write_text("rl:\n  engine: vllm\n  group_size: 4\n")
    from_file = TierlmConfig.load(path)
    assert from_file.engine.kind == "vllm" and from_file.rl.group_size == 4
    assert from_file.engine == TierlmConfig.load(None, ["engine.kind=vllm"]).engine
    path.write_text("rl:\n  engine: vllm\nengine:\n  kind: native\n")
    with pytest.raises(ConfigError, match="rl.engine=vllm is tierlm's engine.kind, which the config also sets"):
        TierlmConfig.load(path)


def test_warmup_ratio_becomes_warmup_steps_once_the_steps_are_known():
    """training.warmup_ratio is transformers' (ceil(ratio x steps)), resolved against the run's steps however they are
    set — a step count or a token horizon; with warmup_steps too it is refused in one line."""
    from tierlm.builders.stage import Stage
    from tierlm.plan.scaling import resolve

    base = ["model.depth=1", "model.aspect_ratio=32", "training.warmup_steps=0", "training.warmup_ratio=0.1"]
    config = TierlmConfig.load("tiny_pretrain", [*base, "training.num_train_steps=25"])
    resolved, _ = resolve(config, Stage(), None)
    assert (resolved.training.warmup_steps, resolved.training.warmup_ratio) == (3, None)  # ceil(2.5)
    with pytest.raises(ConfigError, match=r"training.warmup_ratio and training.warmup_steps \(5\) each set"):
        TierlmConfig.load("tiny_pretrain", ["training.warmup_ratio=0.1", "training.warmup_steps=5"])
