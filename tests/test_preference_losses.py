"""`dpo.loss_type`: each preference loss against its paper's formula written out here (per pair, plain math on
log-probs gathered by hand from the logits), and the reference-free ones (SimPO, ORPO) never load a reference."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import PREFERENCE_CASES
from tierlm.config import DPOConfig, TierlmConfig
from tierlm.errors import ConfigError
from tierlm.primitives.losses import IGNORE_INDEX
from tierlm.strategies.dpo import preference_strategy
from tierlm.strategies.preference_losses import resolve_dpo

N, T, V = 3, 7, 11  # pairs, positions, vocabulary


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2 * N, T, V, generator=g)
    labels = torch.randint(0, V, (2 * N, T), generator=g)
    for row, start in enumerate([2, 4, 1, 3, 5, 2]):  # responses of different lengths
        labels[row, :start] = IGNORE_INDEX
    ref = -torch.rand(2 * N, generator=g) * 20
    return logits, labels, ref


def _logps(logits, labels, averaged: bool) -> list[float]:
    """Each row's response log-prob, summed (or averaged) over its tokens, by hand."""
    out = []
    for row in range(logits.shape[0]):
        terms = [
            float(logits[row, t, labels[row, t]] - torch.logsumexp(logits[row, t], dim=0))
            for t in range(T)
            if labels[row, t] != IGNORE_INDEX
        ]
        out.append(sum(terms) / len(terms) if averaged else sum(terms))
    return out


def _logsig(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _sig(x: float) -> float:
    return math.exp(_logsig(x))


F_PRIME = {  # f-DPO (Wang et al., 2023): f'(u) of each divergence, of the log-ratio lr = log u, u = pi / ref
    "reverse_kl": lambda lr, a: lr,
    "forward_kl": lambda lr, a: 1 - math.exp(-lr),
    "js_divergence": lambda lr, a: math.log(2 * math.exp(lr) / (1 + math.exp(lr))),
    "alpha_divergence": lambda lr, a: (math.exp(lr) ** (a - 1) - 1) / (a - 1),
}


def reference(
    loss_type: str,
    c: float,
    r: float,
    rc: float,
    rr: float,
    beta: float,
    e: float,
    gamma: float,
    tau: float = 0.05,
    f=F_PRIME["reverse_kl"],
) -> float:
    lc, lr = c - rc, r - rr  # the log-ratios
    h = f(lc) - f(lr)  # DPO's h, f-DPO's for the losses that read dpo.f_divergence_type
    if loss_type in ("sigmoid", "sigmoid_norm"):  # DPO (Rafailov et al., 2023); sigmoid_norm on averaged log-probs
        return -_logsig(beta * h)
    if loss_type == "exo_pair":  # EXO (Ji et al., 2024), eq. 16: KL(q || (1 - e, e)), q = sigmoid(beta h)
        q = _sig(beta * h)
        return q * (math.log(q) - math.log(1 - e)) + (1 - q) * (math.log(1 - q) - math.log(e))
    if loss_type == "nca_pair":  # NCA (Chen et al., 2024)
        return -_logsig(beta * lc) - 0.5 * _logsig(-beta * lc) - 0.5 * _logsig(-beta * lr)
    if loss_type == "bco_pair":  # BCO (Jung et al., 2024), pairwise, without its reward shift
        return -_logsig(beta * lc) - _logsig(-beta * lr)
    if loss_type == "sppo_hard":  # SPPO (Wu et al., 2024): win probability 1 for chosen, 0 for rejected
        return (lc - 1 / (2 * beta)) ** 2 + (lr + 1 / (2 * beta)) ** 2
    if loss_type == "apo_zero":  # APO (D'Oosterlinck et al., 2024), eq. 7
        return 1 - _sig(beta * lc) + _sig(beta * lr)
    if loss_type == "apo_down":  # APO, eq. 8
        return _sig(beta * lc) + 1 - _sig(beta * h)
    if loss_type == "discopop":  # DiscoPOP (Lu et al., 2024), eq. 5
        blend = _sig(beta * h / tau)
        return (1 - blend) * -_logsig(beta * h) + blend * math.exp(-beta * h)
    if loss_type == "robust":  # rDPO (Chowdhury et al., 2024)
        return (-(1 - e) * _logsig(beta * h) + e * _logsig(-beta * h)) / (1 - 2 * e)
    if loss_type == "hinge":  # SLiC-HF (Zhao et al., 2023)
        return max(0.0, 1 - beta * h)
    if loss_type == "ipo":  # IPO (Azar et al., 2023), on averaged log-probs
        return (h - 1 / (2 * beta)) ** 2
    if loss_type == "simpo":  # SimPO (Meng et al., 2024)
        return -_logsig(beta * (c - r) - gamma)
    # ORPO (Hong et al., 2024): NLL of the chosen response + beta * -log sigmoid(log odds ratio)
    odds = lambda a: math.log(math.exp(a) / (1 - math.exp(a)))  # noqa: E731
    return -c - beta * _logsig(odds(c) - odds(r))


CASES = PREFERENCE_CASES


@pytest.mark.parametrize("loss_type, overrides", CASES)
def test_each_preference_loss_equals_its_formula(loss_type, overrides):
    dpo = DPOConfig(loss_type=loss_type, **overrides)
    strategy = preference_strategy(dpo)
    logits, labels, ref = _batch()
    batch = strategy.prepare_batch(
        {"labels": labels, "ref_logps": ref} if loss_type not in ("simpo", "orpo") else {"labels": labels}
    )
    total, count = strategy.compute_loss(logits, batch)
    averaged = loss_type in ("ipo", "simpo", "orpo", "sigmoid_norm")
    logps = _logps(logits, labels, averaged)
    # the data's reference log-probs are sums: the averaging losses divide them by the response's length
    refs = [float(ref[row]) / (int((labels[row] != IGNORE_INDEX).sum()) if averaged else 1) for row in range(2 * N)]
    gamma, tau = dpo.simpo_gamma or 0.5, dpo.discopop_tau or 0.05
    alpha = dpo.f_alpha_divergence_coef
    f = lambda logratio: F_PRIME[dpo.f_divergence_type](logratio, alpha)  # noqa: E731
    expected = [
        reference(loss_type, logps[i], logps[N + i], refs[i], refs[N + i], dpo.beta, dpo.label_smoothing, gamma,
                  tau, f)
        for i in range(N)
    ]  # fmt: skip
    assert count == N
    assert abs(float(total) - sum(expected)) < 1e-5 * max(1.0, abs(sum(expected))), (float(total), expected)


@pytest.mark.parametrize("loss_type", ["ipo", "sigmoid_norm", ["sigmoid", "ipo"]])
def test_precomputed_reference_sums_equal_a_frozen_reference_for_averaging_losses(loss_type):
    """The data's ref_chosen_logp / ref_rejected_logp are whole sums: the averaging losses divide them by each
    response's length, as they divide the frozen reference's (they were once read as averages)."""

    logits, labels, _ = _batch()
    ref_logits = torch.randn(logits.shape, generator=torch.Generator().manual_seed(7))

    class Frozen:
        def forward(self, batch, fn):
            out = fn(ref_logits, batch)
            return type("Done", (), {"wait": lambda self: out})()

    frozen = preference_strategy(DPOConfig(loss_type=loss_type), Frozen())
    sums = torch.tensor(_logps(ref_logits, labels, averaged=False))
    precomputed = preference_strategy(DPOConfig(loss_type=loss_type, reference="precomputed"))
    want, _ = frozen.compute_loss(logits, frozen.prepare_batch({"labels": labels}))
    got, _ = precomputed.compute_loss(logits, precomputed.prepare_batch({"labels": labels, "ref_logps": sums}))
    assert float(got) == pytest.approx(float(want), rel=1e-5)


def test_a_list_of_losses_from_the_command_line_trains(tiny_runs, tmp_path):
    """MPO's list as a command-line override (`dpo.loss_type=[sigmoid,bco_pair,sft]`) reaches the strategy and a run
    of the DPO stage trains and evaluates with it."""
    from conftest import CHAT, REPO
    from tierlm.stages import run_stage

    config = TierlmConfig.load(
        REPO / "configs/tiny_dpo.yaml",
        [*CHAT, f"model.model_name_or_path={tiny_runs / 'sft'}", "dpo.loss_type=[sigmoid,bco_pair,sft]",
         "dpo.loss_weights=[0.8,0.2,1.0]", "dpo.use_weighting=true", f"infra.output_dir={tmp_path / 'mpo'}"],
    )  # fmt: skip
    assert config.dpo.loss_type == ["sigmoid", "bco_pair", "sft"]
    strategy = preference_strategy(config.dpo)
    assert [weight for _, weight in strategy.terms] == [0.8, 0.2, 1.0] and strategy.use_weighting
    summary = run_stage(config, "dpo")
    assert summary["step"] == 2 and math.isfinite(summary["val_loss"]) and "pref_acc" in summary


def test_reference_free_losses_load_no_reference(monkeypatch, tiny_runs, tmp_path):
    """SimPO and ORPO compare the policy with itself: training runs with the reference builder made to fail."""
    from conftest import CHAT, REPO
    from tierlm.stages import dpo as stage_module
    from tierlm.stages import run_stage

    def no_reference(*args, **kwargs):
        raise AssertionError("a reference-free loss loaded a reference model")

    monkeypatch.setattr(stage_module, "frozen_reference", no_reference)
    for loss_type in ("simpo", "orpo"):
        config = TierlmConfig.load(
            REPO / "configs/tiny_dpo.yaml",
            [*CHAT, f"model.model_name_or_path={tiny_runs / 'sft'}", f"dpo.loss_type={loss_type}",
             f"infra.output_dir={tmp_path / loss_type}"],
        )  # fmt: skip
        summary = run_stage(config, "dpo")
        assert summary["step"] == 2 and "pref_acc" in summary


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"loss_type": "robust"}, "robust DPO's assumed flip rate"),
        ({"label_smoothing": 0.1}, "robust DPO's assumed flip rate"),
        ({"loss_type": "ipo", "simpo_gamma": 1.0}, "does not read it"),
        ({"loss_type": "exo_pair"}, "EXO's epsilon"),
        ({"loss_type": "sigmoid", "label_smoothing": 0.1}, "AOT's smoothing"),
        ({"loss_type": ["sigmoid", "kto"]}, "combine with no other loss"),
        ({"loss_type": "apo_zero_unpaired", "use_weighting": True}, "has no pairs: drop them"),
        ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]}, "1 weights for the 2 losses"),
        ({"loss_type": "sigmoid", "loss_weights": [1.0, 0.5]}, "2 weights for the 1 losses"),
        ({"loss_type": ["sigmoid", "sft"], "rpo_alpha": 1.0}, "put its weight in dpo.loss_weights"),
        ({"loss_type": "aot", "use_weighting": True}, "compares the pairs of a batch"),
        ({"loss_type": ["sigmoid", "aot_unpaired"], "use_weighting": True}, "compares the pairs of a batch"),
        ({"loss_type": ["sigmoid", "dpo"]}, "dpo.loss_type=dpo is not one of"),
        ({"loss_type": []}, "dpo.loss_type is empty: name a preference loss"),
        ({"loss_type": ["sigmoid", "sft"], "discopop_tau": 0.1}, "dpo.discopop_tau is DiscoPOP's"),
        ({"loss_type": ["sft"], "reference": "precomputed"}, "uses no reference"),
        ({"loss_type": "kto", "ld_alpha": 0.5}, "dpo.loss_type=kto has no pairs"),
        ({"loss_type": "simpo", "ld_alpha": 0.5}, "dpo.loss_type=simpo has no reference"),
        ({"ld_alpha": 0.5, "reference": "precomputed"}, "precomputed ones are whole sums"),
        ({"ld_alpha": 1.5}, "ld_alpha"),
        ({"loss_type": "orpo", "rpo_alpha": 1.0}, "dpo.loss_type=orpo has its own NLL term"),
        ({"loss_type": "kto", "rpo_alpha": 1.0}, "dpo.loss_type=kto has no pairs"),
        ({"loss_type": "simpo", "reference_sync_steps": 8}, "dpo.loss_type=simpo has no reference: drop it"),
        ({"reference": "precomputed", "reference_sync_steps": 8}, "precomputed log-probs, which cannot move"),
        ({"reference_mixup_alpha": 0.5}, "set dpo.reference_sync_steps, or drop it"),
        ({"reference_sync_steps": 8, "reference_mixup_alpha": 0.0}, "reference_mixup_alpha"),
        ({"loss_type": "sigmoid", "discopop_tau": 0.1}, "dpo.discopop_tau is DiscoPOP's"),
        ({"loss_type": "simpo", "reference": "precomputed"}, "uses no reference"),
        ({"loss_type": "robust", "label_smoothing": 0.5}, "less than 0.5"),
        ({"desirable_weight": 2.0}, "are the unpaired losses'"),
        ({"loss_type": "kto", "reference": "precomputed"}, "computes its reference log-probs"),
    ],
)
def test_preference_settings_that_contradict_are_refused(overrides, message):
    with pytest.raises((ValueError, ConfigError), match=message):
        resolve_dpo(DPOConfig(**overrides))


def test_kto_equals_its_formula_with_the_kl_rows_giving_no_gradient():
    """KTO (Ethayarajh et al., 2024) as TRL's KTOTrainer computes it: z = max(0, mean over the mismatched rows of
    pi - ref), then desirable replies w_d (1 - sigmoid(beta (r - z))), undesirable w_u (1 - sigmoid(beta (z - r)));
    the KL rows' logits receive no gradient."""
    dpo = DPOConfig(loss_type="kto", beta=0.3, desirable_weight=1.5, undesirable_weight=0.7)
    strategy = preference_strategy(dpo)
    logits, labels, ref = _batch(1)
    label = torch.tensor([1.0, 0.0, 1.0])
    logits.requires_grad_(True)
    batch = strategy.prepare_batch({"labels": labels, "ref_logps": ref, "kto_label": label})
    total, count = strategy.compute_loss(logits, batch)
    logps = _logps(logits.detach(), labels, averaged=False)
    z = max(0.0, sum(logps[N + i] - float(ref[N + i]) for i in range(N)) / N)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expected = 0.0
    for i in range(N):
        r = logps[i] - float(ref[i])
        expected += 1.5 * (1 - sig(0.3 * (r - z))) if label[i] else 0.7 * (1 - sig(0.3 * (z - r)))
    assert count == N
    assert float(total) == pytest.approx(expected, rel=1e-5)
    total.backward()
    assert logits.grad[N:].abs().max() == 0 and logits.grad[:N].abs().max() > 0


def test_unpaired_rows_need_labels_and_kl_rows_pair_each_prompt_with_the_previous_reply(tiny_tokenizer):
    from tierlm.data.preferences import UnpairedLoader
    from tierlm.data.rows import Fields, row_to_unpaired
    from tierlm.errors import DataError

    rows = [{"prompt": f"{a} + 1", "completion": f"{a + 1}", "label": a % 2 == 0} for a in (2, 5, 7)]
    examples = [row_to_unpaired(r, Fields(), f"row {i}") for i, r in enumerate(rows)]
    batch = UnpairedLoader(examples, tiny_tokenizer, 3, 64, shuffle=False).next_batch()
    assert batch["kto_label"].tolist() == [1.0, 0.0, 0.0] and batch["input_ids"].shape[0] == 6
    decoded = [tiny_tokenizer.decode([t for t in row.tolist() if t >= 0], skip_special_tokens=True) for row in
               batch["input_ids"]]  # fmt: skip
    replies = [tiny_tokenizer.decode([t for t in row.tolist() if t >= 0], skip_special_tokens=True) for row in
               batch["labels"]]  # fmt: skip
    assert "2 + 1" in decoded[3] and replies[3].strip() == "8"  # prompt 0 with reply 2 (TRL's rotation)
    assert "7 + 1" in decoded[5] and replies[5].strip() == "6"  # prompt 2 with reply 1
    with pytest.raises(DataError, match="no 'label' field"):
        row_to_unpaired({"prompt": "1 + 1", "completion": "2"}, Fields(), "row 9")
    with pytest.raises(DataError, match="label must be true or false"):
        row_to_unpaired({"prompt": "1 + 1", "completion": "2", "label": "yes"}, Fields(), "row 9")


@pytest.mark.slow
def test_kto_run_resumes_bit_exact(tiny_runs, tmp_path):
    """`tierlm dpo dpo.loss_type=kto` on synthetic unpaired replies, rolled back to its step-2 checkpoint and
    resumed, ends with the straight run's weights; eval lines carry KTO's figures."""
    import json

    from safetensors.torch import load_file

    from conftest import CHAT, resume_from_checkpoint
    from tierlm.commands.cli import main

    out = tmp_path / "kto"
    args = ["dpo", "--config", "tiny_dpo", f"model.model_name_or_path={tiny_runs / 'sft'}", *CHAT, "dpo.loss_type=kto"]
    args += ["training.num_train_steps=4", "training.save_steps=2", "training.eval_steps=2"]
    assert main([*args, f"infra.output_dir={out}"]) == 0
    evals = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == "eval"]
    assert evals and all(k in evals[-1] for k in ("kl", "kto_acc", "reward_desirable", "reward_undesirable"))
    straight = load_file(out / "model" / "model.safetensors")
    resume_from_checkpoint(args, out, 2, in_process=True)
    resumed = load_file(out / "model" / "model.safetensors")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_apo_zero_unpaired_trains_on_the_replies_alone(tiny_runs, tmp_path):
    """dpo.loss_type=apo_zero_unpaired (TRL's KTOTrainer's other loss): its batches hold the judged replies without
    KTO's mismatched KL rows, and a run trains and evaluates with a KL estimate of 0."""
    import json

    from conftest import CHAT, REPO
    from tierlm.builders.loaders import build_pair_loaders
    from tierlm.commands.cli import main
    from tierlm.data.tokenizer import load_tokenizer

    args = ["dpo", "--config", "tiny_dpo", f"model.model_name_or_path={tiny_runs / 'sft'}", *CHAT]
    args += ["dpo.loss_type=apo_zero_unpaired", "training.eval_steps=1", f"infra.output_dir={tmp_path / 'apo'}"]
    config = TierlmConfig.load(REPO / "configs/tiny_dpo.yaml", args[3:])
    train, _ = build_pair_loaders(config, load_tokenizer(tiny_runs / "sft" / "model"))
    batch = train.next_batch()
    assert batch["input_ids"].shape[0] == batch["kto_label"].shape[0] == 4  # the replies, no KL rows
    assert main(args) == 0
    evals = [r for r in map(json.loads, (tmp_path / "apo" / "metrics.jsonl").read_text().splitlines())
             if r["type"] == "eval"]  # fmt: skip
    assert len(evals) >= 2 and all(r["kl"] == 0 for r in evals) and evals[-1]["val_loss"] != evals[0]["val_loss"]


@pytest.mark.slow
def test_tr_dpo_reference_is_trls_mix_of_the_policy_and_resumes_bit_exact(tiny_runs, tmp_path):
    """dpo.reference_sync_steps=2 with alpha 0.5 over 6 steps, saved every 2: each checkpoint's reference is TRL's
    own mix (`SyncRefModelCallback._sync_target_model`) of the policies of steps 2, 4 and 6 into the SFT model the
    run starts from; rolled back to step 4 (two mixes in) and resumed, the run ends with the straight run's weights
    and reference."""
    from safetensors.torch import load_file
    from trl.trainer.callbacks import SyncRefModelCallback

    from conftest import CHAT, resume_from_checkpoint
    from tierlm.commands.cli import main
    from tierlm.models import load_pretrained_model

    out, sft = tmp_path / "tr_dpo", tiny_runs / "sft"
    args = ["dpo", "--config", "tiny_dpo", f"model.model_name_or_path={sft}", *CHAT, "training.num_train_steps=6"]
    args += ["training.save_steps=2", "training.eval_steps=3", "dpo.reference_sync_steps=2"]
    args += ["dpo.reference_mixup_alpha=0.5"]
    assert main([*args, f"infra.output_dir={out}"]) == 0
    reference = load_pretrained_model(sft / "model")
    for step in (2, 4, 6):
        policy = load_pretrained_model(out / "checkpoints" / f"step_{step}" / "model")
        SyncRefModelCallback._sync_target_model(policy, reference, 0.5)
        saved = load_file(out / "checkpoints" / f"step_{step}" / "reference.safetensors")
        assert saved.keys() == dict(reference.named_parameters()).keys()
        for name, p in reference.named_parameters():
            torch.testing.assert_close(saved[name], p.detach(), rtol=0, atol=1e-7)
    moved = load_file(out / "checkpoints" / "step_6" / "reference.safetensors")
    start = dict(load_pretrained_model(sft / "model").named_parameters())
    assert any(not torch.equal(moved[k], start[k]) for k in moved)  # it followed the policy
    straight = load_file(out / "model" / "model.safetensors")
    resume_from_checkpoint(args, out, 4, in_process=True)
    resumed = load_file(out / "model" / "model.safetensors")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    again = load_file(out / "checkpoints" / "step_6" / "reference.safetensors")
    assert all(torch.equal(moved[k], again[k]) for k in moved)


def test_a_following_reference_under_torchrun_needs_whole_weights_on_each_rank():
    """The policy is mixed into each rank's reference from that rank's own weights: DDP's, never FSDP2's shards (DPO's
    "auto" under torchrun); RL's "auto" is DDP."""
    from tierlm.builders.stage import resolve_config
    from tierlm.stages import STAGES

    dpo = TierlmConfig.from_dict({"dpo": {"reference_sync_steps": 4}})
    with pytest.raises(ConfigError, match="each rank must hold them whole: set infra.distributed_type=ddp"):
        resolve_config(dpo, STAGES["dpo"], launched=True)
    ddp = dpo.model_copy(update={"infra": dpo.infra.model_copy(update={"distributed_type": "ddp"})})
    assert resolve_config(ddp, STAGES["dpo"], launched=True).dpo.reference_mixup_alpha == 0.6
    assert resolve_config(dpo, STAGES["dpo"], launched=False).dpo.reference_sync_steps == 4  # one process
    rl = TierlmConfig.from_dict({"rl": {"kl_coef": 0.1, "reference_sync_steps": 4}})
    assert resolve_config(rl, STAGES["rl"], launched=True).infra.distributed_type == "ddp"
    fsdp = rl.model_copy(update={"infra": rl.infra.model_copy(update={"distributed_type": "fsdp"})})
    with pytest.raises(ConfigError, match="rl.reference_sync_steps mixes the policy's weights"):
        resolve_config(fsdp, STAGES["rl"], launched=True)


def test_self_pairs_script_samples_scores_and_reports(tiny_runs, tmp_path):
    """scripts/self_pairs.py (docs/rl.md: DPO pairs from the model's own answers, a right one over a wrong one) runs
    end to end on the tiny SFT run: it samples and scores every problem and says how many pairs it wrote (the tiny
    model answers nothing right, so none: exit 1, an empty file); any row it writes is one question's two replies."""
    import json
    import subprocess
    import sys

    from conftest import REPO, cli_env

    out = tmp_path / "pairs.jsonl"
    script = [sys.executable, str(REPO / "scripts" / "self_pairs.py"), str(tiny_runs / "sft"), "--problems", "6"]
    done = subprocess.run([*script, "--out", str(out)], capture_output=True, text=True, env=cli_env())
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert f"{len(rows)} pairs from 6 problems (4 replies each)" in done.stdout, done.stderr[-2000:]
    assert done.returncode == (0 if rows else 1) and "Traceback" not in done.stderr
    for row in rows:
        assert row["chosen"][0] == row["rejected"][0] and row["chosen"][0]["role"] == "user"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"ld_alpha": 0.5}, "dpo.ld_alpha is applied by the PyTorch strategy"),
        ({"rpo_alpha": 1.0}, "dpo.rpo_alpha is applied by the PyTorch strategy"),
        ({"f_divergence_type": "forward_kl"}, "dpo.f_divergence_type is applied by the PyTorch strategy"),
        ({"reference_sync_steps": 8}, "dpo.reference_sync_steps is applied by the PyTorch strategy"),
        ({"use_weighting": True}, "dpo.use_weighting is applied by the PyTorch strategy"),
        ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]}, "dpo.loss_weights is applied by"),
        ({"loss_type": ["sigmoid", "sigmoid"]}, "trains dpo.loss_type=sigmoid alone"),
        ({"loss_type": "ipo"}, "dpo.loss_type=ipo needs infra.backend=pytorch"),
    ],
)
def test_what_the_jax_twin_lacks_is_refused_on_the_jax_backend(overrides, message):
    """The JAX backend's DPO twin is plain sigmoid DPO: every setting the PyTorch strategy adds is refused there in
    one line, and allowed on PyTorch."""
    with pytest.raises(ConfigError, match=message):
        resolve_dpo(DPOConfig(**overrides), jax=True)
    resolve_dpo(DPOConfig(**overrides))


def _metrics(folder):
    import json

    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    keys = ("loss", "grad_norm", "val_loss", "reward_margin", "pref_acc")
    return [(r["step"], {k: r[k] for k in keys if k in r}) for r in rows if any(k in r for k in keys)]


def test_precomputed_reference_without_columns_is_scored_once_and_trains_as_a_frozen_one(
    monkeypatch, tiny_runs, tmp_path
):
    """dpo.reference=precomputed over pairs that carry no reference log-probs (TRL's precompute_ref_log_probs): the
    starting model scores them before training, no reference model is built, and the run takes the frozen
    reference's steps (losses, gradient norms, evaluations); on 2 ranks each scores half and they gather the rest."""
    from conftest import CHAT, run_main
    from forked import ranks
    from tierlm.stages import dpo as stage_module

    args = ["dpo", "--config", "configs/tiny_dpo.yaml", *CHAT, f"model.model_name_or_path={tiny_runs / 'sft'}",
            "training.eval_steps=1", "training.logging_steps=1", "training.per_device_eval_batch_size=4"]  # fmt: skip
    assert (result := run_main(*args, f"infra.output_dir={tmp_path / 'frozen'}")).returncode == 0, result.stderr
    with monkeypatch.context() as patch:
        patch.setattr(stage_module, "frozen_reference", lambda *a, **k: pytest.fail("a reference model was built"))
        result = run_main(*args, "dpo.reference=precomputed", f"infra.output_dir={tmp_path / 'scored'}")
    assert result.returncode == 0, result.stderr
    assert "the starting model scored 72 pairs before training" in result.stdout  # 64 training pairs, 8 held out
    frozen, scored = _metrics(tmp_path / "frozen"), _metrics(tmp_path / "scored")
    assert len(frozen) >= 4 and scored == frozen
    two = ranks("-m", "tierlm", *args, "dpo.reference=precomputed", "training.per_device_train_batch_size=2",
                f"infra.output_dir={tmp_path / 'two'}")  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    for (step, a), (same, b) in zip(_metrics(tmp_path / "two"), frozen, strict=True):
        assert step == same and a == pytest.approx(b, rel=1e-4, abs=1e-6), (step, a, b)


def test_pairs_that_carry_reference_logps_for_some_only_are_refused(tiny_tokenizer):
    """Some pairs with ref_chosen_logp / ref_rejected_logp and others without: one line, before any scoring."""
    from tierlm.data.preferences import PairLoader, PreferencePair
    from tierlm.errors import DataError

    def pair(ref):
        chosen = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]
        rejected = [chosen[0], {"role": "assistant", "content": "3"}]
        return PreferencePair(chosen, rejected, *(ref or (None, None)))

    loader = PairLoader([pair((-1.0, -2.0)), pair(None), pair(None)], tiny_tokenizer, 1, 64)
    with pytest.raises(DataError, match="1 of 3 pairs carry ref_chosen_logp / ref_rejected_logp"):
        loader.unscored()
    whole = PairLoader([pair(None), pair(None)], tiny_tokenizer, 1, 64)
    assert whole.unscored() == [0, 1] and "ref_logps" not in whole.pairs([0, 1])
    whole.set_reference({0: (-1.0, -2.0), 1: (-3.0, -4.0)})
    assert whole.unscored() == [] and whole.pairs([1, 0])["ref_logps"].tolist() == [-3.0, -1.0, -4.0, -2.0]


def test_dpo_pairs_follow_data_long_conversations_and_precomputed_ones_are_never_cut(tiny_tokenizer, tmp_path):
    """`tierlm dpo`'s loaders keep an over-long pair's first tokens (data.long_conversations=truncate, the default) or
    drop it (drop); a pair that would be cut while carrying reference log-probs of its whole replies is refused."""
    import json

    from tierlm.builders.loaders import build_pair_loaders
    from tierlm.errors import DataError

    rows = [{"prompt": f"{i} + 1?", "chosen": f"{i + 1} " * (40 if i % 2 else 1), "rejected": "0"} for i in range(20)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = {"dataset_name": str(tmp_path / "p.jsonl"), "max_seq_length": 24, "val_fraction": 0.5}
    config = TierlmConfig.from_dict({"data": data, "training": {"per_device_train_batch_size": 2}})
    train, val = build_pair_loaders(config, tiny_tokenizer)
    assert (len(train), train.truncated, train.dropped) == (10, 5, 0) and val.truncated == 5
    assert train.next_batch()["input_ids"].shape[1] == 24
    dropped, _ = build_pair_loaders(config.model_copy(update={"data": config.data.model_copy(
        update={"long_conversations": "drop"})}), tiny_tokenizer)  # fmt: skip
    assert (len(dropped), dropped.truncated, dropped.dropped) == (5, 0, 5)
    kept, _ = build_pair_loaders(config, tiny_tokenizer, long_conversations="drop")  # as tierlm rm asks
    assert (len(kept), kept.dropped) == (5, 5)

    scored = [{**r, "ref_chosen_logp": -1.0, "ref_rejected_logp": -2.0} for r in rows]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in scored))
    with pytest.raises(DataError, match="carries ref_chosen_logp / ref_rejected_logp.*data.long_conversations=drop"):
        build_pair_loaders(config, tiny_tokenizer)
