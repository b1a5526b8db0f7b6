"""Tier 3: `tierlm push RUN --repo ORG/NAME` — a run's final model on the Hugging Face Hub, with a model
card written from the run (what was trained, on what, the last evaluation, the report's plots).

The upload is staged in a temporary folder (the verified model files, `README.md` — the card — and
`plots/*.png`, the run's or, for a run that drew none, drawn from its metrics) and sent with `huggingface_hub`'s
`create_repo` + `upload_folder`; `--dry-run` prints the files and the card and sends nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
from pathlib import Path

from tierlm.commands.options import Command
from tierlm.errors import ConfigError, DataError

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


def usage(repo: str, transformers_ready: bool, native: bool) -> list[str]:
    """The card's lines of Python that load the model from the Hub.

    >>> usage("me/tiny", True, False)[1]
    'model = AutoModelForCausalLM.from_pretrained("me/tiny")'
    """
    if transformers_ready:
        return [
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            f'model = AutoModelForCausalLM.from_pretrained("{repo}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{repo}")',
        ]
    return [
        "from huggingface_hub import snapshot_download",
        "from tierlm.models import load_pretrained_model",
        f'model = load_pretrained_model(snapshot_download("{repo}"))'
        + ("  # a tierlm model family (no transformers class represents it)" if native else ""),
    ]


def model_card(run_dir: Path, model_dir: Path, repo: str, plots: list[Path] = ()) -> str:
    """The card: front matter the Hub reads, then what the run was and how it did, with `plots` (staged PNGs)."""
    from tierlm.metrics.report import read_metrics
    from tierlm.models import is_native_folder

    run = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").is_file() else {}
    records = read_metrics(run_dir)
    last_eval = next((r for r in reversed(records) if r.get("type") == "eval"), {})
    last_train = next((r for r in reversed(records) if r.get("type") == "train"), {})
    fingerprint = run.get("fingerprint", {})
    transformers_ready = (model_dir / "config.json").is_file()
    lines = [
        "---",
        f"library_name: {'transformers' if transformers_ready else 'tierlm'}",
        "tags:",
        "- tierlm",
        f"- {run.get('stage', 'model')}",
        *(
            [f"datasets:\n- {fingerprint['data.dataset_name']}"]
            if str(fingerprint.get("data.dataset_name", "")).count("/") == 1
            else []
        ),
        "---",
        "",
        f"# {repo.split('/')[1]}",
        "",
        f"Trained with [tierlm](https://github.com/) ({run.get('stage', '?')} stage, {last_train.get('step', '?')} "
        f"steps" + (f", {last_train['tokens_seen']:,} tokens" if "tokens_seen" in last_train else "") + ").",
        "",
        "## Training",
        "",
        "| | |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in fingerprint.items() if k != "stage"],
        "",
    ]
    if last_eval:
        lines += [
            "## Evaluation (last)",
            "",
            "| | |",
            "|---|---|",
            *[
                f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |"
                for k, v in last_eval.items()
                if k not in ("type",)
            ],
            "",
        ]
    if plots:
        lines += ["## Curves", "", *[f"![{p.stem}](plots/{p.name})" for p in plots], ""]
    lines += ["## Use", "", "```python", *usage(repo, transformers_ready, is_native_folder(model_dir)), "```", ""]
    if (run_dir / "config.yaml").is_file():
        lines += ["## Config", "", "```yaml", (run_dir / "config.yaml").read_text().rstrip(), "```", ""]
    return "\n".join(lines)


def stage_upload(run: str | Path, repo: str, into: Path) -> tuple[Path, list[tuple[str, int]]]:
    """The folder to upload (model files, README.md, plots/) and its (path, bytes) list."""
    from tierlm.checkpoint.folders import verified_model_folder

    if not REPO_ID.match(repo):
        raise ConfigError(f"--repo {repo!r} is not a Hub repository id: ORG/NAME (letters, digits, '.', '_', '-')")
    model_dir = verified_model_folder(run)
    run_dir = model_dir.parent if model_dir.name == "model" else Path(run)
    shutil.copytree(model_dir, into, ignore=shutil.ignore_patterns("adapter"), dirs_exist_ok=True)
    if (run_dir / "plots").is_dir():
        shutil.copytree(run_dir / "plots", into / "plots", dirs_exist_ok=True)
    elif (run_dir / "metrics.jsonl").is_file():  # a run that drew no report as it went (TIERLM_REPORT=off)
        from tierlm.metrics.report import draw_panels, read_metrics

        draw_panels({run_dir.name: read_metrics(run_dir)}, into / "plots")
    plots = sorted((into / "plots").glob("*.png"))
    (into / "README.md").write_text(model_card(run_dir, model_dir, repo, plots), encoding="utf-8")
    files = sorted((str(p.relative_to(into)), p.stat().st_size) for p in into.rglob("*") if p.is_file())
    return into, files


def push(run: str | Path, repo: str, private: bool = False, dry_run: bool = False, token: str | None = None) -> str:
    """Upload the run's model with its card; returns what was done (the dry run: the plan)."""
    with tempfile.TemporaryDirectory(prefix="tierlm_push_") as tmp:
        folder, files = stage_upload(run, repo, Path(tmp) / "upload")
        listing = "\n".join(f"  {name}  ({size:,} bytes)" for name, size in files)
        if dry_run:
            card = (folder / "README.md").read_text()
            where = f"https://huggingface.co/{repo} ({'private' if private else 'public'})"
            return f"would upload to {where}:\n{listing}\n\n--- README.md ---\n{card}"
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError

        from tierlm.primitives.hub import require_hub

        require_hub("tierlm push")  # one line on a machine without the Hub (--dry-run still shows the plan)
        api = HfApi(token=token)
        try:
            api.create_repo(repo, private=private, exist_ok=True)
            commit = api.upload_folder(folder_path=str(folder), repo_id=repo, commit_message="Upload a tierlm model")
        except (HfHubHTTPError, OSError) as e:
            raise DataError(
                f"could not push to {repo}: {str(e).splitlines()[0]} (log in with `hf auth login`, or try --dry-run)"
            ) from None
        return f"pushed {len(files)} files to {getattr(commit, 'repo_url', repo)}"


# -- the command ----------------------------------------------------------------------------
def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="a run directory, checkpoint or model folder")
    parser.add_argument("--repo", required=True, help="ORG/NAME on the Hub")
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="print the files and the model card; send nothing")


def run(args: argparse.Namespace) -> None:
    print(push(args.run, args.repo, private=args.private, dry_run=args.dry_run))


COMMAND = Command(arguments, run)
