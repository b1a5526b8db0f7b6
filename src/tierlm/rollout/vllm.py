"""Rollouts sampled by vLLM, with the trainer's weights pushed in after every optimizer step.

Two ways to reach vLLM, one engine (`VLLMEngine`, the interface of `tierlm.rollout.engine.Engine`):

- *in this process* (`engine.vllm_url` unset): `vllm.LLM` beside the trainer; new weights go in through vLLM's
  in-place `reload_weights` worker call (it redoes the CPU backend's weight repacking, where a bare
  `model.load_weights` fails), and on a GPU the engine sleeps during training to give back its KV cache.
  vLLM pins its own torch and transformers: tierlm runs from vLLM's environment (`scripts/setup_vllm.sh`).
- *a vLLM server* (`engine.vllm_url=http://host:port`, started by `scripts/vllm_server.sh`): prompts go to its
  OpenAI completions API as token ids; weights are handed over as a safetensors folder the server reloads
  (`/collective_rpc reload_weights`, as prime-rl does where there is no NCCL), then the server's weight
  version is set and read back, so a rollout never comes from weights other than the ones it is stamped with
  (`tierlm.rollout.vllm_server`).

Every completion records the weight version it was sampled with. Sampling randomness comes from the caller's
generator (one draw per request seeds vLLM), so a run samples the same rollouts whenever it is repeated.
Log-probs are vLLM's `processed_logprobs`: after temperature, as the trainer computes them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from torch import nn

from tierlm.errors import ConfigError, DataError, first_line
from tierlm.models import family_of, unwrap_model
from tierlm.models.io import save_model_config
from tierlm.models.lora import has_lora, lora_layers, lora_scalings, merged_state, save_adapter, split_state
from tierlm.rollout.adapters import ADAPTER_VERSION, adapter_payload, stamped_adapters
from tierlm.rollout.engine import Completion
from tierlm.rollout.sampling import SamplingParams
from tierlm.rollout.tools import (
    Tool,
    call_tool,
)
from tierlm.rollout.vllm_server import Adapter, VLLMServer

INSTALL_HINT = (
    "install it with `bash scripts/setup_vllm.sh` and start tierlm from that environment (.venv-vllm/bin/tierlm), "
    "or serve the model with `bash scripts/vllm_server.sh MODEL_FOLDER` and set engine.vllm_url"
)


def transformers_weights(
    model: nn.Module, state: dict[str, torch.Tensor], merge: bool = True
) -> dict[str, torch.Tensor]:
    """The policy's weights as its transformers twin names them (LoRA adapters merged into the base; with `merge`
    False, the base alone: vLLM applies the adapters as a LoRA adapter of its own)."""
    if has_lora(model):
        base, adapter = split_state(state)
        state = merged_state(base, adapter, lora_scalings(model)) if merge else base
    return {k: v.detach().contiguous().cpu() for k, v in family_of(model).to_hf_state(model, state).items()}


class VLLMEngine:
    """`Engine`'s interface over vLLM: `generate`, `generate_many`, `load_weights`, `max_len`, `weight_version`.

    `folder` is where the sampler's model folder is written (the server reads the weights it is handed there).
    """

    needs_state = True  # vLLM holds weights of its own: every sync hands it the policy's whole state
    takes_adapters = False  # a LoRA policy: its adapters alone, as vLLM LoRA adapters, where vLLM takes them

    def __init__(
        self,
        model: nn.Module,
        stop_ids,
        tokenizer,
        tools: list[Tool],
        folder: Path,
        max_len: int,
        url: str | None = None,
        gpu_memory_utilization: float = 0.3,
    ):
        self.model = unwrap_model(model)
        problem = family_of(self.model).exportable(self.model)
        if problem:
            raise ConfigError(
                f"engine.kind=vllm loads the policy as a transformers model, but {problem}: use engine.kind=native"
            )
        self.stop_ids, self.tokenizer, self.tools = list(stop_ids), tokenizer, {t.name: t for t in tools}
        self.device = torch.device("cpu")  # the callers' generators only seed vLLM's own
        self.weight_version = 0
        if self.tools:
            ids = tokenizer.tool_ids()
            assert ids is not None, "the tokenizer lacks the tool tokens"
            self.call_start, self.call_end, self.result_start, self.result_end = ids
        server = VLLMServer(url, max_len) if url else None  # reached (or vLLM imported) before anything is written
        self._max_len = server.max_len if server is not None else max_len
        vllm = None if url else import_vllm()
        # Under torchrun every rank sends its prompts to the one server; rank 0 alone hands the weights over.
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        # The server's version names this run (the job and its restart; one process: its pid) and its step, so a
        # version left on the server by another run or an earlier restart never passes for this one's.
        job = os.environ.get("TORCHELASTIC_RUN_ID", str(os.getpid()))
        self.tag = f"{job}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.folder = Path(folder)
        # A LoRA policy: vLLM holds the frozen base and takes each step's adapters as a LoRA adapter of its own — in
        # this process, or on a server started with --enable-lora (one trainer process; else merged weights).
        self.takes_adapters = has_lora(self.model) and (server is None or server.takes_adapters(self.rank))
        self.adapter: Adapter | None = None  # the adapters it samples with, named for their weight version
        created = self.rank == 0 and not self.folder.exists()
        try:
            if self.rank == 0:
                self.folder.mkdir(parents=True, exist_ok=True)
                save_model_config(self.model, self.folder)
                self._write_weights(self.model.state_dict())
            if server is not None:
                if self.rank == 0:
                    server.check_model(self.folder)
                self.transport = server
                if self.takes_adapters:  # the base once, then the adapters
                    server.reload(f"{self.tag}/base")
                self.load_weights(self.model.state_dict(), 0)  # the server's model becomes the policy
            else:
                cuda = next(self.model.parameters()).device.type == "cuda"
                rank = max(layer.r["default"] for _, layer in lora_layers(self.model)) if self.takes_adapters else 0
                self.transport = _InProcess(vllm, self.folder, max_len, cuda, gpu_memory_utilization, rank)
                if self.takes_adapters:  # the base is in the folder vLLM loaded: the adapters go in as version 0
                    self.load_weights(self.model.state_dict(), 0)
        except BaseException:
            if created:  # a refused engine leaves nothing behind
                shutil.rmtree(self.folder, ignore_errors=True)
            raise

    def _write_weights(self, state: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        partial = self.folder / "model.safetensors.partial"
        weights = transformers_weights(self.model, state, merge=not self.takes_adapters)
        save_file(weights, partial, metadata={"format": "pt"})
        os.replace(partial, self.folder / "model.safetensors")  # a reader sees the old file or the new, never half

    def max_len(self) -> int:
        return self._max_len

    def load_weights(self, state: dict[str, torch.Tensor] | None, version: int) -> None:
        """Push the policy after `version` optimizer steps into vLLM; it samples with them from now on."""
        assert state is not None, "vLLM holds weights of its own: give it the policy's state"
        if self.takes_adapters:
            self._load_adapters(state, version)
        elif isinstance(self.transport, VLLMServer) and self.rank > 0:
            self.transport.wait_for(f"{self.tag}/{version}")  # rank 0 pushes them
        elif isinstance(self.transport, VLLMServer):
            self._write_weights(state)
            self.transport.reload(f"{self.tag}/{version}")
        else:
            self.transport.reload(transformers_weights(self.model, state))
        self.weight_version = version

    def _load_adapters(self, state: dict[str, torch.Tensor], version: int) -> None:
        """A LoRA policy's adapters (`adapter_payload`: stamped with their weight version; another version is
        refused, so a stale adapter is never sampled with) written as a PEFT adapter folder that vLLM loads under a
        name of that version (a server: through /v1/load_lora_adapter, the previous one unloaded); sampling checks
        that every answer came from that adapter. Older folders are removed."""
        payload = state if ADAPTER_VERSION in state else adapter_payload(state, version)  # whole weights: theirs
        state = stamped_adapters(payload, version)
        root = self.folder / "adapters"
        path = root / f"v{version}"
        save_adapter(self.model, path, state, merged=False)
        adapter, previous = (
            Adapter(f"{self.tag}-v{version}", version + 1, str((path / "adapter").resolve())),
            self.adapter,
        )
        if isinstance(self.transport, VLLMServer):
            self.transport.load_adapter(adapter, previous)
        self.adapter = adapter
        for old in root.iterdir():
            if old != path:
                shutil.rmtree(old, ignore_errors=True)

    def generate(
        self, prompt_ids, num_samples=1, max_new_tokens=64, params=SamplingParams(), generator=None, on_token=None
    ):
        completions = self.generate_many([(prompt_ids, num_samples, generator)], max_new_tokens, params)
        if on_token is not None:  # vLLM answers whole completions: replayed token by token
            for row, completion in enumerate(completions[0]):
                full = completion.tokens
                for i in range(1, len(full) + 1):
                    completion.tokens = full[:i]
                    on_token(row, completion)
        return completions[0]

    def generate_many(self, requests, max_new_tokens, params) -> list[list[Completion]]:
        """Completions of every `(prompt_ids, num_samples, generator)` in one vLLM batch. A row that calls a tool
        stops at the call's end, gets the result spliced in as forced tokens and goes on in the next round."""
        rows, queue = [], []
        for index, (prompt, n, generator) in enumerate(requests):
            assert prompt, "the prompt is empty"
            if len(prompt) >= self._max_len:
                raise DataError(
                    f"the prompt is {len(prompt)} tokens, longer than the model's context of {self._max_len} "
                    "leaves room for; shorten it"
                )
            seed = int(torch.randint(2**62, (1,), generator=generator)) if generator is not None else None
            rows.append([Completion(weight_version=self.weight_version) for _ in range(n)])
            queue.append((index, None, list(prompt), n, seed))
        limits = [[max_new_tokens] * len(r) for r in rows]
        self._sample(queue, [list(p) for p, _, _ in requests], rows, limits, max_new_tokens, params)
        return rows

    def extend_many(self, requests, max_new_tokens, params, budget=None) -> None:
        """Continue the unfinished `rows` of every `(prompt_ids, rows, generator)` by up to `max_new_tokens` tokens
        each, in place, in one vLLM batch (a partial rollout's next chunk, `tierlm.loops.partial`): each row goes in
        as its prompt and tokens so far, a request of its own (vLLM 0.32's LLM has no pause / resume of a running
        request across a weight reload, and its prefix cache is reset by one: the prompt is prefilled afresh under
        the new weights, as tierlm's engine does). A tool result is spliced whole, up to `budget` tokens a row."""
        queue, prompts, rows, limits = [], [], [], []
        for index, (prompt, group, generator) in enumerate(requests):
            seed = int(torch.randint(2**62, (1,), generator=generator)) if generator is not None else None
            prompts.append(list(prompt))
            rows.append(group)
            limits.append([min(len(r.tokens) + max_new_tokens, budget or 1 << 30) for r in group])
            for r, row in enumerate(group):
                row_seed = None if seed is None else (seed * 31 + 7 * r) % 2**62
                queue.append((index, r, list(prompt) + row.tokens, 1, row_seed))
        self._sample(queue, prompts, rows, limits, budget or max_new_tokens, params)

    def _sample(self, queue, prompts, rows, limits, budget, params) -> None:
        """Sample every ask of `queue` — `(request, row or None for all n rows, ids, n, seed)` — into `rows`, each row
        up to its limit; a row that calls a tool gets the result (up to `budget` tokens in all) and goes on."""
        stop = self.stop_ids + ([self.call_end] if self.tools else [])
        round_ = 0
        while queue:
            asks = [
                (ids, n, seed, min(limits[i][row or 0] - self._taken(rows, i, row), self._max_len - len(ids)))
                for i, row, ids, n, seed in queue
            ]
            version = f"{self.tag}/base" if self.takes_adapters else f"{self.tag}/{self.weight_version}"
            answers = self.transport.sample(asks, params, stop, version, self.adapter)
            follow = []
            for (i, row, ids, n, seed), samples in zip(queue, answers):
                for j, (tokens, logprobs, stopped) in enumerate(samples):
                    r = row if row is not None else j
                    completion = rows[i][r]
                    completion.tokens += tokens
                    completion.logprobs += logprobs
                    completion.mask += [1] * len(tokens)
                    completion.versions += [self.weight_version] * len(tokens)
                    if stopped and tokens[-1] in self.stop_ids:
                        completion.finished = True
                    elif stopped and self.tools and tokens[-1] == self.call_end:
                        self._splice(completion, budget)
                        room = limits[i][r] - len(completion.tokens)
                        context = len(prompts[i]) + len(completion.tokens)
                        if room > 0 and context < self._max_len:
                            next_seed = None if seed is None else (seed * 31 + 7 * r + round_ + 1) % 2**62
                            follow.append((i, r, prompts[i] + completion.tokens, 1, next_seed))
            queue, round_ = follow, round_ + 1

    @staticmethod
    def _taken(rows, i, row) -> int:
        return 0 if row is None else len(rows[i][row].tokens)

    def _splice(self, completion: Completion, budget: int) -> None:
        """The tool result of the call that just ended, as forced (untrained) tokens."""
        tokens = completion.tokens
        starts = [k for k, t in enumerate(tokens[:-1]) if t == self.call_start]
        if not starts or self.result_end in tokens[starts[-1] :]:
            return  # an end without an open call: not a call
        result = call_tool(self.tools, self.tokenizer.decode(tokens[starts[-1] + 1 : -1], skip_special_tokens=True))
        forced = [self.result_start, *self.tokenizer.encode(result), self.result_end][: budget - len(tokens)]
        completion.tokens += forced
        completion.logprobs += [0.0] * len(forced)
        completion.mask += [0] * len(forced)
        completion.versions += [self.weight_version] * len(forced)
        completion.tool_calls += 1

    def close(self) -> None:
        self.transport.close()


def import_vllm():
    """vLLM, set to run its engine in this process; a clear refusal where it is not installed."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on a CPU (vLLM's default is 4)
    try:
        import vllm
    except ImportError as e:
        raise ConfigError(f"engine.kind=vllm needs vLLM in this Python ({first_line(e)}): {INSTALL_HINT}") from None
    return vllm


class _InProcess:
    """`vllm.LLM` in the trainer's process (its engine core too: tensors pass directly, no copy through a pipe)."""

    def __init__(self, vllm, folder: Path, max_len: int, cuda: bool, gpu_memory_utilization: float, lora_rank: int = 0):
        self.vllm, self.cuda = vllm, cuda
        # vLLM 0.32 takes max_lora_rank from a fixed list: the smallest that holds the adapters' rank
        lora_rank = next((r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512) if r >= lora_rank), lora_rank)
        lora = {"enable_lora": True, "max_lora_rank": lora_rank, "max_loras": 1} if lora_rank else {}
        self.llm = vllm.LLM(
            model=str(folder),
            dtype="bfloat16" if cuda else "float32",
            max_model_len=max_len,
            enforce_eager=not cuda,
            skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs",
            seed=0,
            enable_sleep_mode=cuda,
            # vLLM 0.32 on a CPU fails seeded requests whose prefill is split across steps ("CPU Generator does not
            # use offset"): whole prefills only.
            enable_chunked_prefill=False,
            max_num_batched_tokens=max(4096, max_len),
            **({"gpu_memory_utilization": gpu_memory_utilization} if cuda else {}),
            **lora,
        )
        self.asleep = False

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def reload(self, weights: dict[str, torch.Tensor]) -> None:
        self._wake()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights.items())})

    def sample(self, asks, params, stop, version, adapter=None):
        self._wake()
        settings = [
            self.vllm.SamplingParams(
                n=n,
                max_tokens=max_tokens,
                temperature=params.temperature,
                top_k=params.top_k or 0,
                top_p=params.top_p or 1.0,
                min_p=params.min_p or 0.0,
                presence_penalty=params.presence_penalty,
                frequency_penalty=params.frequency_penalty,
                repetition_penalty=params.repetition_penalty,
                seed=seed,
                logprobs=0,
                stop_token_ids=stop,
                ignore_eos=True,
            )
            for _, n, seed, max_tokens in asks
        ]
        lora = None
        if adapter is not None:  # a LoRA policy's: the adapters to sample with
            from vllm.lora.request import LoRARequest

            lora = LoRARequest(adapter.name, adapter.id, adapter.path)
        prompts = [{"prompt_token_ids": ids} for ids, *_ in asks]
        outputs = self.llm.generate(prompts, settings, use_tqdm=False, lora_request=lora)
        if lora is not None and any(
            o.lora_request is None or o.lora_request.lora_name != lora.lora_name for o in outputs
        ):
            raise RuntimeError(f"vLLM answered with another adapter than {lora.lora_name}")
        if self.cuda:  # the KV cache's memory goes back to training until the next rollouts
            self.llm.sleep(level=1)
            self.asleep = True
        return [
            [
                (
                    list(o.token_ids),
                    [d[token].logprob for token, d in zip(o.token_ids, o.logprobs)],
                    o.finish_reason == "stop",
                )
                for o in sorted(out.outputs, key=lambda o: o.index)
            ]
            for out in outputs
        ]

    def close(self) -> None:
        del self.llm
