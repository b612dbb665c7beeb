"""CPU tests of the serving comparison tools: the seeded checkpoint (tensor names a real
Qwen3-MoE loader accepts, determinism, weight scale), the agreement rule of
examples/compare_serving.py and the rounding-only baseline of examples/compare_rounding_cpu.py."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

import compare_serving
import make_seeded_checkpoint as seeded

TINY = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 256,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
    "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [1], "bos_token_id": 1, "eos_token_id": 2,
}


def _write_config(tmp_path: Path, config: dict) -> Path:
    d = tmp_path / "cfg"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_seeded_checkpoint_loads_in_transformers_with_every_tensor(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    out = seeded.make_checkpoint(_write_config(tmp_path, TINY), tmp_path / "m",
                                 tokenizer_dir=None, seed=3, std=0.02, head_std=0.2)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.bfloat16, output_loading_info=True)
    assert not any(info.values()), info  # no missing / unexpected / mismatched tensors
    names = set(seeded.tensor_shapes(json.loads((out / "config.json").read_text())))
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in names  # sparse layer
    assert "model.layers.1.mlp.gate_proj.weight" in names            # mlp_only layer
    from safetensors.torch import load_file
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == names
    assert abs(tensors["lm_head.weight"].float().std().item() - 0.2) < 0.02
    assert abs(tensors["model.layers.0.mlp.gate.weight"].float().std().item() - 0.02) < 0.005
    assert torch.all(tensors["model.norm.weight"] == 1)


def test_seeded_checkpoint_is_deterministic(tmp_path):
    pytest.importorskip("torch")
    cfg = _write_config(tmp_path, TINY)
    digests = []
    for name, seed in (("a", 5), ("b", 5), ("c", 6)):
        out = seeded.make_checkpoint(cfg, tmp_path / name, tokenizer_dir=None, seed=seed,
                                     std=0.02, head_std=0.2)
        digests.append(hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest())
    assert digests[0] == digests[1] != digests[2]


def test_seeded_checkpoint_takes_the_tokenizer_vocab(tmp_path):
    pytest.importorskip("torch")
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "config.json").write_text(json.dumps({"vocab_size": 300, "eos_token_id": 7}))
    (tok / "tokenizer.json").write_text("{}")
    out = seeded.make_checkpoint(_write_config(tmp_path, TINY), tmp_path / "m",
                                 tokenizer_dir=tok, seed=0, std=0.02, head_std=0.2,
                                 num_layers=1)
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 300 and config["eos_token_id"] == 7
    assert config["num_hidden_layers"] == 1 and (out / "tokenizer.json").is_file()


def test_seeded_checkpoint_rejects_other_models(tmp_path):
    with pytest.raises(ValueError, match="qwen3_moe"):
        seeded.tensor_shapes({**TINY, "model_type": "llama"})
    assert seeded.main(["--config", str(_write_config(tmp_path, {**TINY, "model_type": "x"})),
                        "--tokenizer", "none", "--out", str(tmp_path / "o")]) == 2


def _run(tokens, logprobs, tops):
    return dict(tokens=tokens, logprobs=logprobs, top=tops)


def test_compare_identical_and_within_tolerance():
    a = _run(["x", "y"], [-0.1, -0.2], [{"x": -0.1}, {"y": -0.2}])
    b = _run(["x", "y"], [-0.15, -0.25], [{"x": -0.15}, {"y": -0.25}])
    r = compare_serving.compare(a, b, tol=0.1)
    assert r["agree"] and r["common_prefix"] == 2 and r["divergence"] is None
    assert r["max_logprob_diff"] == pytest.approx(0.05)
    assert not compare_serving.compare(a, b, tol=0.01)["agree"]


def test_compare_divergence_must_be_a_near_tie_in_both_runs():
    a = _run(["x", "p"], [-0.1, -0.70], [{"x": -0.1}, {"p": -0.70, "q": -0.75}])
    b = _run(["x", "q"], [-0.1, -0.68], [{"x": -0.1}, {"q": -0.68, "p": -0.72}])
    r = compare_serving.compare(a, b, tol=0.1)
    assert r["agree"] and r["divergence"]["position"] == 1 and r["divergence"]["near_tie"]
    far = _run(["x", "q"], [-0.1, -0.1], [{"x": -0.1}, {"q": -0.1, "p": -2.5}])
    assert not compare_serving.compare(a, far, tol=0.1)["agree"]
    missing = _run(["x", "q"], [-0.1, -0.68], [{"x": -0.1}, {"q": -0.68}])  # p not in top 5
    r = compare_serving.compare(a, missing, tol=0.1)
    assert not r["agree"] and r["divergence"]["gap_b"] is None


def test_compare_serving_args():
    args = compare_serving.parse_args([])
    assert args.num_prompts == 16 and args.tol == 0.1 and args.model_dir is None
    assert args.backend == "petit"
    assert compare_serving.parse_args(["--backend", "petit-experts"]).backend == "petit-experts"
    with pytest.raises(SystemExit):
        compare_serving.parse_args(["--backend", "default"])  # compared against, not a choice
    with pytest.raises(SystemExit):
        compare_serving.parse_args(["--tol", "0"])


# examples/compare_rounding_cpu.py: the rounding-only drift between two MoE reductions

import compare_rounding_cpu as rounding  # noqa: E402


def test_rounding_reductions_differ_as_their_kernels_do():
    """petit: fp32 sum rounded once (in ascending expert order); triton: bf16 accumulation in
    slot order (vLLM's moe_sum). 256 + 0.75 + 0.75: 258 against 256 in bf16 (ulp 2 there)."""
    torch = pytest.importorskip("torch")
    parts = torch.tensor([[[256.0], [0.75], [0.75]]], dtype=torch.bfloat16)
    ids = torch.tensor([[5, 1, 3]])
    assert rounding.reduce_partials(parts, ids, "petit").item() == 258.0
    assert rounding.reduce_partials(parts, ids, "triton").item() == 256.0
    # megamoe: the fp32 partials summed in slot order, rounded once
    fp32 = torch.tensor([[[256.0], [0.75], [0.5]]])
    assert rounding.reduce_partials(fp32, ids, "megamoe").item() == 258.0  # 257.25 -> 258
    assert rounding.reduce_partials(fp32.bfloat16(), ids, "triton").item() == 256.0
    with pytest.raises(ValueError, match="reduction"):
        rounding.reduce_partials(parts, ids, "fp64")


def test_routing_flips_only_while_inputs_agree():
    torch = pytest.importorskip("torch")
    same, other = torch.tensor([[0, 3], [1, 2]]), torch.tensor([[0, 3], [1, 3]])
    a = dict(routes=[[same, same], [same, same], [same, same]])
    b = dict(routes=[[same, other], [same, same], [other, other]])
    assert rounding.routing_flips(a, b, common_prefix=2) == [[0, 1, 1], [2, 0, 1], [2, 1, 1]]
    assert rounding.routing_flips(a, b, common_prefix=1) == [[0, 1, 1]]  # step 2: inputs differ


def test_compare_rounding_runs_end_to_end(tmp_path):
    """Both reductions over a seeded checkpoint with a dense layer (mlp_only_layers) and the
    project's tokenizer: the summary has compare_serving's fields plus the routing flips."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    model = seeded.make_checkpoint(_write_config(tmp_path, TINY), tmp_path / "m",
                                   tokenizer_dir=seeded.DEFAULT_TOKENIZER, seed=5, std=0.02,
                                   head_std=0.2)
    assert rounding.main(["--model-dir", str(model), "--num-prompts", "2", "--max-tokens", "3",
                          "--results-dir", str(tmp_path / "r")]) == 0
    summary = json.loads((tmp_path / "r" / "compare_rounding_cpu.json").read_text())
    assert summary["reductions"] == ["petit", "triton"] and summary["num_prompts"] == 2
    assert len(summary["per_prompt"]) == 2
    for r in summary["per_prompt"]:
        assert r["length"] == 3 and 0 <= r["common_prefix"] <= 3
        assert all(len(f) == 3 and f[1] == 0 for f in r["routing_flips"])  # one MoE layer
        assert r["flip_at_max_diff"] in (True, False)
    assert 0 <= summary["over_2tol_at_a_flip"] <= summary["prompts_over_2tol"] <= 2


@pytest.mark.parametrize("gpus, dp", [([], 0), (["NVIDIA H200"], 2)])
def test_compare_serving_refuses_more_ranks_than_gpus(monkeypatch, capsys, gpus, dp):
    # one GPU is enough (--dp 1: the one-GPU path); more data-parallel ranks than GPUs is not
    monkeypatch.setattr(compare_serving.bench, "visible_gpus", lambda: gpus)
    monkeypatch.setattr(compare_serving.bench, "check_plugin_visible",
                        lambda *a: pytest.fail("must refuse before starting anything"))
    assert compare_serving.main(["--dp", str(dp)]) == 2
    assert f"--dp {dp} needs as many GPUs, found {len(gpus)}" in capsys.readouterr().err


def test_pooled_quantiles_over_common_prefixes():
    per_prompt = [dict(diffs=[0.0, 0.5]), dict(diffs=[]), dict(diffs=[0.25, 0.125, 1.0])]
    q = compare_serving.pooled_quantiles(per_prompt)
    assert q == dict(positions=5, q50=0.25, q90=1.0, q99=1.0, max=1.0)
    assert compare_serving.pooled_quantiles([dict(diffs=[])])["positions"] == 0


@pytest.mark.parametrize("fault", rounding.FAULTS)
def test_rounding_faults_change_what_they_name(fault):
    """The injected faults of compare_rounding_cpu against the fault-free fused-layer rounding,
    on one call of random experts: each changes only what it names."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace
    gen = torch.Generator().manual_seed(3)
    E, H, I, T, K = 4, 64, 32, 3, 2
    module = SimpleNamespace(
        gate_up_proj=(torch.randn(E, 2 * I, H, generator=gen) * 0.2).bfloat16(),
        down_proj=(torch.randn(E, H, I, generator=gen) * 0.2).bfloat16())
    x = torch.randn(T, H, generator=gen).bfloat16()
    ids = torch.tensor([[1, 2], [3, 1], [2, 3]])
    weights = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.9, 0.1]])

    def run(fault, calls=0):
        experts = rounding.RoutedExperts()
        experts.reduction, experts.fault, experts.calls = "megamoe", fault, calls
        experts.routes = [[]]
        return experts(module, x, ids, weights).float()

    clean, out = run("none"), run(fault)
    if fault == "none":
        assert torch.equal(out, clean)
    elif fault == "tile":  # expert 1 (the lowest with rows) lost rows 0-31 of H: tokens 0, 1
        assert not torch.equal(out[:2, :32], clean[:2, :32])
        assert torch.equal(out[2], clean[2]) and torch.equal(out[:, 32:], clean[:, 32:])
    elif fault == "rare-row":  # only every 50th call, its first token
        assert torch.equal(out, clean)
        late = run(fault, calls=49)
        assert torch.equal(late[0], torch.zeros(H)) and torch.equal(late[1:], clean[1:])
    else:  # drop-slot, unweighted: every token
        assert all(not torch.equal(out[t], clean[t]) for t in range(T))


def _prompt(diffs, divergence=None):
    return dict(diffs=diffs, max_logprob_diff=max(diffs, default=0.0), divergence=divergence,
                agree=max(diffs, default=0.0) <= 0.1 and (divergence is None
                                                           or divergence["near_tie"]))


def test_verdict_takes_rounding_and_refuses_faults():
    near, far = dict(near_tie=True), dict(near_tie=False)
    clean = [_prompt([0.0] * 10 + [0.004] * 4 + [0.06] * 2)] * 14  # 16 tokens each
    # rounding: one step of a bf16 logit here and there, one routing flip, a near-tie divergence
    rounding = clean + [_prompt([0.125, 0.3]), _prompt([0.01], near)]
    v = compare_serving.verdict(rounding, 0.1)
    assert v["agree"] and not v["strict"]
    assert (v["prompts_over_2tol"], v["divergences_not_near_tie"]) == (1, 0)
    assert compare_serving.verdict(clean, 0.1) == dict(
        v, prompts_over_2tol=0, strict=True, quantiles=compare_serving.pooled_quantiles(clean))
    # a fault: large differences at many positions (the 99th percentile over 2 x tol) ...
    assert not compare_serving.verdict(clean + [_prompt([0.5] * 8)], 0.1)["agree"]
    # ... or more than 1/5 of the prompts over 2 x tol, or 1/8 diverging away from near-ties
    assert not compare_serving.verdict(clean[:12] + [_prompt([0.0] * 60 + [0.3])] * 4,
                                       0.1)["agree"]
    assert not compare_serving.verdict(clean[:13] + [_prompt([0.0], far)] * 3, 0.1)["agree"]
    assert compare_serving.verdict(clean[:14] + [_prompt([0.0], far)] * 2, 0.1)["agree"]


def test_compare_serving_writes_its_verdict(monkeypatch, tmp_path, capsys):
    """main() end to end with the two servers replaced by canned outputs: the summary holds
    the verdict, the strict result, the counts and the quantiles; the exit status follows
    the verdict."""
    monkeypatch.setattr(compare_serving.bench, "visible_gpus", lambda: ["NVIDIA H200"])
    monkeypatch.setattr(compare_serving.bench, "check_plugin_visible", lambda *a: None)
    monkeypatch.setattr(compare_serving.bench, "probe_vllm_version", lambda *a: "0.24.0")

    def outputs(lp):  # 16 prompts x 4 tokens, the same tokens, logprobs lp
        return [dict(tokens=["a", "b", "c", "d"], logprobs=[lp] * 4, top=[{}] * 4)] * 16

    for shift, rc in ((0.06, 0), (0.5, 1)):
        runs = {"petit": outputs(-1.0 - shift), "default": outputs(-1.0)}
        monkeypatch.setattr(compare_serving, "run_backend",
                            lambda args, b, *rest: dict(healthy_s=1.0, evidence="e",
                                                        outputs=runs[b]))
        assert compare_serving.main(["--dp", "1", "--num-prompts", "16", "--model-dir",
                                     str(tmp_path), "--results-dir", str(tmp_path)]) == rc
        s = json.loads((tmp_path / "compare_serving_H200_1gpu.json").read_text())
        assert s["agree"] == s["strict"] == (rc == 0) and s["world"] == s["num_gpus"] == 1
        assert s["identical_prompts"] == 16 and s["prompts_over_tol"] == (16 if rc else 0)
        assert s["prompts_over_2tol"] == (16 if rc else 0) and s["divergences_not_near_tie"] == 0
        assert s["quantiles"]["positions"] == 64
        assert s["quantiles"]["q99"] == pytest.approx(shift)
    assert "DISAGREE" in capsys.readouterr().out
