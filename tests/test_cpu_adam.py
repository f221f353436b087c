"""CPU Adam: the C++ kernel and its PyTorch fallback against torch.optim, dtypes, errors."""

import copy
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch
from torch.testing import assert_close

from zerotune.ops import load_op
from zerotune.optim import cpu_adam
from zerotune.optim.cpu_adam import CPUAdam, adam_update, backend, fallback_adam_update

SIZES = [1, 15, 16, 17, 1_000_003]
STEPS = 20
LR, BETAS, EPS = 1e-2, (0.9, 0.999), 1e-8
TOL = {"rtol": 1e-6, "atol": 1e-7}
MODES = [  # (adamw, weight_decay)
    pytest.param(True, 0.0, id="adamw-nowd"),
    pytest.param(True, 0.1, id="adamw-wd"),
    pytest.param(False, 0.1, id="adam-l2"),
]


@pytest.fixture(scope="module")
def op():
    module = load_op("adam")
    if module is None:
        pytest.skip("C++ adam op unavailable here (the fallback tests still run)")
    return module


def _levels():
    module = load_op("adam")
    if module is None:
        return ["scalar"]
    order = ["scalar", "avx2", "avx512"]
    return order[: order.index(module.set_simd_level("auto")) + 1]


@pytest.fixture(params=_levels())
def simd(request, op):
    op.set_simd_level(request.param)
    yield request.param
    op.set_simd_level("auto")


def _grads(n, steps=STEPS, seed=1, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(dtype) for _ in range(steps)]


def _start(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)


def _run(update, n, grads, **kw):
    p, m, v = _start(n)
    for step, g in enumerate(grads, 1):
        update(p, g, m, v, step=step, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, **kw)
    return p, m, v


def _torch_reference(n, grads, adamw, weight_decay, fused=False):
    p0, _, _ = _start(n)
    param = torch.nn.Parameter(p0)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    how = {"fused": True} if fused else {"foreach": False}
    opt = cls([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=weight_decay, **how)
    for g in grads:
        param.grad = g.float()
        opt.step()
    state = opt.state[param]
    return param.detach(), state["exp_avg"], state["exp_avg_sq"]


@pytest.mark.parametrize("adamw, weight_decay", MODES)
@pytest.mark.parametrize("n", SIZES)
def test_matches_torch_optim(simd, n, adamw, weight_decay):
    grads = _grads(n)
    got = _run(adam_update, n, grads, weight_decay=weight_decay, adamw=adamw)
    want = _torch_reference(n, grads, adamw, weight_decay)
    for g, w in zip(got, want):
        assert_close(g, w, **TOL)


def test_simd_levels_are_bit_identical(op):
    n = 4099  # several vectors plus a ragged tail
    grads = _grads(n, steps=5)
    results = {}
    try:
        for level in _levels():
            op.set_simd_level(level)
            results[level] = _run(adam_update, n, grads, weight_decay=0.1, adamw=False)
    finally:
        op.set_simd_level("auto")
    base = results.pop("scalar")
    for level, got in results.items():
        for g, b in zip(got, base):
            assert torch.equal(g, b), level


@pytest.mark.parametrize("n", [15, 16, 143, 144, 145, 527, 528, 529, 4099, (1 << 17) + 5])
def test_prefetch_distances_are_bit_identical(op, n):
    """The prefetch distance (per CPU vendor, [Note: prefetch]) moves the loops' bounds:
    every distance, none included, updates every element to the same bits, at the sizes
    around each bound and on the threaded path."""
    grads = _grads(n, steps=3)
    detected = op.set_prefetch(-1)
    assert detected in (0, 128, 512)
    results = {}
    try:
        for ahead in (0, 16, 128, 512, 1024):
            assert op.set_prefetch(ahead) == ahead == op.prefetch_distance()
            results[ahead] = _run(adam_update, n, grads, weight_decay=0.1, adamw=True)
    finally:
        op.set_prefetch(-1)
    assert op.prefetch_distance() == detected
    want = _torch_reference(n, grads, True, 0.1)
    for got in results.values():
        for g, b, w in zip(got, results[0], want):
            assert torch.equal(g, b)
            assert_close(g, w, **TOL)
    for bad in (8, -2, 1 << 17):
        with pytest.raises(RuntimeError, match="prefetch distance"):
            op.set_prefetch(bad)
    assert op.prefetch_distance() == detected


def _fp32(x):
    """Round a float64 tensor to the nearest fp32 (kept as float64 for the next operation)."""
    return x.float().double()


@pytest.mark.parametrize("beta2, step", [(0.999, 1), (0.999, 7), (0.95, 3), (0.9999, 1000)])
def test_denominator_is_correctly_rounded_over_the_whole_range(simd, beta2, step):
    # exp_avg_sq takes every magnitude fp32 has (subnormals, inf and NaN included). With
    # param and grad zero, no weight decay and eps = 0 the new param is the quotient
    # (-step_size * m) / (sqrt(v * beta2) / sqrt(bc2)), so any last-bit difference in the
    # denominator shows. The reference rounds each operation of [Note: formula order] once to
    # fp32: float64 sqrt and division, then rounding, are the correctly rounded fp32 results.
    n = (1 << 20) + 13  # the threaded path and a ragged tail
    gen = torch.Generator().manual_seed(3)
    v = torch.randint(0, 0x7F800000, (n,), generator=gen, dtype=torch.int32).view(torch.float32)
    special = [0.0, float("inf"), float("nan"), 1e-45, 1.2e-38, 3.4e38, 1.0, 4.0]
    v[: len(special)] = torch.tensor(special)
    m = torch.randn(n, generator=gen)
    p = torch.zeros(n)
    m_ref, v_ref = m.double(), v.double()
    v_start = v_ref
    lr, beta1 = 1e-3, 0.9
    zero = torch.zeros(n)
    kw = dict(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=0.0, weight_decay=0.0)
    adam_update(p, zero, m, v, **kw)

    w = _fp32(torch.tensor(1 - beta1, dtype=torch.float64))
    m_ref = _fp32(m_ref - w * m_ref)  # lerp toward a zero grad: one fma, exact in float64
    v_ref = _fp32(v_ref * _fp32(torch.tensor(beta2, dtype=torch.float64)))
    bc2_sqrt = _fp32(torch.tensor((1 - beta2**step) ** 0.5, dtype=torch.float64))
    denom = _fp32(_fp32(v_ref.sqrt()) / bc2_sqrt)
    neg_step = _fp32(torch.tensor(-(lr / (1 - beta1**step)), dtype=torch.float64))
    p_ref = _fp32(_fp32(neg_step * m_ref) / denom).float() + 0.0
    results = [("exp_avg", m, m_ref.float()), ("exp_avg_sq", v, v_ref.float()), ("param", p, p_ref)]
    for name, got, want in results:
        same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
        bad = (~same).nonzero().flatten()
        if bad.numel():
            i = bad[0].item()
            pytest.fail(
                f"{name}: {bad.numel()} elements differ, first at {i}: {got[i].item()!r} vs "
                f"{want[i].item()!r} (exp_avg_sq was {v_start[i].item()!r})"
            )


def _textbook_adam(n, grads, adamw, weight_decay, bias_correction):
    """Adam as written in the papers, step by step in fp32 (an independent reference)."""
    p, m, v = _start(n)
    b1, b2 = BETAS
    for step, g in enumerate(grads, 1):
        g = g.float()
        if weight_decay and adamw:
            p = p * (1 - LR * weight_decay)
        elif weight_decay:
            # torch's add(alpha=) rounds once (an fma); with g + wd * p, elements where the
            # two nearly cancel would differ by more than rounding.
            g = g.add(p, alpha=weight_decay)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        c1 = 1 - b1**step if bias_correction else 1.0
        c2 = 1 - b2**step if bias_correction else 1.0
        p = p - LR * (m / c1) / ((v / c2).sqrt() + EPS)
    return p, m, v


@pytest.mark.parametrize("adamw, weight_decay", MODES)
@pytest.mark.parametrize("n", [1, 17, 100_003])
@pytest.mark.parametrize("update", [adam_update, fallback_adam_update], ids=["op", "fallback"])
def test_without_bias_correction(update, n, adamw, weight_decay):
    grads = _grads(n)
    got = _run(update, n, grads, weight_decay=weight_decay, adamw=adamw, bias_correction=False)
    want = _textbook_adam(n, grads, adamw, weight_decay, bias_correction=False)
    for g, w in zip(got, want):
        assert_close(g, w, rtol=1e-6, atol=1e-6)
    # Moves differ from the bias-corrected update: the flag is honoured.
    corrected = _run(update, n, grads, weight_decay=weight_decay, adamw=adamw)
    assert not torch.equal(corrected[0], got[0])


@pytest.mark.parametrize("gdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [17, 1_000_003])
def test_low_precision_grads(gdtype, n):
    grads = _grads(n, dtype=gdtype)
    got = _run(adam_update, n, grads, weight_decay=0.1, adamw=True)
    want = _torch_reference(n, grads, adamw=True, weight_decay=0.1)  # grads upcast exactly
    for g, w in zip(got, want):
        assert_close(g, w, **TOL)


@pytest.mark.parametrize("odtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 17, 1_000_003])
def test_fused_low_precision_copy_is_exact(simd, odtype, n):
    p, m, v = _start(n)
    out = torch.empty(n, dtype=odtype)
    for step, g in enumerate(_grads(n, steps=3), 1):
        adam_update(
            p,
            g,
            m,
            v,
            step=step,
            lr=LR,
            beta1=0.9,
            beta2=0.999,
            eps=EPS,
            weight_decay=0.1,
            out_lowp=out,
        )
        assert torch.equal(out, p.to(odtype))


@pytest.mark.parametrize("odtype", [torch.bfloat16, torch.float16])
def test_fused_copy_rounding_edge_cases(simd, odtype):
    # lr=0 and zero grads leave param unchanged (signed zeros included), so out must be
    # exactly param.to(dtype): ties to even, subnormals, fp16 overflow to inf, inf, NaN.
    ties = [1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-11, 1.0 + 3 * 2**-11]
    fp16_edges = [65504.0, 65520.0, 70000.0, -7e4, 1e-6, 6e-8]
    others = [0.0, -0.0, 1e-40, 3.0e38, float("inf"), -float("inf")]
    special = torch.tensor(ties + fp16_edges + others)
    for n, offset in ((len(special), 0), (2_000_000, 0), (2_000_000, 3)):
        base = torch.randn(n + offset)
        base[offset : offset + len(special)] = special
        base[-len(special) :] = special
        p = base[offset:]
        expected = p.to(odtype)
        buf = torch.empty(n + offset, dtype=odtype)
        out = buf[offset:]  # offset 3: unaligned output, the non-streaming store path
        adam_update(
            p,
            torch.zeros(n),
            torch.zeros(n),
            torch.zeros(n),
            step=1,
            lr=0.0,
            beta1=0.9,
            beta2=0.999,
            eps=EPS,
            weight_decay=0.0,
            out_lowp=out,
        )
        assert torch.equal(out, expected)
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16))  # -0.0 too
    nan = torch.tensor([float("nan")] * 3)
    out = torch.empty(3, dtype=odtype)
    adam_update(
        nan,
        torch.zeros(3),
        torch.zeros(3),
        torch.zeros(3),
        step=1,
        lr=0.0,
        beta1=0.9,
        beta2=0.999,
        eps=EPS,
        weight_decay=0.0,
        out_lowp=out,
    )
    assert out.isnan().all()


@pytest.mark.parametrize("adamw, weight_decay", MODES)
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16])
def test_fallback_matches_op(op, gdtype, adamw, weight_decay):
    n = 300_007
    grads = _grads(n, dtype=gdtype)
    outs = []
    for update in (adam_update, fallback_adam_update):
        out = torch.empty(n, dtype=torch.bfloat16)
        p, m, v = _run(update, n, grads, weight_decay=weight_decay, adamw=adamw, out_lowp=out)
        assert torch.equal(out, p.to(torch.bfloat16))
        outs.append((p, m, v))
    for g, w in zip(*outs):
        assert_close(g, w, **TOL)


@pytest.mark.parametrize("adamw, weight_decay", MODES)
def test_adam_update_without_op_is_torchs_fused_step(monkeypatch, adamw, weight_decay):
    monkeypatch.setattr(cpu_adam, "load_op", lambda name: None)
    assert backend() == "torch-fallback"
    n = 1000
    grads = _grads(n)
    got = _run(adam_update, n, grads, weight_decay=weight_decay, adamw=adamw)
    want = _torch_reference(n, grads, adamw=adamw, weight_decay=weight_decay, fused=True)
    for g, w in zip(got, want):
        assert torch.equal(g, w)  # the same kernel: bit-identical


def test_adam_update_without_op_or_bias_correction_is_the_fallback(monkeypatch):
    grads = _grads(1000, dtype=torch.bfloat16)
    kw = dict(weight_decay=0.1, adamw=True, bias_correction=False)
    want = _run(fallback_adam_update, 1000, grads, **kw)
    monkeypatch.setattr(cpu_adam, "load_op", lambda name: None)
    got = _run(adam_update, 1000, grads, **kw)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("n", [1, 17, 545, 100_003])
def test_bandwidth_probe_adds_the_grad(op, simd, n):
    # benchmarks/cpu_adam.py divides by this loop's rate: it must do the work it claims.
    gen = torch.Generator().manual_seed(n)
    p, g, m, v = (torch.randn(n, generator=gen) for _ in range(4))
    want = (p + g, m + g, v + g)
    op.stream_probe(p, g, m, v)
    for got, w in zip((p, m, v), want):
        assert torch.equal(got, w)


def test_backend_names_the_simd_level(op):
    assert backend() == f"cpp-{op.simd_level()}"
    assert op.simd_level() in ("avx512", "avx2", "scalar")
    assert op.max_threads() >= 1


def _args(n=8, **over):
    t = {
        "param": torch.zeros(n),
        "grad": torch.zeros(n),
        "exp_avg": torch.zeros(n),
        "exp_avg_sq": torch.zeros(n),
    }
    kw = {"step": 1, "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0}
    for k, val in over.items():
        (t if k in t or k == "out_lowp" else kw)[k] = val
    return t, kw


@pytest.mark.parametrize(
    "over, exc, match",
    [
        ({"param": torch.zeros(8, dtype=torch.float64)}, TypeError, "param must be float32"),
        ({"exp_avg_sq": torch.zeros(8, dtype=torch.bfloat16)}, TypeError, "exp_avg_sq must be"),
        ({"grad": torch.zeros(8, dtype=torch.int32)}, TypeError, "grad must be float32, bf"),
        ({"out_lowp": torch.zeros(8)}, TypeError, "out_lowp must be bfloat16 or float16"),
        ({"grad": [0.0] * 8}, TypeError, "grad must be a torch.Tensor"),
        ({"exp_avg": torch.zeros(8, device="meta")}, ValueError, "exp_avg must be on the CPU"),
        ({"param": torch.zeros(16)[::2]}, ValueError, "param must be contiguous"),
        ({"grad": torch.zeros(4, 4).t()}, ValueError, "grad must be contiguous"),
        ({"exp_avg": torch.zeros(9)}, ValueError, "exp_avg has 9 elements but param has 8"),
        ({"out_lowp": torch.zeros(7, dtype=torch.bfloat16)}, ValueError, "out_lowp has 7"),
        ({"step": 0}, ValueError, "step must be an integer >= 1"),
        ({"step": 1.5}, ValueError, "step must be an integer >= 1"),
        ({"beta2": 1.0}, ValueError, "betas must be in"),
        ({"lr": -1.0}, ValueError, "lr must be >= 0"),
    ],
)
def test_clear_errors(over, exc, match):
    tensors, kw = _args(**over)
    out = tensors.pop("out_lowp", None)
    with pytest.raises(exc, match=match):
        adam_update(*tensors.values(), out_lowp=out, **kw)


def test_overlapping_buffers_are_rejected():
    buf = torch.zeros(16)
    tensors, kw = _args(exp_avg=buf[:8], exp_avg_sq=buf[4:12])
    with pytest.raises(ValueError, match="overlap in memory"):
        adam_update(*tensors.values(), **kw)


def test_shapes_may_differ_when_numel_matches():
    p = torch.ones(4, 6)
    adam_update(
        p,
        torch.ones(24, dtype=torch.float16),
        torch.zeros(2, 12),
        torch.zeros(24),
        step=torch.tensor(1.0),
        lr=0.1,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
    )
    assert_close(p, torch.full((4, 6), 0.9), **TOL)  # first Adam step moves by lr


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _train(model, opt, sched, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(32, 8, generator=gen)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def _sched(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


@pytest.mark.parametrize("adamw", [True, False])
def test_cpu_adam_optimizer_matches_torch_with_scheduler(adamw):
    ours, ref = _model(), _model()
    opt = CPUAdam(ours.parameters(), lr=1e-2, weight_decay=0.05, adamw_mode=adamw)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref_opt = cls(ref.parameters(), lr=1e-2, weight_decay=0.05, foreach=False)
    sched, ref_sched = _sched(opt), _sched(ref_opt)
    _train(ours, opt, sched, 10)
    _train(ref, ref_opt, ref_sched, 10)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 11)
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert_close(a, b, **TOL)
    state = opt.state[next(ours.parameters())]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
    assert state["step"].item() == 10


def test_cpu_adam_state_dict_round_trip():
    model = _model()
    opt = CPUAdam(model.parameters(), lr=1e-2)
    sched = _sched(opt)
    _train(model, opt, sched, 5)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    # state_dict() holds references to the live state, which steps update in place.
    saved_opt, saved_sched = copy.deepcopy(opt.state_dict()), sched.state_dict()
    _train(model, opt, sched, 3, seed=2)

    resumed = _model()
    resumed.load_state_dict(saved_model)
    opt2 = CPUAdam(resumed.parameters(), lr=1.0)  # lr comes back from the state dict
    sched2 = _sched(opt2)  # (the usual resume order: scheduler, then both state dicts)
    opt2.load_state_dict(saved_opt)
    sched2.load_state_dict(saved_sched)
    _train(resumed, opt2, sched2, 3, seed=2)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    assert opt2.state[next(resumed.parameters())]["step"].item() == 8


def test_cpu_adam_bias_correction_flag():
    model_a, model_b = _model(), _model()
    opt_a = CPUAdam(model_a.parameters(), lr=1e-2, bias_correction=True)
    opt_b = CPUAdam(model_b.parameters(), lr=1e-2, bias_correction=False)
    _train(model_a, opt_a, _sched(opt_a), 2)
    _train(model_b, opt_b, _sched(opt_b), 2)
    assert not torch.equal(next(model_a.parameters()), next(model_b.parameters()))
    with pytest.raises(ValueError, match="betas"):
        CPUAdam(model_a.parameters(), betas=(0.9, 1.5))


@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16], ids=["fp32-grad", "bf16-grad"])
def test_multi_tensor_update_is_torchs_fused_step_per_segment(gdtype, monkeypatch):
    """What an accelerator runs: the segments of one shard (two parameter groups, steps
    counted apart, AdamW and L2 Adam, one without bias correction) each updated exactly as
    torch.optim's fused step updates that parameter alone, bf16 copy included; gradients
    in another dtype converted in pieces (a small cap cuts spans across batches)."""
    monkeypatch.setattr(cpu_adam, "_FUSED_CONVERT", 1000)
    n = 5000
    spans = [(0, 1200), (1200, 1201), (1300, 3700), (3700, 4100), (4100, 5000)]
    kws = [  # (lr, weight_decay, adamw, bias_correction, step)
        (1e-2, 0.1, True, True, 3),
        (1e-2, 0.1, True, True, 3),
        (1e-3, 0.0, True, True, 1),
        (1e-2, 0.1, False, True, 3),
        (1e-2, 0.1, True, False, 2),
    ]
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen).to(gdtype)
    m = torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) * 0.01
    out = torch.zeros(n, dtype=torch.bfloat16)
    want = master.clone()
    segments = []
    for (a, b), (lr, wd, adamw, bc, step) in zip(spans, kws):
        kw = dict(step=step, lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wd)
        segments.append((a, b, {**kw, "adamw": adamw, "bias_correction": bc}))
        p = torch.nn.Parameter(master[a:b].clone())
        p.grad = grad[a:b].float()
        if not bc:  # torch's fused step always corrects: the fallback's numbers
            fallback_adam_update(p.data, p.grad, m[a:b].clone(), v[a:b].clone(), **segments[-1][2])
            want[a:b] = p.data
            continue
        cls = torch.optim.AdamW if adamw else torch.optim.Adam
        opt = cls([p], lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd, fused=True)
        opt.state[p] = {
            "step": torch.tensor(float(step - 1)),
            "exp_avg": m[a:b].clone(),
            "exp_avg_sq": v[a:b].clone(),
        }
        opt.step()
        want[a:b] = p.data
    m0, v0 = m.clone(), v.clone()
    cpu_adam.multi_tensor_adam_update(master, grad, m, v, segments, out)
    gap = slice(1201, 1300)  # in no segment: untouched
    assert torch.equal(master, want)
    assert torch.equal(out[:1201], want[:1201].to(torch.bfloat16))
    assert torch.equal(out[1300:], want[1300:].to(torch.bfloat16))
    assert not out[gap].any()
    assert torch.equal(m[gap], m0[gap]) and torch.equal(v[gap], v0[gap])
    assert not torch.equal(m[:1200], m0[:1200])
