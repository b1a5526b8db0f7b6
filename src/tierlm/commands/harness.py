"""Tier 3: `tierlm eval --harness TASKS --checkpoint RUN` — EleutherAI's lm-evaluation-harness on a tierlm model.

The harness gets the model as one of its own language models, `TierlmLM` (an `lm_eval` `TemplateLM`: its
documented extension point), built on tierlm's loading and family hooks, so every family is evaluated the
same way: the native GPT, GPT-2 and its research variants (which no transformers class holds), transformers
folders, and the encoder–decoder (the context goes to the encoder after [S], the continuation is scored by
the decoder). A decoder-only model sees every context after the document separator it was pretrained
after. Results are printed as the harness's table; for a run directory they are also appended to its
metrics.jsonl (`type: harness`, at the run's last step), written in full to `harness.json`, and shown in
its report.md.

Tasks are the harness's (`hellaswag`, `arc_easy`, ... — their datasets come from the Hub) or your own YAML
tasks in `--include-path DIR` (a local `dataset_path: json` task works offline).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.metadata
import importlib.util
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from tierlm.errors import ConfigError, DataError, first_line
from tierlm.primitives import cache

try:  # the harness is an optional dependency (pip install 'tierlm[eval]'); `run_harness` says so when missing
    from lm_eval.api.model import TemplateLM
except ImportError:  # pragma: no cover - exercised only without the extra
    TemplateLM = object


class TierlmLM(TemplateLM):
    """A tierlm model (any family) as an lm-evaluation-harness language model.

    `loglikelihood` (multiple choice), `loglikelihood_rolling` (perplexity; decoder-only models) and
    `generate_until` (greedy unless the task samples, through tierlm's KV-cache `Engine`), batched
    `batch_size` sequences at a time, longest first, left-truncated to the model's length.
    """

    def __init__(self, model: torch.nn.Module, tokenizer, batch_size: int = 8, max_length: int | None = None):
        from tierlm.models import family_of, model_max_seq_len

        super().__init__()
        self.model, self.tokenizer, self.batch_size = model.eval(), tokenizer, batch_size
        self.family = family_of(model)
        self.seq2seq = self.family.seq2seq
        self.backend = "seq2seq" if self.seq2seq else "causal"
        self.max_length = max_length or model_max_seq_len(model) or 2048
        self._device = next(model.parameters()).device

    # -- tokens ---------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        """Where a generated text ends for a base model: the next document's separator."""
        return self.tokenizer.document_separator_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is: the document separator, or [S] (prefix LM) for the encoder."""
        if self.seq2seq:
            from tierlm.data.ul2 import MODE_TOKENS

            return self.tokenizer.hf.convert_tokens_to_ids(MODE_TOKENS["S"])
        return self.tokenizer.document_separator_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """The text's tokens, after the prefix token unless `add_special_tokens` is False."""
        tokens = self.tokenizer.encode(string)
        if add_special_tokens is False or tokens[:1] == [self.prefix_token_id]:
            return tokens
        return [self.prefix_token_id, *tokens]

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    # -- scoring --------------------------------------------------------------------------------
    def _batch_logprobs(self, rows: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding gives the continuation) per row."""
        pad = self.tokenizer.pad_id
        if self.seq2seq:
            contexts = [ctx for ctx, _ in rows]
            targets = [cont for _, cont in rows]
            decoder_in = [[self.model.config.decoder_start_token_id, *cont[:-1]] for cont in targets]
            batch = {
                "input_ids": self._pad(contexts, pad),
                "decoder_input_ids": self._pad(decoder_in, pad),
                "encoder_segment_ids": self._pad([[1] * len(c) for c in contexts], 0),
                "decoder_segment_ids": self._pad([[1] * len(d) for d in decoder_in], 0),
            }
            starts = [0] * len(rows)
        else:
            inputs = [(ctx + cont)[:-1] for ctx, cont in rows]
            batch, targets = {"input_ids": self._pad(inputs, pad)}, [cont for _, cont in rows]
            starts = [len(i) - len(t) for i, t in zip(inputs, targets)]
        with torch.no_grad():
            logits = self.family.logits(self.model, batch)
        out = []
        for row, (start, target) in enumerate(zip(starts, targets)):
            scores = logits[row, start : start + len(target)].float().log_softmax(-1)  # only the scored positions
            target_ids = torch.as_tensor(target, device=scores.device)
            out.append(
                (float(scores.gather(-1, target_ids[:, None]).sum()), bool((scores.argmax(-1) == target_ids).all()))
            )
        return out

    def _pad(self, rows: list[list[int]], fill: int) -> torch.Tensor:
        out = torch.full((len(rows), max(map(len, rows))), fill, dtype=torch.long)
        for i, row in enumerate(rows):
            out[i, : len(row)] = torch.as_tensor(row)
        return out.to(self.device)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        from tqdm.auto import tqdm

        rows = []
        for _, context, continuation in requests:
            assert continuation, "the harness asked to score an empty continuation"
            if self.seq2seq:
                rows.append((context[-self.max_length :], continuation[: self.max_length]))
            else:  # keep the continuation whole, the context's end, within the model's length (+1: the last target)
                whole = (context + continuation)[-(self.max_length + 1) :]
                rows.append((whole[: len(whole) - len(continuation)], whole[len(whole) - len(continuation) :]))
        order = sorted(range(len(rows)), key=lambda i: -sum(map(len, rows[i])))
        results: list[tuple[float, bool] | None] = [None] * len(rows)
        for first in tqdm(range(0, len(order), self.batch_size), disable=disable_tqdm, desc="tierlm loglikelihood"):
            chunk = order[first : first + self.batch_size]
            for i, answer in zip(chunk, self._batch_logprobs([rows[i] for i in chunk])):
                results[i] = answer
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        if self.seq2seq:
            raise ConfigError(
                "perplexity tasks (loglikelihood_rolling) need a decoder-only model; this one is an encoder-decoder"
            )
        out = []
        for request in requests:
            tokens = self.tok_encode(request.args[0], add_special_tokens=False)
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1
                )
            ]
            total = sum(
                score for score, _ in self._loglikelihood_tokens([(None, c, t) for c, t in windows], disable_tqdm=True)
            )
            self.cache_hook.add_partial("loglikelihood_rolling", (request.args[0],), total)
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from tierlm.rollout.engine import Engine
        from tierlm.rollout.sampling import SamplingParams

        engine = Engine(self.model, sorted({*self.tokenizer.stop_ids, self.eot_token_id}), self.tokenizer)
        out = []
        for request in requests:
            context, options = request.args
            options = dict(options or {})
            until = options.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(options.get("max_gen_toks", 256))
            temperature = float(options.get("temperature", 0.0)) if options.get("do_sample", False) else 0.0
            prompt = self.tok_encode(context)[-max(1, self.max_length - max_new) :]
            tokens = engine.generate(prompt, 1, max_new, SamplingParams(temperature))[0].tokens
            text = self.tokenizer.decode([t for t in tokens if t not in engine.stop_ids], skip_special_tokens=True)
            for stop in until:
                text = text.split(stop)[0] if stop else text
            self.cache_hook.add_partial("generate_until", (context, request.args[1]), text)
            out.append(text)
        return out

    # -- chat models (--chat-template) ----------------------------------------------------------
    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer.hf, "name_or_path", "tierlm").replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.tokenizer.hf, "chat_template", None) if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.hf.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )


def task_files(folders: list[Path]) -> str:
    """A fingerprint of the task files under `folders`: each YAML and Python file's path, size and modification time
    (what the harness's index is built from; its data files and `__pycache__` are not read)."""
    stamp = hashlib.sha256()
    for folder in folders:
        for root, dirs, files in os.walk(folder):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(n for n in files if n.endswith((".yaml", ".yml", ".py"))):
                status = os.stat(os.path.join(root, name))
                stamp.update(f"{root}/{name} {status.st_size} {status.st_mtime_ns}\n".encode())
    return stamp.hexdigest()


def task_manager(include_path: str | None):
    """The harness's `TaskManager` over its own tasks and `include_path`'s, kept on disk. Building its index reads
    every task YAML the harness ships (14,659 files: 10.6 s on a quiet Xeon, 37 s on a busy 2-core EPYC) before one
    task name can be checked, and the index stays the same until lm-eval or the task files change: it is kept
    pickled (`tierlm.primitives.cache`, `harness-tasks/`: one file per lm-eval version and include path, 16 MB),
    with the fingerprint of the task files (`task_files`), and read back (about a second) while that still holds."""
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    folders = [Path(lm_eval.tasks.__file__).parent, *([Path(include_path).resolve()] if include_path else [])]
    include = [str(f) for f in folders[1:]] or None  # absolute: read back from anywhere
    folder = cache.cache_folder("harness-tasks")
    if folder is None:  # TIERLM_CACHE_DIR=off: nothing kept, nothing fingerprinted
        return TaskManager(include_path=include)
    version = importlib.metadata.version("lm_eval")
    stamp = f"{version} {task_files(folders)}"
    path = folder / f"{hashlib.sha256(f'{version} {folders[1:]}'.encode()).hexdigest()[:16]}.pickle"
    if path.is_file():
        try:
            kept, manager = pickle.loads(path.read_bytes())
            if kept == stamp and isinstance(manager, TaskManager):
                return manager
        except Exception:  # a file from another lm-eval, or cut short: built afresh below
            pass
    manager = TaskManager(include_path=include)
    cache.keep(path, pickle.dumps((stamp, manager)))
    return manager


def check_tasks(tasks: list[str], include_path: str | None):
    """The harness's TaskManager (`task_manager`), after refusing names it does not know (one line, with the
    closest)."""
    if include_path is not None and not Path(include_path).is_dir():
        raise ConfigError(f"--include-path {include_path} is not a folder of task YAML files")
    manager = task_manager(include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        close = {t: difflib.get_close_matches(t, manager.all_tasks, n=3) for t in unknown}
        hints = "; ".join(f"{t!r}" + (f" (did you mean {', '.join(c)}?)" if c else "") for t, c in close.items())
        raise ConfigError(
            f"the evaluation harness has no task {hints}: `python -m lm_eval ls tasks` lists them, "
            "--include-path DIR adds your own YAML tasks"
        )
    return manager


def summarize(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} of the harness's results (numbers only; `acc,none` becomes `acc`)."""
    return {
        task: {
            metric.replace(",none", ""): float(value)
            for metric, value in scores.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and metric != "sample_len"
        }
        for task, scores in results.get("results", {}).items()
    }


def run_harness(
    checkpoint: str | Path,
    tasks: list[str],
    *,
    limit: float | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    include_path: str | None = None,
    chat_template: bool = False,
    device_type: str = "cpu",
    seed: int = 0,
    bootstrap_iters: int = 1000,
) -> tuple[dict[str, dict[str, float]], str]:
    """Evaluate a run / checkpoint / model folder on harness `tasks`; ({task: {metric: value}}, the table).
    A run directory also gets the results in its metrics.jsonl, harness.json and report.md. `bootstrap_iters`:
    the harness's resampling for standard errors of metrics with no closed form (perplexity, F1, ...)."""
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError("the evaluation harness is not installed: pip install 'tierlm[eval]' (lm_eval)")
    from datasets.exceptions import DatasetNotFoundError
    from lm_eval import simple_evaluate
    from lm_eval.utils import make_table

    from tierlm.checkpoint.folders import verified_model_location
    from tierlm.data import load_tokenizer
    from tierlm.metrics.report import run_of
    from tierlm.models import load_pretrained_model
    from tierlm.primitives import resolve_device
    from tierlm.primitives.hub import hub_reachable

    location = verified_model_location(str(checkpoint))
    manager = check_tasks(tasks, include_path)
    hub_reachable()  # without the Hub, the tasks' datasets come from the local cache only (no minute of retries)
    tokenizer = load_tokenizer(location)
    if chat_template and not tokenizer.has_chat_template:
        raise ConfigError(f"{checkpoint} has no chat template: --chat-template needs a model after `tierlm sft`")
    model = load_pretrained_model(location, device=resolve_device(device_type))
    lm = TierlmLM(model, tokenizer, batch_size=batch_size)
    try:
        results = simple_evaluate(
            model=lm,
            tasks=list(tasks),
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=manager,
            log_samples=False,
            apply_chat_template=chat_template,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
            bootstrap_iters=bootstrap_iters,
        )
    except (ConnectionError, FileNotFoundError, DatasetNotFoundError) as e:
        raise DataError(
            f"a task's dataset cannot be read: {first_line(e)} (Hub datasets need the network once, then the "
            "datasets cache; local tasks: --include-path DIR with dataset_path: json)"
        ) from e
    assert results is not None, "simple_evaluate returned nothing on the main process"
    summary = summarize(results)
    run = run_of(location)
    if run is not None:
        record_results(run, results, summary, limit=limit, num_fewshot=num_fewshot)
    return summary, make_table(results)


def record_results(run_dir: Path, results: dict[str, Any], summary: dict[str, dict[str, float]], **settings) -> None:
    """The run's metrics.jsonl gets a `harness` line at its last step; harness.json the full results; report.md is
    rebuilt."""
    from tierlm.metrics.report import record_evaluation

    record = {"type": "harness", "tasks": summary, **{k: v for k, v in settings.items() if v is not None}}
    keys = ("results", "groups", "versions", "n-shot", "higher_is_better", "n-samples")
    record_evaluation(run_dir, record, "harness.json", {k: results[k] for k in keys if k in results})
