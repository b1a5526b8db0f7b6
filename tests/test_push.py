"""`tierlm push` (issue 20): the upload staged from a run — its verified model files, a model card
written from the run, the report's plots — printed by --dry-run, sent through huggingface_hub's
create_repo + upload_folder (recorded here, never sent), and loadable as the card says."""

from __future__ import annotations

from tierlm.commands.cli import main
from tierlm.commands.push import stage_upload


def test_a_dry_run_prints_the_files_and_the_card(tiny_runs, capsys):
    assert main(["push", str(tiny_runs / "sft"), "--repo", "me/tiny-chat", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would upload to https://huggingface.co/me/tiny-chat (public)" in out
    for name in ("model.safetensors", "config.json", "tokenizer.json", "README.md", "plots/loss_steps.png"):
        assert f"  {name}  (" in out, name
    assert "library_name: transformers" in out and "## Evaluation (last)" in out and "val_loss" in out
    assert (
        "![loss_steps](plots/loss_steps.png)" in out and 'AutoModelForCausalLM.from_pretrained("me/tiny-chat")' in out
    )


def test_the_staged_folder_loads_as_the_card_says(tiny_runs, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from tierlm.models import load_pretrained_model

    folder, files = stage_upload(tiny_runs / "sft", "me/tiny-chat", tmp_path / "upload")
    ids = torch.randint(0, 100, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(
            AutoModelForCausalLM.from_pretrained(folder)(ids).logits,
            load_pretrained_model(tiny_runs / "sft" / "model")(ids),
            atol=1e-4,
            rtol=0,
        )


def test_a_push_creates_the_repo_and_uploads_the_staged_folder(tiny_runs, monkeypatch):
    import huggingface_hub

    from tierlm.commands.push import push

    calls = []

    class StandIn:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, private=False, exist_ok=False):
            calls.append(("create_repo", repo_id, private, exist_ok))

        def upload_folder(self, folder_path, repo_id, commit_message):
            from pathlib import Path

            calls.append(("upload_folder", repo_id, sorted(p.name for p in Path(folder_path).iterdir())))
            return type("Commit", (), {"repo_url": f"https://huggingface.co/{repo_id}"})()

    monkeypatch.setattr(huggingface_hub, "HfApi", StandIn)
    monkeypatch.setattr("tierlm.primitives.hub.hub_reachable", lambda: True)  # the suite runs offline
    assert push(tiny_runs / "sft", "me/tiny-chat", private=True).startswith("pushed ")
    assert calls[0] == ("create_repo", "me/tiny-chat", True, True)
    assert calls[1][0] == "upload_folder" and {"README.md", "model.safetensors", "plots"} <= set(calls[1][2])
