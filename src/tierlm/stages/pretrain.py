"""Pretraining: next-token prediction on packed rows of text (or UL2 denoising, for an encoder-decoder).

tierlm pretrain --config configs/tiny_pretrain.yaml
"""

from __future__ import annotations

from tierlm.builders.loaders import build_loaders
from tierlm.builders.model import build_model, loads_on_rank0_only
from tierlm.builders.stage import Stage
from tierlm.data import RankSlice
from tierlm.models.neftune import add_embedding_noise
from tierlm.run import Run
from tierlm.stages.with_trainer import confirm_batch_size, train_with_trainer
from tierlm.strategies import PretrainStrategy, Seq2SeqStrategy


class Pretrain(Stage):
    deepspeed = True
    name = "pretrain"
    example_kind = "text"
    encoder_decoder = True
    packing = "crop"
    scales_from_depth = True

    def run(self, run: Run, callbacks: list | None = None) -> dict:
        return train_on_rows(run, Seq2SeqStrategy if run.seq2seq else PretrainStrategy, callbacks or [])


def train_on_rows(run: Run, strategy_class, callbacks: list) -> dict:
    """Pretraining and SFT: best-fit packed rows (UL2 examples for an encoder-decoder), checked against the
    memory they will take before the model is built; the global batch sliced by data-parallel rank."""
    auto_rows = run.config.training.per_device_train_batch_size == "auto"
    config, tokenizer = run.choose_batch_size(), run.tokenizer
    train_loader, eval_loader = build_loaders(config, run.stage, tokenizer, run.data_parallel_size, run.seq2seq)
    run.check_memory(train_loader.resident_documents)
    rank0_reads = loads_on_rank0_only(config, run.pretrained, run.kind)  # the other ranks: shapes, then a broadcast
    model = build_model(config, tokenizer, run.device, run.pretrained, on_meta=rank0_reads and not run.is_main)
    if rank0_reads:
        run.note(f"infra.cpu_ram_efficient_loading: the weights were read on rank 0 alone, for {run.world_size} ranks")
    if auto_rows and confirm_batch_size(run, model):  # CUDA: halved after an out-of-memory
        train_loader, eval_loader = build_loaders(run.config, run.stage, tokenizer, run.data_parallel_size, run.seq2seq)
    if config.training.neftune_noise_alpha is not None:  # SFT's, checked when the config was resolved
        add_embedding_noise(model, config.training.neftune_noise_alpha)
    run.resolve(model, train_loader)
    if run.ctx is not None:
        train_loader = RankSlice(train_loader, run.data_rank, run.data_parallel_size)
    strategy = strategy_class(tokenizer.token_bytes())
    return train_with_trainer(run, model, strategy, train_loader, eval_loader, callbacks, broadcast_weights=rank0_reads)
