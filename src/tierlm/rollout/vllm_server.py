"""A vLLM OpenAI server as `tierlm.rollout.vllm.VLLMEngine`'s transport (engine.vllm_url): prompts go to its
completions API as token ids, one request per prompt (each with its own seed; the server batches them); weights
are handed over as a safetensors folder it reloads (`/collective_rpc reload_weights`), whose version is set and
read back; a LoRA policy's adapters go in through `/v1/load_lora_adapter` where the server takes them."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from tierlm.errors import ConfigError, first_line

# What decides whether a server's model takes this policy's weights (config.json keys).
SHAPE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "head_dim",
    "n_embd",
    "n_layer",
    "n_head",
    "n_inner",
)


@dataclass(frozen=True)
class Adapter:
    """A LoRA policy's adapters as vLLM loads them: a name of their weight version, vLLM's integer id, the PEFT
    adapter folder."""

    name: str
    id: int
    path: str


class VLLMServer:
    """A vLLM OpenAI server (started with VLLM_SERVER_DEV_MODE=1, which opens its weight-update endpoints)."""

    def __init__(self, url: str, max_len: int):
        self.url = url.rstrip("/")
        models = self._call("GET", "/v1/models")
        if not models.get("data"):
            raise ConfigError(f"the vLLM server at {self.url} serves no model: start it on the policy's model folder")
        served = models["data"][0]
        self.model = served["id"]
        self.max_len = min(max_len, served.get("max_model_len") or max_len)  # the sampler's context is the server's
        self.root = Path(served.get("root") or self.model)
        self._call("GET", "/weight_info", hint="start it with VLLM_SERVER_DEV_MODE=1 (scripts/vllm_server.sh does)")
        self.pool = ThreadPoolExecutor(16)  # one request per prompt (each has its own seed); the server batches them

    def check_model(self, folder: Path) -> None:
        """Refuse a server whose model cannot take the weights of the policy in `folder` (when its folder can be
        read here; elsewhere the first push tells); from now on the server reloads from `folder`."""
        self.folder, root = folder, self.root
        try:
            theirs = json.loads((root / "config.json").read_text())
        except (OSError, ValueError):
            return  # not on this machine's disk: the first push will tell
        ours = json.loads((self.folder / "config.json").read_text())
        differ = [k for k in SHAPE_KEYS if k in ours and theirs.get(k) != ours[k]]
        if differ:
            k = differ[0]
            raise ConfigError(
                f"the vLLM server at {self.url} serves another model ({root}: {k} {theirs.get(k)}, this policy's "
                f"{ours[k]}): restart it on the policy's model folder"
            )

    def _call(self, method: str, path: str, body: dict | None = None, hint: str = "", timeout: float = 600):
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            try:
                detail = json.loads(detail).get("error", {}).get("message", detail)
            except (ValueError, AttributeError):
                pass
            raise ConfigError(
                f"the vLLM server at {self.url} refused {path} (HTTP {e.code}: {first_line(detail)[:300]})"
                + (f": {hint}" if hint else "")
            ) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ConfigError(
                f"no vLLM server answers at {self.url + path} ({reason}): start one with "
                "`bash scripts/vllm_server.sh MODEL_FOLDER` or correct engine.vllm_url"
            ) from None
        try:
            return json.loads(text) if text else {}
        except ValueError:  # a plain answer (the LoRA endpoints say "Success: ...")
            return {"text": text}

    def reload(self, version: str) -> None:
        """The server reads the folder's weights in place, then takes and reports their version."""
        self._call(
            "POST",
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": str(self.folder.resolve())}},
        )
        self._call("POST", "/update_weight_version", {"new_version": version})
        reported = self._call("GET", "/weight_info").get("weight_version")
        assert reported == version, f"the vLLM server reports weights {reported} after a push of {version}"

    def takes_adapters(self, rank: int) -> bool:
        """Does this server take LoRA adapters at run time (started with --enable-lora, and
        VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, as scripts/vllm_server.sh sets)? Only a one-process trainer loads
        them (ranks would each load theirs); asked by unloading an adapter that is not there."""
        if rank > 0 or (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
            return False
        try:
            self._call("POST", "/v1/unload_lora_adapter", {"lora_name": "tierlm-probe"})
        except ConfigError as e:
            return "tierlm-probe" in str(e)  # the route answered: the adapter is unknown, runtime loading is on
        return True

    def load_adapter(self, adapter: Adapter, previous: Adapter | None) -> None:
        """Load `adapter` (its folder must be readable by the server: the same path, as the weights) and unload
        `previous`."""
        self._call("POST", "/v1/load_lora_adapter", {"lora_name": adapter.name, "lora_path": adapter.path})
        if previous is not None:
            self._call("POST", "/v1/unload_lora_adapter", {"lora_name": previous.name})

    def _complete(self, ask, params, stop, adapter=None):
        ids, n, seed, max_tokens = ask
        body = {
            "model": adapter.name if adapter is not None else self.model,
            "prompt": ids,
            "n": n,
            "max_tokens": max_tokens,
            "temperature": params.temperature,
            "top_k": params.top_k or 0,
            "top_p": params.top_p or 1.0,
            "min_p": params.min_p or 0.0,
            "presence_penalty": params.presence_penalty,
            "frequency_penalty": params.frequency_penalty,
            "repetition_penalty": params.repetition_penalty,
            "seed": seed,
            "logprobs": 0,
            "stop_token_ids": stop,
            "ignore_eos": True,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        answer = self._call("POST", "/v1/completions", body)
        if adapter is not None and answer.get("model") != adapter.name:
            raise RuntimeError(f"the vLLM server answered with {answer.get('model')}, not the adapter {adapter.name}")
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        return [(c["token_ids"], c["logprobs"]["token_logprobs"], c["finish_reason"] == "stop") for c in choices]

    def sample(self, asks, params, stop, version, adapter=None):
        answers = list(self.pool.map(lambda ask: self._complete(ask, params, stop, adapter), asks))
        now = self._call("GET", "/weight_info").get("weight_version")
        if now != version:
            raise ConfigError(
                f"the vLLM server at {self.url} changed its weights to version {now} while sampling with {version}: "
                "another trainer shares it; give each run a server of its own"
            )
        return answers

    def wait_for(self, version: str, timeout: float = 600) -> None:
        """Until the server holds the weights of `version` (another rank pushes them)."""
        deadline = time.monotonic() + timeout
        while (now := self._call("GET", "/weight_info").get("weight_version")) != version:
            assert time.monotonic() < deadline, f"the vLLM server kept weights {now}, waiting for {version}"
            time.sleep(0.005)

    def close(self) -> None:
        self.pool.shutdown()
