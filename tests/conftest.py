import os
import sys
from pathlib import Path

import pytest
import torch

collect_ignore = [str(Path(__file__).parents[1] / "src" / "tierlm" / "__main__.py")]

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from tierlm.data import ArithmeticTask, train_bpe_tokenizer

    texts = [p.text for p in ArithmeticTask().problems("train", 2000, seed=0)]
    return train_bpe_tokenizer(texts, vocab_size=300)


@pytest.fixture
def tiny_gpt_config():
    from tierlm.models import GPTConfig

    return GPTConfig(depth=2, aspect_ratio=32, head_dim=16, n_kv_head=2, vocab_size=97, max_seq_len=64)


def run_cli(*args, cwd=None, timeout=600):
    """Run `python -m tierlm ARGS` in a fresh process (one thread each: tests run serially on 2 cores)."""
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "tierlm", *map(str, args)], cwd=cwd or REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
