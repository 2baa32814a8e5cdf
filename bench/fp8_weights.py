"""Block-scaled FP8 weights (``dualpath quantize``, and ``--quantization fp8`` at load) against the model's own,
same run, SmolLM2-135M-Instruct:

1. memory: bytes of the transformer layers' weights held by an engine, bfloat16 against FP8 (stored, and quantized
   at load in DeepSeek's blocks of 128 x 128);
2. accuracy: prompt logprobs of chat prompts (every position of each) and greedy replies of the FP8 checkpoint
   against the bfloat16 and float32 models, with bfloat16 against float32 as the yardstick of an error users
   accept; float32 activations over the FP8 weights isolate the weights' own rounding;
3. time on this CPU (report only): the torch reference dequantizes each weight per call, so FP8 costs time here;
   the speed of the w8a16 kernel is the GPU bench's (``bench/gpu/kernels.py``, parts fp8_gemm and fp8_model);
   and what quantizing at load adds to loading the bfloat16 model.

SmolLM2's q/k/v rows (576, 192, 192) are multiples of 64, not of 128: blocks of 64 keep every projection of a
stored checkpoint FP8 (with 128, the fused q/k/v projection would load dequantized). Quantizing at load joins the
parts first, so blocks of 128 hold every projection FP8.

    python bench/fp8_weights.py [--block 64 64] [--model DIR] [--reply-tokens 48]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import best_of, print_table, write_result  # noqa: E402
from kv_fp8 import PROMPTS, compare, logprobs  # noqa: E402


def layer_weight_bytes(model_dir: str, dtype: str, quantize=None) -> int:
    from dualpath.engines.models import load_model

    model = load_model(model_dir, dtype=dtype, quantize=quantize)
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith("layers."))


def generate_seconds(model_dir: str, dtype: str, max_tokens: int) -> float:
    from dualpath import LLM, SamplingParams

    llm = LLM(model_dir, dtype=dtype)
    convs = [[{"role": "user", "content": p}] for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return best_of(lambda: llm.chat(convs, params), repeats=2)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--block", type=int, nargs=2, default=[64, 64])
    ap.add_argument("--reply-tokens", type=int, default=48, help="greedy tokens per prompt")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from dualpath.checkpoints.fp8 import quantize_checkpoint
    from dualpath.checkpoints.smollm2 import default_model_dir
    from dualpath.core.config import WeightQuantConfig
    from dualpath.engines.models import load_model

    model = args.model or str(default_model_dir())
    fp8 = str(quantize_checkpoint(model, Path(tempfile.mkdtemp()) / "fp8", tuple(args.block), progress=False))
    memory = {
        "bf16_layer_bytes": layer_weight_bytes(model, "bfloat16"),
        "fp8_layer_bytes": layer_weight_bytes(fp8, "bfloat16"),
        "fp8_at_load_layer_bytes": layer_weight_bytes(model, "bfloat16", WeightQuantConfig()),
    }
    memory["fp8_vs_bf16"] = memory["fp8_layer_bytes"] / memory["bf16_layer_bytes"]
    memory["fp8_at_load_vs_bf16"] = memory["fp8_at_load_layer_bytes"] / memory["bf16_layer_bytes"]
    runs = {
        name: logprobs(path, dtype, "auto", args.reply_tokens, quantization)
        for name, path, dtype, quantization in [
            ("fp32", model, "float32", None),
            ("bf16", model, "bfloat16", None),
            ("fp8_fp32", fp8, "float32", None),
            ("fp8_bf16", fp8, "bfloat16", None),
            ("at_load_fp32", model, "float32", "fp8"),
        ]
    }
    accuracy = [
        compare("bf16 vs fp32 (yardstick)", runs["bf16"], runs["fp32"]),
        compare("fp8 weights, fp32 activations vs fp32", runs["fp8_fp32"], runs["fp32"]),
        compare("fp8 weights, bf16 activations vs bf16", runs["fp8_bf16"], runs["bf16"]),
        compare("fp8 weights, bf16 activations vs fp32", runs["fp8_bf16"], runs["fp32"]),
        compare("fp8 at load (128 x 128), fp32 activations vs fp32", runs["at_load_fp32"], runs["fp32"]),
    ]
    times = {"bf16_s": generate_seconds(model, "bfloat16", 16), "fp8_s": generate_seconds(fp8, "bfloat16", 16)}
    times["fp8_vs_bf16"] = times["fp8_s"] / times["bf16_s"]
    load = {
        "bf16_load_s": best_of(lambda: load_model(model, dtype="bfloat16"), repeats=3),
        "fp8_at_load_s": best_of(lambda: load_model(model, dtype="bfloat16", quantize=WeightQuantConfig()), repeats=3),
    }
    load["at_load_vs_bf16"] = load["fp8_at_load_s"] / load["bf16_load_s"]
    print_table([memory], list(memory))
    print_table(
        accuracy,
        [
            "comparison",
            "positions",
            "mean_abs_dlogprob",
            "p99_abs_dlogprob",
            "max_abs_dlogprob",
            "greedy_tokens_equal_before_divergence",
        ],
    )
    print_table([times], list(times))
    print_table([load], list(load))
    result = {
        "block": args.block,
        "memory": memory,
        "accuracy": accuracy,
        "cpu_chat_4x16_tokens": times,
        "cpu_load": load,
    }
    print("wrote", write_result("fp8_weights", result, args.out))
    return result


if __name__ == "__main__":
    main()
