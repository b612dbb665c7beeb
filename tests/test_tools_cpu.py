"""CPU: the shell entry points (device scripts, CI, the serving example) parse with bash -n,
so a syntax error is caught here rather than on a GPU machine's clock."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*ROOT.glob("tools/*.sh"), ROOT / ".ci" / "run", ROOT / "examples" / "serve.sh"])


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_shell_scripts_parse(script):
    assert script.exists()
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _write_run(folder: Path, times: dict) -> None:
    """One bench_experts results file: {(preset, routing, tokens, tiles): us}."""
    import json
    folder.mkdir(parents=True)
    with open(folder / "experts_H200.jsonl", "w") as f:
        for (preset, routing, tokens, tiles), us in times.items():
            f.write(json.dumps(dict(preset=preset, routing=routing, tokens=tokens,
                                    tiles=tiles, us=us)) + "\n")


def test_ab_experts_medians_ratios_and_verdict(tmp_path, capsys):
    """tools/ab_experts.py: medians over a setting's repeats (A, A_r2, ...), the B/A ratio per
    configuration, the geometric mean over the chosen tokens, exit 0 only when B is faster."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("ab_experts", ROOT / "tools" / "ab_experts.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    one = ("qwen3-30b-a3b", "uniform", 1, "wgmma_narrow_ws")
    eight = ("qwen3-30b-a3b", "uniform", 8, "wgmma_m64_ws")
    _write_run(tmp_path / "x_1", {one: 40.0, eight: 100.0})
    _write_run(tmp_path / "x_1_r2", {one: 44.0, eight: 100.0})
    _write_run(tmp_path / "x_1_r3", {one: 42.0, eight: 100.0})
    _write_run(tmp_path / "x_4", {one: 21.0, eight: 400.0})
    # B halves 1 token (median 42 -> 21) and quadruples 8 tokens.
    assert ab.main([str(tmp_path / "x_1"), str(tmp_path / "x_4"), "--tokens", "1"]) == 0
    out = capsys.readouterr().out
    assert " 42.0 " in out and " 21.0 " in out and "0.500" in out and "4.000" in out
    assert "over 1 configurations: 0.500" in out
    assert ab.main([str(tmp_path / "x_1"), str(tmp_path / "x_4")]) == 1  # sqrt(0.5 * 4) > 1
    assert "over 2 configurations: 1.414" in capsys.readouterr().out
    assert ab.main([str(tmp_path / "x_1"), str(tmp_path / "nothing")]) == 2
