"""The house in tiers: imports point down the tiers without circles (import-linter's contracts in
pyproject.toml, checked here and proven able to fail), stage logic stays in `tierlm.stages`, the protocols
are asked rather than probed, every stage file reads on one screen, and the modules of the flat layout
still import from their old names."""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tierlm

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "tierlm"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter's contracts (the repository's pyproject.toml) over the `tierlm` package under `root`/src."""
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(REPO / "pyproject.toml"), "--no-cache"],
        cwd=root,
        text=True,
        capture_output=True,
        env={"PYTHONPATH": str(root / "src"), "PATH": "/usr/bin:/bin"},
        timeout=300,
    )


def test_imports_point_down_the_tiers_without_circles():
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert (
        "Imports point down the tiers KEPT" in result.stdout
        and "No circles between the modules of a package KEPT" in result.stdout
    )


def test_an_upward_import_or_a_circle_breaks_the_contracts(tmp_path):
    shutil.copytree(SRC, tmp_path / "src" / "tierlm", ignore=shutil.ignore_patterns("__pycache__"))
    losses = tmp_path / "src" / "tierlm" / "primitives" / "losses.py"
    losses.write_text(
        losses.read_text() + "\nfrom tierlm.stages import STAGES  # noqa: E402,F401  (upward, on purpose)\n"
    )
    result = lint_imports(tmp_path)
    assert result.returncode != 0 and "tierlm.primitives is not allowed to import tierlm.stages" in result.stdout, (
        result.stdout[-3000:]
    )
    losses.write_text(
        losses.read_text().replace("from tierlm.stages import STAGES", "import tierlm.primitives.schedules")
    )
    schedules = tmp_path / "src" / "tierlm" / "primitives" / "schedules.py"
    schedules.write_text(
        schedules.read_text() + "\nimport tierlm.primitives.losses  # noqa: E402,F401  (a circle, on purpose)\n"
    )
    result = lint_imports(tmp_path)
    assert result.returncode != 0 and "No cycles are allowed in tierlm.primitives" in result.stdout, result.stdout[
        -3000:
    ]


def _sources(outside: str | None = None) -> list[tuple[Path, str]]:
    return [
        (path, path.read_text()) for path in sorted(SRC.rglob("*.py")) if outside is None or outside not in path.parts
    ]


def test_stage_logic_lives_in_the_stages_package():
    checks = [
        f"{path.relative_to(REPO)}:{n}"
        for path, text in _sources(outside="stages")
        for n, line in enumerate(text.splitlines(), 1)
        if re.search(r"\bstage (==|!=)", line)
    ]
    assert not checks, f"stage checks outside src/tierlm/stages (a stage declares what callers need instead): {checks}"


def test_backends_and_families_are_asked_not_probed():
    """The backend protocol and the model-family protocol declare every member their callers use."""
    probe = re.compile(
        r"\b(getattr|hasattr)\((self\.)?(backend|family|trainer\.backend|critic\.backend|family_of\([^)]*\))\b"
    )
    probes = [
        f"{path.relative_to(REPO)}:{n}"
        for path, text in _sources()
        if "backends" not in path.parts and "models" not in path.parts
        for n, line in enumerate(text.splitlines(), 1)
        if probe.search(line)
    ]
    assert not probes, probes


@pytest.mark.parametrize("stage", ["pretrain", "sft", "dpo", "rl"])
def test_each_stage_reads_on_one_screen(stage):
    lines = (SRC / "stages" / f"{stage}.py").read_text().splitlines()
    assert len(lines) <= 120, f"src/tierlm/stages/{stage}.py has {len(lines)} lines"


def test_text_names_the_real_thing_not_the_design_documents():
    texts = [
        REPO / "README.md",
        *sorted((REPO / "docs").rglob("*.md")),
        *(path for path, _ in _sources()),
        *sorted((SRC / "config" / "presets").glob("*.yaml")),
        *sorted((REPO / "scripts").glob("*.sh")),
    ]
    cited = [
        f"{path.relative_to(REPO)}:{n}"
        for path in texts
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"seed[ -]00\d|training story|trainer document|design document|as in the seed\b", line, re.I)
    ]
    assert not cited, cited


def test_getting_started_prints_the_readmes_main_job():
    """docs/getting-started.md repeats the README's account of the main job (what it does, its time, its figures and
    their band): one is updated when a band is re-measured, and the other must not go on printing the old one."""

    def main_job(text: str) -> str:
        text = text.replace("(docs/benchmarks.md#", "(benchmarks.md#")  # the same link from either folder
        return text[text.index("**The main job** needs") : text.index("**Set-up details.**")]

    readme, page = (REPO / "README.md").read_text(), (REPO / "docs" / "getting-started.md").read_text()
    assert main_job(page) == main_job(readme)


def test_no_compatibility_aliases_for_old_module_names():
    """The CLI, config keys, run folders and checkpoints are the public surface; module names of earlier layouts
    are not kept alive by aliases (a meta-path finder, module `__getattr__` tables)."""
    assert not hasattr(tierlm, "_MOVED")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("tierlm.memory_plan")
    aliases = [f"{path.relative_to(REPO)}" for path, text in _sources() if "\ndef __getattr__(name" in text]
    assert not aliases, aliases


def test_no_folder_is_named_build_so_every_doctest_is_collected(pytestconfig):
    """pytest's norecursedirs (by default: `build`, `dist`, `.*`, ...) skips every folder it matches, and other tools
    take a `build` folder for build output: no folder of the package matches, so the tier-2 builders' doctests
    (`builders/`) are collected with the rest."""
    import fnmatch

    patterns = pytestconfig.getini("norecursedirs")
    skipped = [
        str(path.relative_to(SRC))
        for path in SRC.rglob("*")
        if path.is_dir() and path.name != "__pycache__" and any(fnmatch.fnmatch(path.name, p) for p in patterns)
    ]
    assert "build" in patterns and not skipped, skipped


def test_the_command_line_answers_help_without_importing_torch():
    """`tierlm --help`, `tierlm COMMAND --help` and `tierlm config ...` import no torch (it takes seconds): the
    command table names each command's module, imported only for the command that runs; and the table's stage
    commands are `tierlm.stages.STAGES`, named without importing them."""
    from tierlm.commands.cli import COMMANDS, STAGE_COMMANDS
    from tierlm.stages import STAGES

    assert STAGE_COMMANDS == tuple(STAGES)
    modules = sorted({listing.command.partition(":")[0] for listing in COMMANDS.values()})
    probe = (
        "import sys, importlib\n"
        "from tierlm.commands.cli import COMMANDS, build_parser\n"
        f"for module in {modules!r}: importlib.import_module(module)\n"
        "build_parser()\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_building_a_model_imports_no_torch_dynamo():
    """A model built for `tierlm sample/chat/serve` skips the modules' own initialisation on the meta device and
    gets its storage by `torch.empty` (`tierlm.primitives.models.meta_device`, `materialize`): on meta tensors
    `normal_` and `empty_like` run through torch's reference ops, whose first use imports torch._dynamo, sympy and
    torch's symbolic shapes (1.6-2.3 s of the command's start). The weights, and the random state after them, are those
    of the same build under a plain `torch.device("meta")` and `to_empty`."""
    probe = (
        "import sys, torch\n"
        "from tierlm.models.gpt.model import GPT, GPTConfig, build_gpt\n"
        "config = GPTConfig(depth=2, aspect_ratio=32, head_dim=16, vocab_size=97, max_seq_len=64)\n"
        "torch.manual_seed(0)\n"
        "built, after = build_gpt(config), torch.rand(3)\n"
        "print(any(m in sys.modules for m in ('torch._dynamo', 'sympy', 'torch.fx.experimental.symbolic_shapes')))\n"
        "torch.manual_seed(0)\n"
        "with torch.device('meta'):\n"
        "    plain = GPT(config)\n"
        "plain = plain.to_empty(device='cpu'); plain.tie_weights(); plain.init_weights()\n"
        "same = all(torch.equal(a, b) for a, b in zip(built.state_dict().values(), plain.state_dict().values()))\n"
        "print(same and torch.equal(after, torch.rand(3)))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "True"], out.stdout + out.stderr[-2000:]


def test_a_warning_raised_from_tierlms_code_fails_the_test():
    """pyproject's filterwarnings: a warning attributed to a tierlm module (its own, or a library's warning about the
    tierlm line that called it) is an error in the suite; a library's warning about its own code is not."""
    import warnings

    with pytest.raises(UserWarning, match="from tierlm"):
        warnings.warn_explicit("from tierlm", UserWarning, "src/tierlm/loops/trainer.py", 1, module="tierlm.loops")
    with pytest.raises(FutureWarning):
        warnings.warn_explicit("deprecated", FutureWarning, "src/tierlm/models/gpt/model.py", 1, module="tierlm")
    with warnings.catch_warnings(record=True) as seen:
        warnings.warn_explicit("from a library", UserWarning, "site-packages/other.py", 1, module="other")
    assert [str(w.message) for w in seen] == ["from a library"]


def test_the_test_command_measures_and_prints_coverage():
    """scripts/test.sh runs both parts of the suite under coverage.py (pytest-cov) and prints the total with the
    modules under half covered (scripts/coverage_summary.py), whatever the suite's outcome."""
    script = (REPO / "scripts" / "test.sh").read_text()
    runs = [line for line in script.splitlines() if "-m pytest" in line and "-n 2" in line or "-m serial" in line]
    assert len(runs) == 2 and all("--cov" in line for line in runs), runs
    assert "--cov-append" in runs[1] and "scripts/coverage_summary.py" in script.split(runs[1], 1)[1]
    # The serial part collects only the files that spell `pytest.mark.serial`: no test is marked another way.
    assert '< <(grep -l "pytest.mark.serial" tests/test_*.py)' in script
    for path in [*(REPO / "tests").rglob("*.py"), *(REPO / "src").rglob("*.py")]:
        assert not re.search(r"mark\.serial\b(?<!pytest\.mark\.serial)|add_marker\(.*serial", path.read_text()), path


def test_the_version_line_names_tierlm_torch_and_transformers_without_importing_them():
    """`tierlm --version`: one line for a bug report, made without importing torch or transformers (seconds)."""
    from importlib.metadata import version

    import tierlm

    probe = (
        "import sys\n"
        "from tierlm.commands.cli import main\n"
        "try:\n    main(['--version'])\nexcept SystemExit as e:\n    assert e.code in (0, None), e.code\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    line, imported = out.stdout.strip().splitlines()
    assert line.startswith(f"tierlm {tierlm.__version__}") and imported == "[]"
    assert f"torch {version('torch')}, transformers {version('transformers')}, Python " in line


def test_the_commit_is_tierlms_own_or_none(tmp_path):
    """`source_commit` names the checkout tierlm runs from, and nothing for a copy installed in a virtual
    environment inside another project's repository (that repository's commit is not tierlm's)."""
    import shutil

    from tierlm.version import source_commit

    if (REPO / ".git").exists():
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        assert source_commit() == head.stdout.strip()
    other = tmp_path / "project"
    installed = other / ".venv" / "lib" / "site-packages" / "tierlm"
    installed.mkdir(parents=True)
    shutil.copy(SRC / "version.py", installed / "version.py")
    for command in (
        ["init", "-q"],
        ["-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "--allow-empty", "-m", "x"],
    ):
        subprocess.run(["git", *command], cwd=other, check=True, capture_output=True)
    probe = "import runpy, sys; print(runpy.run_path(sys.argv[1])['source_commit']())"
    out = subprocess.run([sys.executable, "-c", probe, installed / "version.py"], capture_output=True, text=True)
    assert out.stdout.strip() == "None", out
