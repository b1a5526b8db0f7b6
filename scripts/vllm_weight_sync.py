"""Does a weight push into vLLM take effect? Run with vLLM's own venv (scripts/setup_vllm.sh):

    .venv-vllm/bin/python scripts/vllm_weight_sync.py runs/tiny_rl/model

Loads a transformers model folder into `vllm.LLM` in this process, samples greedily, perturbs every weight,
pushes the new weights with vLLM's in-place reload (`collective_rpc("reload_weights", weights_iterator=...)`,
which redoes the CPU backend's weight repacking), samples again, and compares with transformers' own greedy
tokens under the same new weights. Prints one JSON line; exits 1 when the tokens after the push are not
transformers'.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: tensors pass directly

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402


def main(folder: str, new_tokens: int = 12) -> int:
    prompt = [1, 5, 6, 7, 8]
    start = time.perf_counter()
    llm = LLM(model=folder, dtype="float32", max_model_len=256, enforce_eager=True)
    load_s = time.perf_counter() - start
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    before = list(llm.generate([{"prompt_token_ids": prompt}], greedy)[0].outputs[0].token_ids)
    generator = torch.Generator().manual_seed(0)
    state = {
        k: v + 0.5 * torch.randn(v.shape, generator=generator)
        for k, v in load_file(f"{folder}/model.safetensors").items()
    }
    start = time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(state.items())})
    push_s = time.perf_counter() - start
    after = list(llm.generate([{"prompt_token_ids": prompt}], greedy)[0].outputs[0].token_ids)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.load_state_dict(state, strict=False)
    ids = torch.tensor([prompt])
    reference = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    reference = reference[0, len(prompt) :].tolist()
    same = reference[: len(after)] == after
    print(
        json.dumps(
            {
                "load_s": load_s,
                "push_s": push_s,
                "before": before,
                "after": after,
                "transformers": reference,
                "same": same,
            }
        )
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
