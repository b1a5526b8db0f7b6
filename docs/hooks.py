"""MkDocs hook: the pages' generated parts, written from the code itself so they cannot drift — the configuration
reference (the typed sections), the RL and preference loss tables (their rows), the stages and the commands.

A page asks for one with a marker line, e.g. `<!-- tierlm:config-reference -->`.
"""

from __future__ import annotations


def _config_reference() -> str:
    from tierlm.config.reference import markdown

    return markdown()


def _clip(row) -> str:
    from tierlm.strategies.rl_losses import UNSET

    if row.clip is UNSET:
        return "rl.clip_range both ways"
    low, high = row.clip
    return "none" if low is None and high is None else f"{low if low is not None else '-'} / {high}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _rl_losses() -> str:
    from tierlm.strategies.rl_losses import RL_LOSSES

    def yes(flag) -> str:
        return "yes" if flag else "no"

    rows = [
        [f"`{name}`", row.about, row.normalise, _clip(row), yes(row.divides_by_std), row.baseline]
        + ["on" if row.dynamic_sampling else "off", yes(row.jax)]
        for name, row in RL_LOSSES.items()
    ]
    header = ["`rl.loss`", "what it is", "averages over", "clip (low / high)", "std", "baseline"]
    return _table([*header, "dynamic sampling", "JAX"], rows)


def _preference_losses() -> str:
    from tierlm.strategies.preference_losses import PREFERENCE_LOSSES

    rows = [
        [f"`{name}`", row.about, "yes" if row.reference else "none", "averaged" if row.averaged else "summed"]
        + ["pairs" if row.paired else "unpaired replies", "yes" if row.jax else "no"]
        for name, row in PREFERENCE_LOSSES.items()
    ]
    return _table(["`dpo.loss_type`", "what it is", "reference model", "log-probs", "data", "JAX"], rows)


def _stages() -> str:
    from tierlm.commands.cli import COMMANDS
    from tierlm.stages import STAGES

    rows = [
        [f"`{name}`", f"`tierlm {name}`", COMMANDS[name].about]
        + ["a trained chat model" if stage.starts_from_trained else "scratch or any model"]
        for name, stage in STAGES.items()
    ]
    return _table(["stage", "command", "what it does", "starts from"], rows)


GENERATED = {
    "config-reference": _config_reference,
    "rl-losses": _rl_losses,
    "preference-losses": _preference_losses,
    "stages": _stages,
}


def on_page_markdown(markdown: str, page, config, files) -> str:
    for name, write in GENERATED.items():
        marker = f"<!-- tierlm:{name} -->"
        if marker in markdown:
            markdown = markdown.replace(marker, write())
    return markdown
