"""Strategies: SFT trains assistant tokens only; pretrain predicts every next token; eval metrics."""

import math

import torch

from tierlm.data import Documents, ListExamples, PackedLoader, chat_documents
from tierlm.strategies import PretrainStrategy, SFTStrategy

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "2 + 2 = 4"}],
    [
        {"role": "user", "content": "What is 10 - 3?"},
        {"role": "assistant", "content": "10 - 3 = 7"},
        {"role": "user", "content": "What is 1 + 1?"},
        {"role": "assistant", "content": "1 + 1 = 2"},
    ],
]


def _sft_batch(tokenizer):
    docs = Documents(ListExamples(CONVERSATIONS), chat_documents(tokenizer))
    return PackedLoader(docs, batch_size=1, seq_len=63, mode="pad", shuffle=False, pad_id=tokenizer.pad_id).next_batch()


def test_sft_loss_ignores_non_assistant_targets(tiny_tokenizer):
    strategy = SFTStrategy()
    raw = _sft_batch(tiny_tokenizer)
    logits = torch.randn(*raw["tokens"][:, :-1].shape, tiny_tokenizer.vocab_size)
    base = strategy.prepare_batch(raw)
    loss, n = strategy.compute_loss(logits, base)

    # Change every token that is the target of a non-assistant position: the loss must not move.
    scrambled = dict(raw, tokens=raw["tokens"].clone())
    untrained = raw["mask"] == 0
    untrained[:, 0] = False  # position 0 is never a target
    scrambled["tokens"][untrained] = torch.randint(0, tiny_tokenizer.vocab_size, (int(untrained.sum()),))
    assert not torch.equal(scrambled["tokens"], raw["tokens"])
    loss2, n2 = strategy.compute_loss(logits, strategy.prepare_batch(scrambled))
    assert loss2.item() == loss.item() and n2.item() == n.item()

    # Control: changing one assistant target does move it.
    bumped = dict(raw, tokens=raw["tokens"].clone())
    row, col = (raw["mask"] == 1).nonzero()[0].tolist()
    bumped["tokens"][row, col] = (bumped["tokens"][row, col] + 1) % tiny_tokenizer.vocab_size
    assert strategy.compute_loss(logits, strategy.prepare_batch(bumped))[0].item() != loss.item()


def test_sft_labels_are_the_masked_next_tokens(tiny_tokenizer):
    batch = SFTStrategy().prepare_batch(_sft_batch(tiny_tokenizer))
    trained = batch["labels"][batch["labels"] != -100]
    assert tiny_tokenizer.decode(trained.tolist()).count("<|assistant_end|>") == 3
    assert "What is" not in tiny_tokenizer.decode(trained.tolist())


def test_pretrain_shift():
    batch = PretrainStrategy().prepare_batch({"tokens": torch.arange(10).view(2, 5)})
    assert torch.equal(batch["labels"], batch["input_ids"] + 1)


def test_eval_metrics_bits_per_byte_by_hand():
    token_bytes = torch.tensor([0, 1, 2, 3])  # token 0 is special: no bytes
    strategy = PretrainStrategy(token_bytes)
    logits = torch.zeros(1, 3, 4)  # uniform: ln 4 nats per token
    metrics = strategy.compute_metrics(logits, {"labels": torch.tensor([[0, 2, 3]])})
    summary = strategy.summarize({k: v.item() for k, v in metrics.items()})
    assert math.isclose(summary["val_loss"], math.log(4), rel_tol=1e-6)
    # bytes: 2 + 3 over the two byte-carrying tokens
    assert math.isclose(summary["val_bpb"], 2 * math.log(4) / (math.log(2) * 5), rel_tol=1e-6)
