"""examples/dummy_routing_cpu.py on the CPU: vLLM-style dummy weights, the routing summary's
arithmetic, and a whole run on a tiny Qwen3-MoE config (the project's Qwen3 tokenizer)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from script_module import load_script

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
dr = load_script("examples/dummy_routing_cpu.py")


def test_expected_distinct_experts():
    assert dr.expected_distinct_experts(128, 8, 1) == pytest.approx(8.0)
    assert dr.expected_distinct_experts(128, 8, 64) == pytest.approx(
        128 * (1 - (120 / 128) ** 64))
    assert 125 < dr.expected_distinct_experts(128, 8, 64) < 128


def test_routing_summary():
    # 2 decode steps x 2 layers, 3 tokens of top-2 each
    steps = [[[[0, 1], [0, 1], [1, 0]], [[4, 5], [6, 7], [4, 5]]],
             [[[0, 1], [0, 1], [0, 1]], [[4, 5], [4, 6], [4, 5]]]]
    s = dr.routing_summary(steps, num_experts=8, top_k=2)
    assert s["tokens_per_step"] == 3
    assert s["uniform_experts_per_step"] == pytest.approx(8 * (1 - (6 / 8) ** 3))
    first, second = s["layers"]
    assert (first["experts_per_step_mean"], first["experts_per_step_max"],
            first["distinct_topk_sets"], first["distinct_experts"]) == (2.0, 2, 1, 2)
    assert (second["experts_per_step_mean"], second["experts_per_step_max"],
            second["distinct_topk_sets"], second["distinct_experts"]) == (3.5, 4, 3, 4)


def _tiny_model_dir(tmp_path) -> Path:
    d = tmp_path / "tiny-qwen3-moe"
    d.mkdir()
    src = ROOT / "examples" / "models" / "qwen3-30b-a3b"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, d / name)
    config = json.loads((src / "config.json").read_text())
    config.update(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                  num_experts=8, num_experts_per_tok=2, num_hidden_layers=3,
                  max_window_layers=3)
    config.pop("layer_types", None)
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_dummy_init_is_vllms_rule(tmp_path):
    config = transformers.AutoConfig.from_pretrained(_tiny_model_dir(tmp_path))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    filled = dr.dummy_init_(model)
    state = model.state_dict()
    assert filled == sum(1 for t in state.values() if torch.is_floating_point(t))
    for t in state.values():  # (fp32 rounding of the bounds)
        assert float(t.min()) >= dr.DUMMY_LOW * 1.0001 and float(t.max()) <= dr.DUMMY_HIGH * 1.0001
        assert float(t.abs().max()) > 0.9e-3
    # one seed per tensor: tensors of one shape are equal (every layer's router, norms)
    routers = [v for k, v in state.items() if k.endswith("mlp.gate.weight")]
    assert len(routers) == 3 and all(torch.equal(routers[0], r) for r in routers[1:])
    assert not torch.equal(state["model.embed_tokens.weight"][0],
                           state["model.embed_tokens.weight"][1])


def test_whole_run_on_a_tiny_model(tmp_path, capsys):
    out = tmp_path / "routing.json"
    assert dr.main(["--model-dir", str(_tiny_model_dir(tmp_path)), "--num-layers", "2",
                    "--prompts", "3", "--new-tokens", "3", "--dtype", "float32",
                    "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["moe_layers"] == [0, 1] and result["top_k"] == 2
    assert result["tokens_per_step"] == 3 and len(result["layers"]) == 2
    assert len(result["generated_token_ids"]) == 3
    assert all(len(seq) == 3 for seq in result["generated_token_ids"])
    assert len(result["distinct_tokens_per_step"]) == 3
    for row in result["layers"]:
        assert 2 <= row["experts_per_step_max"] <= 6 and 1 <= row["distinct_topk_sets"] <= 6
    assert "distinct emitted tokens per step" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        dr.parse_args(["--new-tokens", "1"])
