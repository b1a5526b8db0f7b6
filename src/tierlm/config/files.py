"""Reading configs: YAML files and shipped presets, `key=value` overrides (OmegaConf), and the one
line that explains a validation error (`tierlm.config` holds the sections themselves)."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from tierlm.config.aliases import alias_overrides, other_name_hint, translate_aliases
from tierlm.errors import ConfigError, first_line


def read_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The raw config of `path` (YAML, or a preset's name; None: empty) with `key=value` overrides
    merged in and interpolations resolved; every problem is one ConfigError line."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    base = OmegaConf.create({})
    if path is not None:
        path = resolve_config_path(path)
        if path.is_dir():
            raise ConfigError(f"config {path} is a folder, not a file")
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path} is not UTF-8 text (byte {e.start}); a config is a YAML file") from None
        except OSError as e:
            raise ConfigError(f"cannot read config {path}: {e.strerror or e}") from None
        try:
            parsed = yaml.safe_load(text)
            if parsed is not None and not isinstance(parsed, dict):
                raise ConfigError(f"{path} must hold a mapping of sections (model, data, training, infra, ...)")
            base = OmegaConf.create(text) if parsed else OmegaConf.create({})  # OmegaConf's YAML: 3e-4 is a float
            base = OmegaConf.create(translate_aliases(OmegaConf.to_container(base)))  # the file's own names first
        except (yaml.YAMLError, OmegaConfBaseException) as e:
            raise ConfigError(f"{path} is not valid YAML: {first_line(e)}") from None
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} must look like section.key=value")
    named = alias_overrides(overrides)  # an override in the other names wins over the file's
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(named))
        raw = OmegaConf.to_container(merged, resolve=True)
    except (OmegaConfBaseException, yaml.YAMLError, ValueError) as e:
        raise ConfigError(f"cannot apply overrides {' '.join(overrides)}: {first_line(e)}") from None
    overridden = {item.partition("=")[0] for item in overrides}
    if "training.eval_samples" in overridden and "training.eval_batches" not in overridden:
        raw.get("training", {}).pop("eval_batches", None)  # the override's eval_samples replaces the file's batches
    return raw


PRESETS_DIR = Path(__file__).parent / "presets"
LAUNCHER_PREFIX = "accelerate_"
"""Shipped beside the presets (configs/), for `accelerate launch --config_file`: Accelerate's configs, not tierlm's."""


def list_presets() -> dict[str, str]:
    """{preset name: its first comment line} for the YAML configs shipped inside the package.

    >>> "tiny_pretrain" in list_presets()
    True
    """
    presets = {}
    for path in sorted(PRESETS_DIR.glob("*.yaml")):
        if path.stem.startswith(LAUNCHER_PREFIX):
            continue
        first = path.read_text(encoding="utf-8").splitlines()[0] if path.stat().st_size else ""
        presets[path.stem] = first.lstrip("# ").strip()
    return presets


def resolve_config_path(name: str | Path) -> Path:
    """A config file as given, or else the shipped preset of that name (`--config gpt2-shakespeare-char`)."""
    path = Path(name)
    preset = PRESETS_DIR / (path.name if path.suffix == ".yaml" else f"{path.name}.yaml")
    launcher = path if path.exists() else preset
    if launcher.resolve().parent == PRESETS_DIR.resolve() and launcher.stem.startswith(LAUNCHER_PREFIX):
        raise ConfigError(
            f"{launcher.name} is Accelerate's launcher config, not tierlm's: pass it as `accelerate launch "
            f"--config_file configs/{launcher.name} -m tierlm ...` with a tierlm --config"
        )
    if path.exists():
        return path
    if path.parent == Path(".") and preset.is_file():
        return preset
    if path.parent == Path(".") and path.suffix != ".yaml":
        raise ConfigError(
            f"config {name} is neither a file nor a preset; presets: {', '.join(list_presets())} (tierlm config list)"
        )
    return path


def _known_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key of `model`, sections included ("training", "training.seed", ...)."""
    keys = []
    for name, field in model.model_fields.items():
        keys.append(f"{prefix}{name}")
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys += _known_keys(annotation, f"{prefix}{name}.")
    return keys


def describe_error(error: dict, root: type[BaseModel]) -> str:
    """One line for pydantic's first validation error of a config of class `root`."""
    key = ".".join(str(part) for part in error["loc"])
    value, kind, ctx = error.get("input"), error["type"], error.get("ctx") or {}
    if kind == "extra_forbidden":
        if hint := other_name_hint(key):
            return f"unknown key {key} ({hint})"
        known = _known_keys(root)
        # The same name in another section (training.output_dir: infra.output_dir), else a near spelling.
        elsewhere = [k for k in known if k.rpartition(".")[2] == key.rpartition(".")[2] and k != key][:3]
        same_depth = [k for k in known if k.count(".") == key.count(".")]
        close = elsewhere or difflib.get_close_matches(key, same_depth, n=1, cutoff=0.6)
        return f"unknown key {key}" + (f" (did you mean {' or '.join(close)}?)" if close else "")
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        limit = next(iter(ctx.values()))
        return f"{key} must be {bounds[kind]} {limit}, got {value!r}"
    if kind == "literal_error":
        return f"{key} must be one of {ctx.get('expected')}, got {value!r}"
    if kind == "value_error":
        return str(ctx.get("error", error["msg"]))
    msg = error["msg"]
    return f"{key}: {msg[:1].lower() + msg[1:]}, got {value!r}"
