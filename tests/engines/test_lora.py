"""LoRA adapters: the engines' forward under an adapter against PEFT on transformers and against transformers on the
merged weights (float32, relative error under 1e-4), one batch mixing the base model and adapters, generation,
the chain root an adapter gives stored KV, and the adapters refused with a clear error."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dualpath import LLM, SamplingParams
from dualpath.checkpoints.tiny import build_tiny_adapter
from dualpath.core.errors import CheckpointError, ConfigError, RequestError
from dualpath.core.geometry import block_hashes, chain_root
from dualpath.core.lora import LoraModule, adapter_digest, read_adapter_config
from dualpath.engines.models import load_model
from dualpath.engines.models.base import ForwardBatch
from dualpath.engines.sampler import make_generator
from dualpath.engines.sequence import Sequence

TOL = 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def merged_checkpoint(base, adapter, out):
    """``base`` with the adapter folded into its weights (W + scale B A), as a checkpoint directory of its own."""
    shutil.copytree(base, out)
    cfg = read_adapter_config(adapter)
    weights = load_file(str(base / "model.safetensors"))
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    for key, a in lora.items():
        if ".lora_A." in key:
            b = lora[key.replace(".lora_A.", ".lora_B.")]
            name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            weights[name] = (weights[name].double() + cfg.scale * b.double() @ a.double()).float()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def other_adapters(tiny_dirs, tmp_path_factory):
    """(base, adapter) of the other architectures: Qwen2 (q/k/v biases, tied embeddings) and Qwen3-MoE (its
    experts are no target) under attention adapters, Qwen3 (per-head q/k norms, head_dim apart from hidden / heads)
    under one of every projection."""
    root = tmp_path_factory.mktemp("other-lora")
    return {
        "qwen": (tiny_dirs["qwen2"], build_tiny_adapter(root / "qwen", tiny_dirs["qwen2"], seed=5, targets=ATTENTION)),
        "qwen3": (tiny_dirs["qwen3"], build_tiny_adapter(root / "qwen3", tiny_dirs["qwen3"], seed=6)),
        "qwen3_moe": (
            tiny_dirs["qwen3_moe"],
            build_tiny_adapter(root / "qwen3_moe", tiny_dirs["qwen3_moe"], seed=7, targets=ATTENTION),
        ),
    }


def _case(name, tiny_dirs, tiny_adapters, other_adapters):
    return other_adapters[name] if name in other_adapters else (tiny_dirs["llama"], tiny_adapters[name])


def _ours(base, adapter, ids):
    model = load_model(base, "cpu", torch.float32, "torch")
    digest = model.add_adapter(adapter)
    logits, _ = model.forward_all(ids, ForwardBatch((0,), (len(ids),), (digest,)), all_logits=True)
    return logits


@pytest.mark.parametrize("name", ["sql", "poet", "qwen", "qwen3", "qwen3_moe"])
def test_an_adapter_computes_what_peft_computes(name, tiny_dirs, tiny_adapters, other_adapters):
    peft = pytest.importorskip("peft")
    import transformers

    base, adapter = _case(name, tiny_dirs, tiny_adapters, other_adapters)
    ids = torch.randint(0, 320, (45,))
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        without = hf(ids[None]).logits[0]
        ref = peft.PeftModel.from_pretrained(hf, adapter)(ids[None]).logits[0]
    got = _ours(base, adapter, ids)
    assert rel_err(got, ref) < TOL
    assert rel_err(without, ref) > 100 * TOL  # the adapter changes the model: the check above could fail


@pytest.mark.parametrize("name", ["sql", "poet", "qwen", "qwen3"])
def test_an_adapter_computes_what_its_merged_weights_compute(name, tiny_dirs, tiny_adapters, other_adapters, tmp_path):
    import transformers

    base, adapter = _case(name, tiny_dirs, tiny_adapters, other_adapters)
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        merged_checkpoint(base, adapter, tmp_path / "m"), dtype=torch.float32
    )
    ids = torch.randint(0, 320, (33,))
    with torch.no_grad():
        ref = merged(ids[None]).logits[0]
    assert rel_err(_ours(base, adapter, ids), ref) < TOL


def test_one_batch_mixes_the_base_model_and_adapters_over_cached_kv(tiny_dirs, tiny_adapters):
    """Four sequences, each with its own cached part (computed under its own adapter), in one forward: each row's
    logits are what that sequence alone gives."""
    model = load_model(tiny_dirs["llama"], "cpu", torch.float32, "torch")
    ids = {k: model.add_adapter(p) for k, p in tiny_adapters.items()}
    adapters = ("", ids["sql"], ids["poet"], ids["sql"])
    cached_lens, new_lens = (17, 0, 40, 3), (5, 9, 1, 12)
    seqs = [torch.randint(0, 320, (c + n,)) for c, n in zip(cached_lens, new_lens)]
    cached_kv = [[] for _ in range(model.config.num_layers)]
    for s, c, a in zip(seqs, cached_lens, adapters):
        kv = (
            model.forward_all(s[:c], ForwardBatch((0,), (c,), (a,)))[1]
            if c
            else [torch.empty(0, model.config.kv_elems_per_token)] * model.config.num_layers
        )
        for layer in range(model.config.num_layers):
            cached_kv[layer].append(kv[layer])
    new = torch.cat([s[c:] for s, c in zip(seqs, cached_lens)])
    got, _ = model.forward_all(new, ForwardBatch(cached_lens, new_lens, adapters), cached_kv)
    for i, (s, a) in enumerate(zip(seqs, adapters)):
        alone, _ = model.forward_all(s, ForwardBatch((0,), (len(s),), (a,)))
        assert rel_err(got[i], alone[0]) < 1e-5, i
    assert rel_err(got[1], model.forward_all(seqs[1], ForwardBatch((0,), (9,)))[0][0]) > 100 * TOL


def test_generation_under_adapters_in_one_batch_is_each_alone(tiny_dirs, tiny_adapters, tmp_path):
    """The reference runtime: greedy replies under the base model and two adapters, decoded together in one batch,
    are each what transformers generates from the merged weights (and what each gives alone)."""
    import transformers

    llm = LLM(str(tiny_dirs["llama"]), block_size=16, lora_modules={k: str(p) for k, p in tiny_adapters.items()})
    prompt = llm.tokenizer.encode("an adapter and its prompt, " * 3)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = {name: llm.generate(prompt, greedy, lora_request=name)[0].token_ids for name in (None, "sql", "poet")}
    assert len({tuple(t) for t in alone.values()}) == 3
    mixed = llm.generate([prompt] * 3, greedy, lora_request=list(alone))
    assert [o.token_ids for o in mixed] == list(alone.values())
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        merged_checkpoint(tiny_dirs["llama"], tiny_adapters["sql"], tmp_path / "m"), dtype=torch.float32
    )
    out = merged.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out[0, len(prompt) :].tolist() == alone["sql"]


def test_an_adapters_stored_kv_chains_from_its_identity():
    fp = bytes(16)
    a, b = "a" * 64, "b" * 64
    roots = {
        chain_root(fp),
        chain_root(fp, "", a),
        chain_root(fp, "", b),
        chain_root(fp, a),
        chain_root(fp, "tenant", a),
        chain_root(fp, "tenant"),
    }
    assert len(roots) == 6
    tokens = list(range(64))
    assert block_hashes(tokens, fp, 16, adapter=a) != block_hashes(tokens, fp, 16)
    assert block_hashes(tokens, fp, 16, adapter=a)[0] != block_hashes(tokens, fp, 16, salt=a)[0]


@pytest.mark.parametrize(
    "edit, match",
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "lora_only"}, "biases"),
        ({"modules_to_save": ["lm_head"]}, "modules_to"),
        ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
        ({"peft_type": "IA3"}, "not a LoRA"),
        ({"r": 0}, "r must"),
    ],
)
def test_adapter_options_it_cannot_compute_are_refused(edit, match, tiny_dirs, tiny_adapters, tmp_path):
    bad = shutil.copytree(tiny_adapters["sql"], tmp_path / "bad")
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, **edit}))
    model = load_model(tiny_dirs["llama"], "cpu", torch.float32, "torch")
    with pytest.raises(CheckpointError, match=match):
        model.add_adapter(bad)
    assert not model.adapters


def test_adapter_tensors_that_do_not_fit_are_refused(tiny_dirs, tiny_adapters, tmp_path):
    model = load_model(tiny_dirs["llama"], "cpu", torch.float32, "torch")
    src = load_file(str(tiny_adapters["sql"] / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"
    cases = {
        "shape": {**src, key: src[key][:-1]},
        "extra": {**src, "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)},
        "layer": {**src, key.replace("layers.1", "layers.7"): src[key].clone()},
    }
    for name, tensors in cases.items():
        bad = shutil.copytree(tiny_adapters["sql"], tmp_path / name)
        save_file(tensors, str(bad / "adapter_model.safetensors"))
        with pytest.raises(CheckpointError, match="do not fit" if name == "shape" else "not a LoRA matrix"):
            model.add_adapter(bad)
    with pytest.raises(CheckpointError, match="cannot read"):
        model.add_adapter(tmp_path / "nowhere")
    deepseek = load_model(tiny_dirs["deepseek_v3"], "cpu", torch.float32, "torch")
    with pytest.raises(CheckpointError, match="not supported for deepseek_v3"):
        deepseek.add_adapter(tiny_adapters["sql"])
    moe = load_model(tiny_dirs["qwen3_moe"], "cpu", torch.float32, "torch")  # its one dense MLP (layer 1) too
    with pytest.raises(
        CheckpointError,
        match=r"layers\.1\.mlp\.down_proj.* not a LoRA matrix of this model's "
        r"q_proj, k_proj, v_proj, o_proj in",
    ):
        moe.add_adapter(build_tiny_adapter(tmp_path / "moe-mlp", tiny_dirs["qwen3_moe"], targets=("down_proj",)))


def test_a_request_for_an_adapter_the_engine_lacks_is_refused(tiny_dirs):
    llm = LLM(str(tiny_dirs["llama"]), block_size=16)
    params = SamplingParams(max_tokens=2, adapter="0" * 64)
    with pytest.raises(RequestError, match="no LoRA adapter 000000000000") as e:
        llm.engine.add(Sequence.choices("x", [1, 2, 3], params, [make_generator(params, 0)]))
    assert e.value.field == "model"
    with pytest.raises(RequestError, match="64 hex digits"):
        SamplingParams(adapter="sql")


def test_lora_modules_parse_and_identify_their_files(tiny_adapters, tmp_path):
    assert LoraModule.parse("sql = /a/b=c") == LoraModule("sql", "/a/b=c")
    for bad in ("sql", "=/x", "sql="):
        with pytest.raises(ConfigError):
            LoraModule.parse(bad)
    copy = shutil.copytree(tiny_adapters["sql"], tmp_path / "copy")
    assert adapter_digest(copy) == adapter_digest(tiny_adapters["sql"])  # the bytes, not the place
    cfg = json.loads((copy / "adapter_config.json").read_text())
    (copy / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": 9}))
    assert adapter_digest(copy) != adapter_digest(tiny_adapters["sql"])


def test_speculative_decoding_under_an_adapter_changes_no_token(tiny_dirs, tiny_adapters):
    """Prompt-lookup drafts are verified by the adapter's own forward (several rows per sequence)."""
    prompt = list(range(40, 70)) * 3
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(tiny_dirs["llama"]), block_size=16).generate(prompt, greedy, lora_request=str(tiny_adapters["sql"]))
    spec = LLM(
        str(tiny_dirs["llama"]), block_size=16, speculative_config={"method": "ngram", "num_speculative_tokens": 4}
    )
    got = spec.generate(prompt, greedy, lora_request=str(tiny_adapters["sql"]))
    assert got[0].token_ids == plain[0].token_ids and spec.engine.spec_stats["drafted"] > 0


def test_the_cluster_options_carry_lora_modules_to_every_engine(tiny_adapters, tmp_path):
    from dualpath.cli import build_parser, engine_config
    from dualpath.launcher import ClusterSpec, LocalCluster

    mods = tuple(LoraModule(k, str(p)) for k, p in tiny_adapters.items())
    cluster = LocalCluster(ClusterSpec(model="m", lora_modules=mods), run_dir=str(tmp_path))
    argv = cluster._engine_args("decode", 0, 0)
    args = build_parser().parse_args(argv + ["--scheduler", "x:1"])
    assert engine_config(args).engine.lora_modules == mods
    with pytest.raises(SystemExit):
        build_parser().parse_args(["engine", "--role", "decode", "--scheduler", "x:1", "--lora-modules", "nameonly"])


def test_a_rollout_runs_every_round_under_its_adapter(tiny_adapters, tmp_path):
    """``dualpath rollout --lora``: a --lora-modules name or a directory gives the adapter's identity, every round's
    sampling carries it, and results written under another adapter (or none) are not resumed from."""
    from dualpath.cli import build_parser
    from dualpath.rollout.cli import rollout_adapter
    from dualpath.rollout.runner import Agent, Rollout, RolloutConfig, agent_digest
    from dualpath.rollout.trajectory import Round

    sql = adapter_digest(tiny_adapters["sql"])
    parse = lambda *a: build_parser().parse_args(["rollout", "t.jsonl", "--out", "o", *a])  # noqa: E731
    assert rollout_adapter(parse("--lora-modules", f"sql={tiny_adapters['sql']}", "--lora", "sql")) == sql
    assert rollout_adapter(parse("--lora", str(tiny_adapters["sql"]))) == sql and rollout_adapter(parse()) == ""
    with pytest.raises(CheckpointError, match="adapter_config.json"):
        rollout_adapter(parse("--lora", "sq1"))
    from dualpath.core.errors import DualPathError
    from dualpath.core.messages import AdapterLoadReply
    from dualpath.rollout.cli import ensure_adapter

    class Client:  # the scheduler's LoadAdapter, answering as its engines would
        def __init__(self, digest):
            self.digest, self.loaded = digest, []

        def load_adapter(self, path):
            self.loaded.append(path)
            return AdapterLoadReply(bool(self.digest), "" if self.digest else "no such directory", self.digest)

    started_with = Client(sql)  # a --lora-modules name: the cluster's engines have it
    ensure_adapter(started_with, parse("--lora-modules", f"sql={tiny_adapters['sql']}", "--lora", "sql"), sql)
    assert started_with.loaded == []
    latest = Client(sql)  # a trainer's newest adapter directory: loaded on every engine first
    ensure_adapter(latest, parse("--lora", str(tiny_adapters["sql"])), sql)
    assert latest.loaded == [str(tiny_adapters["sql"])]
    for client in (Client(""), Client("f" * 64)):
        with pytest.raises(DualPathError, match="could not load"):
            ensure_adapter(client, parse("--lora", str(tiny_adapters["sql"])), sql)
    agent = Agent("a", "a", (Round((1, 2, 3), generate=4),))
    cfg = RolloutConfig(adapter=sql)
    assert Rollout(None, cfg)._sampling(agent, 0, 0, agent.rounds[0], 1).adapter == sql
    assert agent_digest(agent, cfg) != agent_digest(agent) == agent_digest(agent, RolloutConfig())


def test_an_adapter_in_bfloat16_rounds_about_as_peft_does(tiny_dirs, tiny_adapters, tmp_path):
    """bfloat16 (the GPU dtype) against the merged weights in float64: under 4e-2 (the base model alone is under
    2e-2, ``test_models_parity``), and within 1.5x of PEFT's own bfloat16 error where PEFT is installed (measured
    1.07-1.26x: the fused projections round their sums in another order)."""
    import transformers

    ids = torch.randint(0, 320, (29,))
    with torch.no_grad():
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            merged_checkpoint(tiny_dirs["llama"], tiny_adapters["sql"], tmp_path / "m"), dtype=torch.float64
        )(ids[None]).logits[0]
    model = load_model(tiny_dirs["llama"], "cpu", torch.bfloat16, "torch")
    digest = model.add_adapter(tiny_adapters["sql"])
    err = rel_err(model.forward_all(ids, ForwardBatch((0,), (29,), (digest,)), all_logits=True)[0], ref)
    assert err < 4e-2
    try:
        import peft
    except ImportError:
        return
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=torch.bfloat16)
    with torch.no_grad():
        theirs = rel_err(
            peft.PeftModel.from_pretrained(hf, tiny_adapters["sql"]).to(torch.bfloat16)(ids[None]).logits[0], ref
        )
    assert err < 1.5 * theirs, (err, theirs)


def test_an_adapter_on_the_fused_elementwise_path(tiny_dirs, tiny_adapters):
    """``kernels="triton"`` (Triton's interpreter here): the MLP's output is written into the residual in place
    before the adapter's delta joins it; every prompt position's logprobs are the torch reference's."""
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    prompt = list(range(60, 100))
    outs = [
        LLM(str(tiny_dirs["llama"]), block_size=16, kernels=k).generate(
            prompt, params, lora_request=str(tiny_adapters["sql"])
        )[0]
        for k in ("torch", "triton")
    ]
    assert outs[0].token_ids == outs[1].token_ids
    for a, b in zip(outs[0].prompt_logprobs[1:], outs[1].prompt_logprobs[1:]):
        assert abs(a.logprob - b.logprob) < 1e-4


def test_serve_refuses_an_unservable_adapter_before_any_engine_starts(tiny_adapters, tmp_path):
    from dualpath.cli import build_parser
    from dualpath.serving.serve import frontend_options

    bad = shutil.copytree(tiny_adapters["sql"], tmp_path / "dora")
    (bad / "adapter_config.json").write_text(
        json.dumps({**json.loads((bad / "adapter_config.json").read_text()), "use_dora": True})
    )
    args = build_parser().parse_args(["serve", "--lora-modules", f"sql={tiny_adapters['sql']}", f"d={bad}"])
    with pytest.raises(CheckpointError, match="DoRA"):
        frontend_options(args)


def test_an_engine_joining_loads_the_adapters_the_cluster_loaded_at_runtime(tiny_dirs, tiny_adapters):
    """``Engine.register``: the scheduler's reply lists the adapters loaded since the cluster started; the engine
    loads those it lacks before it takes work (its model and the registration, the rest of the engine left out)."""
    from types import SimpleNamespace

    from dualpath.core.messages import RegisterReply
    from dualpath.engines.engine import Engine
    from dualpath.engines.parallel.ranks import Ranks
    from dualpath.engines.parallel.steps import RankState

    class Scheduler:
        def call(self, method, info, timeout):
            return RegisterReply(True, adapters=[str(tiny_adapters["sql"]), str(tiny_adapters["poet"])])

    engine = Engine.__new__(Engine)
    engine.model = load_model(tiny_dirs["llama"], "cpu", torch.float32, "torch")
    engine.ranks = Ranks(RankState(engine.model, None, "cpu"))  # one rank: steps are plain calls
    engine.scheduler, engine.info, engine.runtime_adapters = Scheduler(), lambda: None, []
    engine.cfg = SimpleNamespace(engine=SimpleNamespace(lora_modules=(LoraModule("poet", str(tiny_adapters["poet"])),)))
    engine.register()
    assert set(engine.model.adapters) == {adapter_digest(tiny_adapters["sql"])}  # poet: it started with it
    assert engine.registered and engine.runtime_adapters == [str(tiny_adapters["sql"])]  # told to a new scheduler
    loaded = engine.model.adapters[adapter_digest(tiny_adapters["sql"])]
    engine.register()  # a second registration (a restarted scheduler) loads nothing again
    assert engine.model.adapters[adapter_digest(tiny_adapters["sql"])] is loaded
    assert engine.runtime_adapters == [str(tiny_adapters["sql"])]


def test_the_generate_command_runs_under_an_adapter(tiny_dirs, tiny_adapters, capsys):
    from dualpath.cli import main

    llm = LLM(str(tiny_dirs["llama"]), block_size=16)
    want = llm.generate("ab", SamplingParams(temperature=0, max_tokens=5), lora_request=str(tiny_adapters["sql"]))
    base = ["generate", "--model", str(tiny_dirs["llama"]), "--prompt", "ab", "--max-tokens", "5"]
    assert main(base + ["--lora-modules", f"sql={tiny_adapters['sql']}", "--lora", "sql"]) == 0
    assert capsys.readouterr().out == f"> ab\n{want[0].text}\n[5 tokens, length]\n"
