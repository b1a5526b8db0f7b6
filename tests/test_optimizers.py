"""Optimizers: Muon against a plain reference written here, the role container against
torch.optim.AdamW, the schedule's momentum and weight decay, and the plan's scaling-law formulas
against values computed by hand."""

import copy
import math

import pytest
import torch
from torch import nn

from tierlm.builders.model import new_model
from tierlm.builders.optimizer import optimizer_settings
from tierlm.config import TierlmConfig
from tierlm.errors import ConfigError
from tierlm.plan.scaling import optimal_batch_tokens, parameter_counts, resolve
from tierlm.primitives.optim import OptimizerContainer, RoleSettings, build_optimizer, parameter_roles
from tierlm.primitives.optim.muon import REFINEMENTS, Muon, newton_schulz_orthogonalize
from tierlm.primitives.schedules import TrainingSchedule, create_warmup_scheduler
from tierlm.stages import STAGES


def reference_muon_step(weight, grad, buf, lr, momentum, weight_decay):
    """Muon as its description reads, one matrix at a time, in float64."""
    buf = momentum * buf + (1 - momentum) * grad
    direction = (1 - momentum) * grad + momentum * buf  # Nesterov
    x = direction.clone()
    if x.shape[0] > x.shape[1]:
        x = x.T
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(5):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    if direction.shape[0] > direction.shape[1]:
        x = x.T
    scale = math.sqrt(max(1.0, weight.shape[0] / weight.shape[1]))
    weight = weight * (1 - lr * weight_decay) - lr * scale * x
    return weight, buf


def test_muon_equals_the_reference_update():
    g = torch.Generator().manual_seed(0)
    shapes = [(16, 48), (48, 16), (32, 32)]  # wide, tall (scaled by sqrt(3)), square
    params = [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    ref = [(p.detach().double().clone(), torch.zeros(s, dtype=torch.float64)) for p, s in zip(params, shapes)]
    opt = Muon(params, lr=0.05, momentum=0.9, weight_decay=0.1)
    for _ in range(5):
        grads = [torch.randn(s, generator=g) for s in shapes]
        for p, grad in zip(params, grads):
            p.grad = grad.clone()
        opt.step()
        ref = [reference_muon_step(w, grad.double(), buf, 0.05, 0.9, 0.1) for (w, buf), grad in zip(ref, grads)]
    for p, (w, _) in zip(params, ref):
        torch.testing.assert_close(p.detach().double(), w, atol=1e-5, rtol=0)


def test_newton_schulz_approaches_the_polar_factor():
    """The iteration's output points where U V^T does (cosine > 0.95) with singular values in ~[0.7, 1.2]."""
    g = torch.randn(24, 64, generator=torch.Generator().manual_seed(1))
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    polar = u @ vh
    out = newton_schulz_orthogonalize(g, dtype=torch.float32)
    cosine = (out * polar).sum() / (out.norm() * polar.norm())
    s = torch.linalg.svdvals(out)
    assert cosine > 0.95 and s.min() > 0.6 and s.max() < 1.25, (float(cosine), s.min(), s.max())


POLAR_EXPRESS = [  # the paper's quintics for 5 steps (arXiv 2505.16932; nanochat's optim.py)
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


def reference_refined_step(weight, grad, state, lr, momentum, weight_decay, refinements, beta2):
    """Muon with the named refinements, as nanochat's fused step writes them out, in float64 (the weight decay at the
    unscaled lr, as tierlm's plain Muon)."""
    state["buf"] = momentum * state["buf"] + (1 - momentum) * grad
    x = (1 - momentum) * grad + momentum * state["buf"]
    if "muoneq" in refinements:  # every row to the mean row norm
        x = x * (x.norm() / x.shape[0] ** 0.5) / x.norm(dim=1, keepdim=True)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    if "polar_express" in refinements:
        x, quintics = x / (x.norm() * 1.01 + 1e-6), POLAR_EXPRESS
    else:
        x, quintics = x / (x.norm() + 1e-7), [(3.4445, -4.7750, 2.0315)] * 5
    for a, b, c in quintics:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    x = x.T if tall else x
    if "renormalize" in refinements:
        x = x * min(x.shape) ** 0.5 / x.norm()
    if "normuon" in refinements:
        dim = -1 if x.shape[0] >= x.shape[1] else -2
        v = x.square().mean(dim=dim, keepdim=True)
        state["v"] = beta2 * state.get("v", torch.zeros_like(v)) + (1 - beta2) * v
        scaled = x / state["v"].sqrt()
        x = scaled * x.norm() / scaled.norm()
    decay = lr * weight_decay * weight
    if "cautious_wd" in refinements:
        decay = decay * (x * weight >= 0)
    scale = math.sqrt(max(1.0, weight.shape[0] / weight.shape[1]))
    return weight - decay - lr * scale * x


REFINEMENT_SETS = [["polar_express"], ["muoneq"], ["renormalize"], ["normuon"], ["cautious_wd"], list(REFINEMENTS)]


@pytest.mark.parametrize("refinements", REFINEMENT_SETS, ids=["+".join(r) for r in REFINEMENT_SETS])
def test_muon_refinements_equal_the_reference(refinements):
    g = torch.Generator().manual_seed(3)
    shapes = [(16, 48), (48, 16), (32, 32)]
    params = [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    ref = [(p.detach().double().clone(), {"buf": torch.zeros(s, dtype=torch.float64)}) for p, s in zip(params, shapes)]
    opt = Muon(params, lr=0.05, momentum=0.9, weight_decay=0.1, refinements=tuple(refinements), beta2=0.8)
    for _ in range(5):
        grads = [torch.randn(s, generator=g) for s in shapes]
        for p, grad in zip(params, grads):
            p.grad = grad.clone()
        opt.step()
        ref = [
            (reference_refined_step(w, grad.double(), st, 0.05, 0.9, 0.1, refinements, 0.8), st)
            for (w, st), grad in zip(ref, grads)
        ]
    for p, (w, _) in zip(params, ref):
        torch.testing.assert_close(p.detach().double(), w, atol=2e-5, rtol=0)


def test_polar_express_lands_nearer_the_polar_factor_than_newton_schulz():
    """Five Polar Express steps put every singular value within ~10% of 1 (Newton–Schulz's quintic: ~[0.7, 1.2])."""
    g = torch.randn(24, 64, generator=torch.Generator().manual_seed(1))
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    spread = {}
    for polar in (False, True):
        out = newton_schulz_orthogonalize(g, dtype=torch.float32, polar_express=polar)
        spread[polar] = float((torch.linalg.svdvals(out) - 1).abs().max())
        assert float((out * (u @ vh)).sum() / (out.norm() * (u @ vh).norm())) > 0.95
    assert spread[True] < 0.15 < spread[False], spread


def test_muon_refinements_are_named_and_need_muon():
    with pytest.raises(ConfigError, match="unknown Muon refinement"):
        Muon([nn.Parameter(torch.zeros(2, 2))], refinements=("polar",))
    with pytest.raises(ConfigError, match="set training.optimizer=muon"):
        TierlmConfig.load(None, ["training.muon_refinements=[normuon]"])
    config = TierlmConfig.load(None, ["training.optimizer=muon", "training.muon_refinements=[normuon,polar_express]"])
    opt = build_optimizer("muon", _model(), optimizer_settings(config, 768))
    assert opt.optimizers[0].refinements == {"normuon", "polar_express"}


def _model():
    torch.manual_seed(0)
    return nn.ModuleDict(
        {
            "embed": nn.Embedding(20, 8),
            "hidden": nn.Linear(8, 8),
            "norm": nn.LayerNorm(8),
            "lm_head": nn.Linear(8, 20, bias=False),
        }
    )


def _train(model, opt, steps=4):
    g = torch.Generator().manual_seed(2)
    for _ in range(steps):
        ids = torch.randint(0, 20, (4, 6), generator=g)
        x = model["norm"](model["hidden"](model["embed"](ids)))
        loss = nn.functional.cross_entropy(model["lm_head"](x).flatten(0, 1), ids.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()


def test_roles():
    roles = parameter_roles(_model())
    shapes = {role: sorted(tuple(p.shape) for p in ps) for role, ps in roles.items()}
    assert shapes == {
        "matrix": [(8, 8)],
        "embedding": [(20, 8)],
        "unembedding": [(20, 8)],
        "scalar": [(8,), (8,), (8,)],
    }
    tied = nn.Module()
    tied.wte, tied.lm_head = nn.Embedding(20, 8), nn.Linear(8, 20, bias=False)
    tied.lm_head.weight = tied.wte.weight
    assert [len(v) for v in parameter_roles(tied).values()] == [0, 0, 1, 0]  # a tied head counts once, as the head


def test_adamw_by_roles_equals_torch_adamw():
    settings = RoleSettings(matrix_lr=1e-2, embedding_lr=2e-2, unembedding_lr=3e-3, scalar_lr=5e-3, weight_decay=0.1)
    ours, theirs = _model(), _model()
    p = dict(theirs.named_parameters())
    reference = torch.optim.AdamW(
        [
            {"params": [p["hidden.weight"]], "lr": 1e-2, "weight_decay": 0.1},
            {"params": [p["embed.weight"]], "lr": 2e-2, "weight_decay": 0.0},
            {"params": [p["lm_head.weight"]], "lr": 3e-3, "weight_decay": 0.0},
            {"params": [p["hidden.bias"], p["norm.weight"], p["norm.bias"]], "lr": 5e-3, "weight_decay": 0.0},
        ],
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    _train(ours, build_optimizer("adamw", ours, settings))
    _train(theirs, reference)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)


def test_muon_container_equals_muon_plus_torch_adamw():
    settings = RoleSettings(
        matrix_lr=0.02, embedding_lr=2e-2, unembedding_lr=3e-3, scalar_lr=5e-3, weight_decay=0.1, muon_momentum=0.9
    )
    ours, theirs = _model(), _model()
    opt = build_optimizer("muon", ours, settings)
    assert isinstance(opt, OptimizerContainer) and [type(o).__name__ for o in opt.optimizers] == ["Muon", "AdamW"]
    p = dict(theirs.named_parameters())
    reference = OptimizerContainer(
        [
            Muon([p["hidden.weight"]], lr=0.02, momentum=0.9, weight_decay=0.1),
            torch.optim.AdamW(
                [
                    {"params": [p["embed.weight"]], "lr": 2e-2, "weight_decay": 0.0},
                    {"params": [p["lm_head.weight"]], "lr": 3e-3, "weight_decay": 0.0},
                    {"params": [p["hidden.bias"], p["norm.weight"], p["norm.bias"]], "lr": 5e-3, "weight_decay": 0.0},
                ],
                betas=(0.9, 0.95),
                eps=1e-8,
            ),
        ]
    )
    _train(ours, opt)
    _train(theirs, reference)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)


def test_one_schedule_drives_every_group_and_muons_momentum_and_decay():
    model = _model()
    opt = build_optimizer("muon", model, RoleSettings(0.02, 0.1, 0.01, 0.01, weight_decay=0.2))
    sched = create_warmup_scheduler(opt, 0, 10, "linear", min_lr_ratio=0.0, momentum_warmup_steps=4)
    seen = []
    for _ in range(6):
        groups = opt.param_groups
        seen.append((groups[0]["lr"], groups[0]["momentum"], groups[0]["weight_decay"], groups[1]["lr"]))
        opt.step()
        sched.step()
    lr, momentum, decay, embedding_lr = zip(*seen)
    assert [round(x, 4) for x in lr] == [0.02, 0.018, 0.016, 0.014, 0.012, 0.01]
    assert [round(x, 4) for x in embedding_lr] == [0.1, 0.09, 0.08, 0.07, 0.06, 0.05]  # the same multiplier
    assert [round(x, 4) for x in momentum] == [0.85, 0.875, 0.9, 0.925, 0.95, 0.95]
    assert [round(x, 4) for x in decay] == [0.2, 0.18, 0.16, 0.14, 0.12, 0.1]
    # The schedule's state is its step count: a fresh one loaded from it continues identically.
    state = sched.state_dict()
    other = _model()
    opt2 = build_optimizer("muon", other, RoleSettings(0.02, 0.1, 0.01, 0.01, weight_decay=0.2))
    sched2 = TrainingSchedule(opt2, lambda s: 1.0, 10, momentum_warmup_steps=4)
    sched2.load_state_dict(state)
    opt2.step()
    sched.step(), sched2.step()
    assert opt2.param_groups[0]["momentum"] == opt.param_groups[0]["momentum"]
    assert opt2.param_groups[0]["weight_decay"] == opt.param_groups[0]["weight_decay"]


def test_muon_refuses_vectors_and_models_without_matrices():
    with pytest.raises(AssertionError, match="matrices only"):
        Muon([nn.Parameter(torch.zeros(3))])
    with pytest.raises(ConfigError, match="needs 2-D hidden weights"):
        build_optimizer("muon", nn.Embedding(4, 4), RoleSettings(0.02, 0.1, 0.01, 0.01))
    with pytest.raises(ConfigError, match="unknown optimizer 'sgd'"):
        build_optimizer("sgd", nn.Linear(2, 2), RoleSettings(0.02, 0.1, 0.01, 0.01))


# -- the plan: seed 004's formulas, checked against hand-computed values ------------------------
def _plan(depth, world_size=8, **training):
    overrides = [
        f"model.depth={depth}",
        "data.max_seq_length=2048",
        "training.per_device_train_batch_size=32",
        "training.target_param_data_ratio=10.5",
        "training.total_batch_size=auto",
        "training.optimizer=muon",
        "training.weight_decay=0.2",
        *[f"training.{k}={v}" for k, v in training.items()],
    ]
    config = TierlmConfig.load(None, overrides)
    return resolve(config, STAGES["pretrain"], new_model(config, 32768, "meta"), world_size)


def test_plan_d12_is_the_reference():
    # d12: width 12 x 64 = 768, SwiGLU width ceil(8/3 x 768 / 32) x 32 = 2048.
    # blocks: 12 x (4 x 768^2 + 3 x 768 x 2048) = 84,934,656; head 768 x 32768 = 25,165,824.
    config, plan = _plan(12)
    assert plan.counts["scaling"] == 84_934_656 + 25_165_824 == 110_100_480
    assert plan.target_tokens == plan.reference_tokens == 1_156_055_040  # 10.5 x 110,100,480
    assert plan.predicted_batch == 524_288 and plan.accumulation == 1  # 32 rows x 2048 tokens x 8 ranks
    assert plan.lr_scale == 1.0 and plan.weight_decay_scale == 1.0
    assert config.training.num_train_steps == 1_156_055_040 // 524_288 == 2205
    assert config.training.matrix_lr == 0.02 and config.training.embedding_lr == pytest.approx(
        0.2
    )  # width 768: unscaled


def test_plan_d20_by_hand():
    # d20: width 1280, SwiGLU width ceil(8/3 x 1280 / 32) x 32 = 107 x 32 = 3424.
    # blocks: 20 x (4 x 1280^2 + 3 x 1280 x 3424) = 394,035,200; head 1280 x 32768 = 41,943,040.
    config, plan = _plan(20)
    assert plan.counts["scaling"] == 394_035_200 + 41_943_040 == 435_978_240
    assert plan.target_tokens == 4_577_771_520  # 10.5 x 435,978,240
    # B = 524,288 x (4,577,771,520 / 1,156,055,040)^0.383 = 524,288 x 3.9598^0.383 = 888,150 -> 2^20.
    assert plan.predicted_batch == 1_048_576 and plan.accumulation == 2
    assert plan.lr_scale == pytest.approx(2**0.5)
    assert plan.weight_decay_scale == pytest.approx(2**0.5 * 1_156_055_040 / 4_577_771_520)  # 0.357
    t = config.training
    assert t.num_train_steps == 4_577_771_520 // 1_048_576 == 4365
    assert t.gradient_accumulation_steps == 2 and t.total_batch_size == 1_048_576
    assert t.matrix_lr == pytest.approx(0.02 * 2**0.5)
    assert t.embedding_lr == pytest.approx(0.2 * (1280 / 768) ** -0.5 * 2**0.5)
    assert t.weight_decay == pytest.approx(0.2 * 0.357142, rel=1e-5)
    # The resolved config is a fixed point: resolving it again changes nothing.
    again, _ = resolve(config, STAGES["pretrain"], new_model(config, 32768, "meta"), 8)
    assert again.training == config.training


def test_muon_trains_a_position_table_beside_a_tied_head_at_the_heads_lr():
    """GPT-2's token table is its head (tied), so its embedding role holds the learned position table alone: under
    Muon's defaults that table takes the head's LR, not nanochat's token-embedding LR (0.49 at width 128, which
    trained GPT-2 to val loss 3.06 where the head's gave 2.04: docs/benchmarks.md). The native GPT's token table
    keeps the embedding LR; an explicit training.embedding_lr wins."""
    from tierlm.builders.optimizer import MUON_DEFAULT_LRS
    from tierlm.primitives.optim import width_lr_scale

    scale = width_lr_scale(128)
    for architecture, default in (("gpt2", "unembedding"), ("gpt", "embedding")):
        shape = [f"model.architecture={architecture}", "model.depth=2", "model.aspect_ratio=64", "model.head_dim=32"]
        config = TierlmConfig.load(None, [*shape, "training.optimizer=muon", "training.num_train_steps=10"])
        resolved, _ = resolve(config, STAGES["pretrain"], new_model(config, 512, "meta"))
        assert resolved.training.embedding_lr == pytest.approx(MUON_DEFAULT_LRS[default] * scale), architecture
        assert resolved.training.unembedding_lr == pytest.approx(MUON_DEFAULT_LRS["unembedding"] * scale)
    config = TierlmConfig.load(None, [*shape[1:], "model.architecture=gpt2", "training.optimizer=muon",
                                      "training.num_train_steps=10", "training.embedding_lr=0.3"])  # fmt: skip
    assert resolve(config, STAGES["pretrain"], new_model(config, 512, "meta"))[0].training.embedding_lr == 0.3


def test_plan_explicit_values_win_and_bad_batches_are_refused():
    config, plan = _plan(12, num_train_steps=100)
    assert config.training.num_train_steps == 100 and plan.num_train_steps == 100
    with pytest.raises(ConfigError, match="must be a multiple of one micro-batch"):
        _plan(12, total_batch_size=100_000)
    config, plan = _plan(12, world_size=1, total_batch_size=2**18)
    assert plan.accumulation == 4 and plan.lr_scale == pytest.approx(0.5**0.5)
    assert optimal_batch_tokens(1.0, 1.0) == 524_288


def test_parameter_counts_of_a_native_model():
    config = TierlmConfig.load(None, ["model.depth=2", "model.aspect_ratio=32", "model.head_dim=32"])
    counts = parameter_counts(new_model(config, 100, "meta"))
    # width 64, SwiGLU ceil(8/3 x 64 / 32) x 32 = 192: 2 x (4 x 64^2 + 3 x 64 x 192) = 106,496; head and embedding 100 x
    # 64.
    assert counts["matrix"] == 106_496 and counts["unembedding"] == counts["embedding"] == 6_400
    assert (
        counts["scalar"] == 2 * (2 * 64 + 2 * 32) + 64
    )  # two norms of 64 and q/k norms of 32 per block; the final norm


@pytest.mark.slow
def test_tierlm_plan_matches_what_the_run_does(tmp_path):
    """`tierlm plan` prints the steps, batch and accumulation; the run then trains exactly those,
    records them in its config.yaml, and prints the same table at its start."""
    import json
    import re

    import yaml

    from conftest import TINY, run_main

    args = [
        "--config",
        "tiny_pretrain",
        *TINY,
        "data.max_seq_length=64",
        "training.per_device_train_batch_size=16",
        "training.target_param_data_ratio=10.5",
        "training.total_batch_size=auto",
        "training.num_train_steps=null",
        "training.optimizer=muon",
        "training.weight_decay=0.1",
        f"infra.output_dir={tmp_path / 'run'}",
    ]
    planned = run_main("plan", *args)
    assert planned.returncode == 0, planned.stderr
    steps = int(re.search(r"steps\s+([\d,]+) \(", planned.stdout).group(1).replace(",", ""))
    batch, accumulation = re.search(
        r"batch\s+([\d,]+) tokens/step = 1,024 per micro-batch x 1 rank\(s\) x (\d+) accumulation", planned.stdout
    ).groups()
    batch = int(batch.replace(",", ""))
    assert batch == 1024 * int(accumulation) and steps >= 2, planned.stdout

    trained = run_main("pretrain", *args)
    assert trained.returncode == 0, trained.stderr
    plan_table = planned.stdout.split("memory per rank")[
        0
    ].strip()  # (the memory estimate follows it; the run prints its own)
    assert plan_table in trained.stdout and "memory per rank" in trained.stdout  # the same table, logged at the start
    recorded = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["training"]
    assert (recorded["num_train_steps"], recorded["total_batch_size"], recorded["gradient_accumulation_steps"]) == (
        steps,
        batch,
        int(accumulation),
    )
    train = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"train"' in line
    ]
    assert train[-1]["step"] == steps and train[-1]["tokens_seen"] == steps * batch


# -- seed 003's optimizers, against plain references ----------------------------------------
def reference_spam(w, grads, lr, betas, eps, wd, theta, interval, warmup, clip_delay):
    """SPAM as its description reads, one scalar loop per step, in float64."""
    b1, b2 = betas
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    for done, g in enumerate(grads):
        r = done % interval
        if done and r == 0:
            m, v = torch.zeros_like(w), torch.zeros_like(w)
        if r >= clip_delay:
            spike = g * g > theta * v
            g = torch.where(spike, torch.sign(g) * torch.sqrt(theta * v), g)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        t = done + 1
        ramp = 0.01 + 0.99 * (1 - math.cos(math.pi * min(r, warmup) / warmup)) / 2
        w = w * (1 - lr * wd) - lr * ramp * (m / (1 - b1**t)) / (torch.sqrt(v / (1 - b2**t)) + eps)
    return w


def test_adamw_spam_equals_the_reference_across_a_reset_and_clipping():
    from tierlm.primitives.optim.spam import AdamWSPAM

    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(6, 5, generator=g) * (50.0 if step in (12, 17) else 1.0) for step in range(20)]  # two spikes
    w0 = torch.randn(6, 5, generator=g)
    p = nn.Parameter(w0.clone())
    opt = AdamWSPAM(
        [p], lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, theta=4.0, interval=8, warmup=3, clip_delay=2
    )
    for grad in grads:
        p.grad = grad.clone()
        opt.step()
    ref = reference_spam(w0.double(), [x.double() for x in grads], 0.01, (0.9, 0.999), 1e-8, 0.1, 4.0, 8, 3, 2)
    torch.testing.assert_close(p.detach().double(), ref, atol=1e-6, rtol=0)
    # Clipping happened (theta = 4 is tight): without it the weights differ.
    unclipped = reference_spam(
        w0.double(), [x.double() for x in grads], 0.01, (0.9, 0.999), 1e-8, 0.1, float("inf"), 8, 3, 2
    )
    assert (unclipped - ref).abs().max() > 1e-3


def test_adamw_spam_state_saved_mid_run_continues_as_the_straight_run():
    """SPAM's state (moments, step count, the reset and warm-up clocks) through state_dict / load_state_dict into a
    new optimizer at step 10 of 20 (a reset at 8 and 16, spikes after the reload): the weights end bit for bit as
    the straight run's. (The SIGKILL resume test runs Muon and AdamWPrune through a real process.)"""
    from tierlm.primitives.optim.spam import AdamWSPAM

    g = torch.Generator().manual_seed(5)
    grads = [torch.randn(6, 5, generator=g) * (50.0 if step in (12, 17) else 1.0) for step in range(20)]
    w0 = torch.randn(6, 5, generator=g)
    settings = dict(lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, theta=4.0, interval=8, warmup=3)

    def run(steps, p, opt):
        for grad in steps:
            p.grad = grad.clone()
            opt.step()

    straight = nn.Parameter(w0.clone())
    run(grads, straight, AdamWSPAM([straight], **settings))
    first = nn.Parameter(w0.clone())
    opt = AdamWSPAM([first], **settings)
    run(grads[:10], first, opt)
    second = nn.Parameter(first.detach().clone())
    reloaded = AdamWSPAM([second], **settings)
    reloaded.load_state_dict(copy.deepcopy(opt.state_dict()))
    run(grads[10:], second, reloaded)
    assert torch.equal(second.detach(), straight.detach())


def test_adamw_spam_without_resets_spikes_or_warmup_is_torch_adamw():
    from tierlm.primitives.optim.spam import AdamWSPAM

    ours, theirs = _model(), _model()
    _train(
        ours,
        AdamWSPAM(
            ours.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, theta=float("inf"), interval=0, warmup=0
        ),
    )
    _train(theirs, torch.optim.AdamW(theirs.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1))
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def reference_prune(ws, grads, lr, betas, eps, final, warmup, frequency, total, score):
    """AdamW + global-threshold masks, written plainly over a list of matrices, in float64."""
    b1, b2 = betas
    ms = [torch.zeros_like(w) for w in ws]
    vs = [torch.zeros_like(w) for w in ws]
    masks = [torch.ones_like(w, dtype=torch.bool) for w in ws]
    for t, gs in enumerate(grads, start=1):
        for i, g in enumerate(gs):
            g = g * masks[i]
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            ws[i] = ws[i] - lr * (ms[i] / (1 - b1**t)) / (torch.sqrt(vs[i] / (1 - b2**t)) + eps)
        if t > warmup and (t - warmup) % frequency == 0:
            sparsity = final * min(1.0, (t - warmup) / (total - warmup)) ** 3
            scores = [w.abs() * v.sqrt().sqrt() if score == "fourth_root_v" else w.abs() for w, v in zip(ws, vs)]
            scores = [torch.where(mk, s, torch.tensor(float("-inf"), dtype=s.dtype)) for s, mk in zip(scores, masks)]
            flat = torch.cat([s.flatten() for s in scores])
            k = int(sparsity * flat.numel())
            if k:
                threshold = flat.sort().values[k - 1]
                masks = [mk & (s > threshold) for mk, s in zip(masks, scores)]
        ws = [w * mk for w, mk in zip(ws, masks)]
        ms = [m * mk for m, mk in zip(ms, masks)]
        vs = [v * mk for v, mk in zip(vs, masks)]
    return ws, masks


@pytest.mark.parametrize("score", ["fourth_root_v", "magnitude"])
def test_adamw_prune_equals_the_reference_and_follows_the_schedule(score):
    from tierlm.primitives.optim.prune import AdamWPrune, target_sparsity

    g = torch.Generator().manual_seed(4)
    shapes = [(8, 6), (6, 10)]
    w0 = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(20)]
    params = [nn.Parameter(w.clone()) for w in w0]
    opt = AdamWPrune(
        [{"params": params, "prune": True}],
        lr=0.01,
        betas=(0.9, 0.95),
        score=score,
        final_sparsity=0.5,
        warmup=4,
        frequency=3,
        total_steps=16,
    )
    seen = []
    for step, gs in enumerate(grads, start=1):
        for p, grad in zip(params, gs):
            p.grad = grad.clone()
        opt.step()
        seen.append(opt.sparsity())
        expected = (
            target_sparsity(4 + 3 * ((step - 4) // 3), 0.5, 4, 16) if step > 4 else 0.0
        )  # the last mask update's target
        assert abs(seen[-1] - int(expected * 108) / 108) < 1e-9, (step, seen[-1], expected)
    assert len(set(seen)) > 3 and seen[-1] == 54 / 108  # several mask changes, ending at 50%
    ref, masks = reference_prune(
        [w.double() for w in w0],
        [[x.double() for x in gs] for gs in grads],
        0.01,
        (0.9, 0.95),
        1e-8,
        0.5,
        4,
        3,
        16,
        score,
    )
    for p, r, mk in zip(params, ref, masks):
        torch.testing.assert_close(p.detach().double(), r, atol=1e-6, rtol=0)
        assert torch.equal(p.detach() == 0, ~mk)  # pruned entries are exactly zero
        assert torch.equal(opt.state[p]["mask"], mk)


def test_adamw_prune_samples_the_threshold_of_a_large_model():
    from tierlm.primitives.optim.prune import AdamWPrune

    w = nn.Parameter(torch.randn(200, 100, generator=torch.Generator().manual_seed(5)))
    opt = AdamWPrune(
        [{"params": [w], "prune": True}],
        score="magnitude",
        final_sparsity=0.5,
        warmup=0,
        frequency=1,
        total_steps=1,
        sample_size=2000,
    )  # 20,000 scores: a 2,000-score sample sets the threshold
    w.grad = torch.zeros_like(w)
    opt.step()
    assert abs(opt.sparsity() - 0.5) < 0.03 and bool((w == 0).eq(~opt.state[w]["mask"]).all())
