"""CPU: the shell entry points (device scripts, CI, the serving example) parse with bash -n,
so a syntax error is caught here rather than on a GPU machine's clock."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from script_module import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*ROOT.glob("tools/*.sh"), ROOT / ".ci" / "run", ROOT / "examples" / "serve.sh"])


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_shell_scripts_parse(script):
    assert script.exists()
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _write_run(folder: Path, records: list) -> None:
    """One benchmark results file of `records` (dicts)."""
    import json
    folder.mkdir(parents=True)
    with open(folder / "results.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def _ab_compare():
    return load_script("tools/ab_compare.py")


def _experts(times: dict) -> list:
    return [dict(preset=p, routing=r, tokens=t, tiles=tiles, us=us)
            for (p, r, t, tiles), us in times.items()]


def test_ab_compare_experts_medians_ratios_and_verdict(tmp_path, capsys):
    """tools/ab_compare.py on expert results: medians over a setting's repeats (A, A_r2, ...),
    the B/A ratio per configuration, the geometric mean over the chosen tokens, exit 0 only
    when B is faster."""
    ab = _ab_compare()
    one = ("qwen3-30b-a3b", "uniform", 1, "wgmma_narrow")
    eight = ("qwen3-30b-a3b", "uniform", 8, "wgmma_m64")
    _write_run(tmp_path / "x_1", _experts({one: 40.0, eight: 100.0}))
    _write_run(tmp_path / "x_1_r2", _experts({one: 44.0, eight: 100.0}))
    _write_run(tmp_path / "x_1_r3", _experts({one: 42.0, eight: 100.0}))
    _write_run(tmp_path / "x_4", _experts({one: 21.0, eight: 400.0}))
    # B halves 1 token (median 42 -> 21) and quadruples 8 tokens.
    assert ab.main([str(tmp_path / "x_1"), str(tmp_path / "x_4"), "--tokens", "1"]) == 0
    out = capsys.readouterr().out
    assert " 42.0 " in out and " 21.0 " in out and "0.500" in out and "4.000" in out
    assert "of us over 1 configurations: 0.500" in out
    assert ab.main([str(tmp_path / "x_1"), str(tmp_path / "x_4")]) == 1  # sqrt(0.5 * 4) > 1
    assert "over 2 configurations: 1.414" in capsys.readouterr().out
    assert ab.main([str(tmp_path / "x_1"), str(tmp_path / "nothing")]) == 2


def test_ab_compare_experts_keyed_on_the_family_asked_for(tmp_path, capsys):
    """Trees whose `auto` resolves to differently named families (24b3329's wgmma_narrow_ws,
    now wgmma_narrow) compare on tiles_requested where the records carry it."""
    ab = _ab_compare()

    def run(tiles, us):
        return [dict(preset="qwen3-30b-a3b", routing="uniform", tokens=1, tiles=tiles,
                     tiles_requested="auto", us=us)]
    _write_run(tmp_path / "old", run("wgmma_narrow_ws", 40.0))
    _write_run(tmp_path / "new", run("wgmma_narrow", 38.0))
    assert ab.main([str(tmp_path / "old"), str(tmp_path / "new")]) == 0
    assert "of us over 1 configurations: 0.950" in capsys.readouterr().out


def test_ab_compare_moe_layer_rows(tmp_path, capsys):
    """bench_moe_layer.py rows (vllm_us, composed_us, megamoe_us; no tiles): compared per
    (preset, routing, tokens), the verdict on megamoe_us by default."""
    ab = _ab_compare()

    def rows(mega_one, mega_eight):
        return [dict(preset="deepseek-v3", routing="uniform", tokens=t, vllm_us=54.0,
                     composed_us=61.0, megamoe_us=m, roofline_us=23.7)
                for t, m in ((1, mega_one), (8, mega_eight))]
    _write_run(tmp_path / "old", rows(60.0, 176.0))
    _write_run(tmp_path / "new", rows(45.0, 176.0))
    assert ab.main([str(tmp_path / "old"), str(tmp_path / "new"), "--tokens", "1"]) == 0
    assert "of megamoe_us over 1 configurations: 0.750" in capsys.readouterr().out
    assert ab.main([str(tmp_path / "old"), str(tmp_path / "new"), "--metric", "vllm_us"]) == 1


def test_ab_compare_moe_layer_keeps_dtypes_apart(tmp_path, capsys):
    """One bench_moe_layer.py run with --dtypes bf16 fp8 writes both dtypes' rows at each
    token count: they are separate configurations (a row without dtype is bf16), not repeats
    pooled into one median."""
    ab = _ab_compare()

    def rows(bf16_us, fp8_us):
        return [dict(preset="qwen3-30b-a3b", routing="uniform", tokens=1, vllm_us=40.0,
                     composed_us=None, megamoe_us=bf16_us),
                dict(preset="qwen3-30b-a3b", dtype="fp8", routing="uniform", tokens=1,
                     vllm_us=30.0, composed_us=None, megamoe_us=fp8_us)]
    _write_run(tmp_path / "old", rows(30.0, 20.0))
    _write_run(tmp_path / "new", rows(30.0, 10.0))
    assert ab.main([str(tmp_path / "old"), str(tmp_path / "new")]) == 0
    out = capsys.readouterr().out
    assert "of megamoe_us over 2 configurations: 0.707" in out
    fp8_row = next(line for line in out.splitlines() if " fp8 " in line)
    assert "20.0" in fp8_row and "10.0" in fp8_row and "0.500" in fp8_row


def test_ab_compare_experts_chained_metric(tmp_path, capsys):
    """us_chain (bench_experts --chain, decode sizes only) as a second metric: compared where
    both settings have it, "-" elsewhere, the verdict on it with --metric us_chain."""
    ab = _ab_compare()
    one = ("qwen3-30b-a3b", "uniform", 1, "wgmma_narrow")
    big = ("qwen3-30b-a3b", "uniform", 8192, "wgmma")

    def rows(us_one, chain_one, us_big):
        recs = _experts({one: us_one, big: us_big})
        recs[0]["us_chain"] = chain_one
        recs[1]["us_chain"] = None  # past --chain's sizes
        return recs
    _write_run(tmp_path / "old", rows(44.0, 38.0, 1260.0))
    _write_run(tmp_path / "new", rows(44.0, 34.2, 1260.0))
    assert ab.main([str(tmp_path / "old"), str(tmp_path / "new")]) == 1  # us: equal
    assert "of us over 2 configurations: 1.000" in capsys.readouterr().out
    assert ab.main([str(tmp_path / "old"), str(tmp_path / "new"), "--metric", "us_chain"]) == 0
    out = capsys.readouterr().out
    assert "of us_chain over 1 configurations: 0.900" in out
    big_line = next(line for line in out.splitlines() if " 8192 " in line)
    assert big_line.split()[-3:] == ["-", "-", "-"]


def test_ab_compare_dispatch_combine_metric_and_sm_filter(tmp_path, capsys):
    """tools/ab_compare.py on dispatch/combine results: both metrics per (tokens, num_sms), the
    verdict on --metric (default combine_us) over the chosen SM counts, an unknown metric
    refused."""
    ab = _ab_compare()

    def rec(tokens, sms, d, c):
        return dict(preset="deepseek-v3", routing="uniform", tokens=tokens, num_sms=sms,
                    dispatch_us=d, combine_us=c)
    _write_run(tmp_path / "old", [rec(4096, 24, 236.0, 395.0), rec(4096, 132, 175.0, 190.0)])
    _write_run(tmp_path / "new", [rec(4096, 24, 236.0, 316.0), rec(4096, 132, 175.0, 209.0)])
    # combine: 0.8 at 24 SMs, 1.1 at 132; dispatch unchanged
    assert ab.main([str(tmp_path / "old"), str(tmp_path / "new"), "--num-sms", "24"]) == 0
    out = capsys.readouterr().out
    assert "0.800" in out and "1.100" in out and "of combine_us over 1 configurations: 0.800" in out
    assert ab.main([str(tmp_path / "old"), str(tmp_path / "new"), "--num-sms", "132"]) == 1
    capsys.readouterr()
    assert ab.main([str(tmp_path / "old"), str(tmp_path / "new"), "--metric", "dispatch_us"]) == 1
    assert "of dispatch_us over 2 configurations: 1.000" in capsys.readouterr().out
    assert ab.main([str(tmp_path / "old"), str(tmp_path / "new"), "--metric", "us"]) == 2


FAKE_PYTHON = r"""#!/usr/bin/env bash
# Stands in for python3 under tools/ab_trees.sh: "builds" succeed, ab_compare.py runs for
# real, the benchmark writes one record whose combine_us tells which tree and settings ran.
case "$1" in
  setup.py) exit 0 ;;
  tools/ab_compare.py) shift; exec "$REAL_PYTHON" "$AB_COMPARE" "$@" ;;
esac
bench=$1
while [ $# -gt 0 ]; do [ "$1" = --out-dir ] && out=$2; shift; done
mkdir -p "$out"
us=400; [ -f OLD_TREE ] || us=300; [ -f V1_TREE ] && us=350
[ -n "${PETIT_X:-}" ] && us=$((us - PETIT_X * 100))
[ -n "${PETIT_Y:-}" ] && us=$((us - PETIT_Y))
echo "{\"preset\": \"deepseek-v3\", \"routing\": \"uniform\", \"tokens\": 4096, \"num_sms\": 24, \"dispatch_us\": 236.0, \"combine_us\": $us, \"cwd\": \"$PWD\", \"bench\": \"$bench\", \"commit\": \"$PETIT_COMMIT\"}" > "$out/r.jsonl"
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_ab_trees_runs_each_tree_with_its_settings(tmp_path):
    """tools/ab_trees.sh with a stand-in python: every run in interleaved repeats, from its own
    tree, with all of its NAME=VALUE settings, into its own folder, stamped with its commit
    (ab_prepare.sh's .petit_commit, else PETIT_COMMIT); ab_compare's summary last."""
    import json
    import sys
    new, old = tmp_path / "new", tmp_path / "old"
    (new / "tools").mkdir(parents=True)
    for name in ("ab_trees.sh", "common.sh", "ab_compare.py"):
        shutil.copy(ROOT / "tools" / name, new / "tools" / name)
    (new / "setup.py").write_text("")
    old.mkdir()
    (old / "setup.py").write_text("")
    (old / "OLD_TREE").write_text("")
    (old / ".petit_commit").write_text("abc1234\n")
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = dict(PATH="/usr/bin:/bin", PYTHON=str(fake), REAL_PYTHON=sys.executable,
               AB_COMPARE=str(new / "tools" / "ab_compare.py"), OUT=str(out), AB_OLD=str(old),
               AB_RUNS="old new new:PETIT_X=1,PETIT_Y=2", AB_REPEATS="2", PETIT_COMMIT="def5678")
    result = subprocess.run(["bash", str(new / "tools" / "ab_trees.sh")], env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    runs = {}
    for folder in sorted(out.glob("ab-*")):
        record = json.loads((folder / "r.jsonl").read_text())
        runs[folder.name] = (record["combine_us"], record["cwd"])
        assert record["bench"] == "examples/bench_dispatch_combine.py"
        assert record["commit"] == ("abc1234" if folder.name.startswith("ab-old") else "def5678")
    assert runs == {
        "ab-old": (400, str(old)), "ab-old_r2": (400, str(old)),
        "ab-new": (300, str(new)), "ab-new_r2": (300, str(new)),
        "ab-new_PETIT_X_1_PETIT_Y_2": (198, str(new)),
        "ab-new_PETIT_X_1_PETIT_Y_2_r2": (198, str(new)),
    }
    log = (out / "ab.log").read_text()
    assert log.index("=== old (old)") < log.index("=== new (new)") < log.index("(old_r2)")
    summary = result.stdout
    assert "ab-old vs ab-new" in summary and "0.750" in summary
    assert "ab-old vs ab-new_PETIT_X_1_PETIT_Y_2" in summary and "0.495" in summary
    env["AB_OLD"] = ""
    refused = subprocess.run(["bash", str(new / "tools" / "ab_trees.sh")], env=env,
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "no AB_OLD" in refused.stdout
    # AB_BENCH: another benchmark (the expert GEMMs), here a sweep of this tree alone
    env.update(AB_RUNS="new new:PETIT_X=1", AB_REPEATS="1", AB_BENCH="examples/bench_experts.py",
               OUT=str(tmp_path / "out2"))
    swept = subprocess.run(["bash", str(new / "tools" / "ab_trees.sh")], env=env,
                           capture_output=True, text=True)
    assert swept.returncode == 0, swept.stdout + swept.stderr
    benches = {f.name: json.loads((f / "r.jsonl").read_text())["bench"]
               for f in (tmp_path / "out2").glob("ab-*")}
    assert benches == {"ab-new": "examples/bench_experts.py",
                       "ab-new_PETIT_X_1": "examples/bench_experts.py"}
    # AB_TREES: a third tree (a kernel variant) built and run beside old and new
    v1 = tmp_path / "v1"
    v1.mkdir()
    (v1 / "setup.py").write_text("")
    (v1 / "V1_TREE").write_text("")
    env.update(AB_OLD=str(old), AB_TREES=f"v1={v1}", AB_RUNS="old v1 new", AB_REPEATS="1",
               AB_BENCH="examples/bench_dispatch_combine.py", OUT=str(tmp_path / "out3"),
               AB_AFTER='echo "$PWD $PYTHONPATH" > "$AB_TREE_OUT/where"; test ! -f V1_TREE')
    three = subprocess.run(["bash", str(new / "tools" / "ab_trees.sh")], env=env,
                           capture_output=True, text=True)
    assert three.returncode == 0, three.stdout + three.stderr
    cwds = {f.name: json.loads((f / "r.jsonl").read_text())["cwd"]
            for f in (tmp_path / "out3").glob("ab-*")}
    assert cwds == {"ab-old": str(old), "ab-v1": str(v1), "ab-new": str(new)}
    assert "ab-old vs ab-v1" in three.stdout and "0.875" in three.stdout
    assert sorted(p.name for p in (tmp_path / "out3").glob("build-*.log")) == \
        ["build-new.log", "build-old.log", "build-v1.log"]
    # AB_AFTER: once per tree, in it, with its PYTHONPATH and output folder; a failure is
    # reported, not fatal
    for name, tree in (("old", old), ("v1", v1), ("new", new)):
        where = (tmp_path / "out3" / f"after-{name}" / "where").read_text().split()
        assert where[0] == str(tree) and where[1].split(":")[0] == str(tree)
    assert "AB_AFTER in v1: rc 1" in three.stdout
    assert "AB_AFTER in old" not in three.stdout and "AB_AFTER in new" not in three.stdout
    env.update(AB_RUNS="old v2")
    unknown = subprocess.run(["bash", str(new / "tools" / "ab_trees.sh")], env=env,
                             capture_output=True, text=True)
    assert unknown.returncode == 2 and "no tree v2" in unknown.stdout


@pytest.mark.skipif(shutil.which("patch") is None or shutil.which("git") is None,
                    reason="needs git and patch")
def test_ab_prepare_makes_tree_folders_from_refs_and_patches(tmp_path):
    """tools/ab_prepare.sh, in a scratch git repository: NAME=REF becomes a folder with what a
    build, the benchmarks, the tests and the tools need (not examples/models); NAME=REF+PATCH
    has the patch applied; bad names, refs, missing or failing patches are refused."""
    import difflib
    repo = tmp_path / "repo"
    files = {"setup.py": "import os\nprint('setup')\nx = 1\n", "pyproject.toml": "[x]\n",
             "csrc/api.h": "// api\n", "vllm_petit_moe/__init__.py": "", "tests/conftest.py": "",
             "examples/bench.py": "", "examples/models/m.json": "{}"}
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    (repo / "tools").mkdir()
    shutil.copy(ROOT / "tools" / "ab_prepare.sh", repo / "tools" / "ab_prepare.sh")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "GIT_AUTHOR_NAME": "t",
           "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "base"]):
        subprocess.run(["git", *cmd], cwd=repo, env=env, check=True)
    base = files["setup.py"]
    changed = base + "# patched by the test\n"
    patch = tmp_path / "setup.patch"
    patch.write_text("".join(difflib.unified_diff(
        base.splitlines(keepends=True), changed.splitlines(keepends=True),
        "a/setup.py", "b/setup.py")))
    out = tmp_path / "trees"

    def run(*specs):
        return subprocess.run(["bash", str(repo / "tools" / "ab_prepare.sh"), *specs],
                              env={**env, "AB_DIR": str(out)}, capture_output=True, text=True)

    result = run("base=HEAD", f"mod=HEAD+{patch}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (out / "base" / "setup.py").read_text() == base
    assert (out / "mod" / "setup.py").read_text() == changed
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, env=env,
                          capture_output=True, text=True, check=True).stdout.strip()
    assert (out / "base" / ".petit_commit").read_text() == head + "\n"
    assert (out / "mod" / ".petit_commit").read_text() == head + "+setup.patch\n"
    for tree in ("base", "mod"):
        for name in ("csrc/api.h", "tools/ab_prepare.sh", "tests/conftest.py",
                     "examples/bench.py"):
            assert (out / tree / name).exists(), name
        assert not (out / tree / "examples" / "models").exists()
    assert run("mod=HEAD+" + str(patch)).returncode == 0  # replaced, not patched twice
    assert (out / "mod" / "setup.py").read_text() == changed
    assert run("bad-name=HEAD").returncode == 2
    assert run("x=no-such-ref").returncode == 2
    assert run(f"x=HEAD+{tmp_path / 'missing.patch'}").returncode == 2
    other = ["import os\n", "a line HEAD does not have\n"]  # made against another setup.py
    (tmp_path / "stale.patch").write_text("".join(difflib.unified_diff(
        other, ["import os\n", "changed\n"], "a/setup.py", "b/setup.py")))
    assert run(f"x=HEAD+{tmp_path / 'stale.patch'}").returncode == 1
    copy = tmp_path / "copy"  # an untracked copy (as CI tests one) is refused
    shutil.copytree(repo / "tools", copy / "tools")
    assert subprocess.run(["bash", str(copy / "tools" / "ab_prepare.sh"), "x=HEAD"], env=env,
                          capture_output=True).returncode == 2


def test_ncu_stalls_ranks_instructions_per_kernel(tmp_path, capsys):
    """tools/ncu_stalls.py on an Nsight Compute source-page export (one table per kernel, each
    after its "Kernel Name" line): each kernel's instructions by warp-stall samples, their share
    of that kernel's samples and the largest per-reason columns (Not-issued ones left out)."""
    stalls = load_script("tools/ncu_stalls.py")
    header = ('"Address","Source","Warp Stall Sampling (All Samples)",'
              '"Warp Stall Sampling (Not-issued Samples)","stall_long_sb","stall_barrier",'
              '"stall_long_sb (Not Issued)"\n')
    export = tmp_path / "source.csv"
    export.write_text(
        '"Kernel Name","gemm_a",\n' + header
        + '"0x10","HGMMA.64x256x16.F32.BF16 R24","30","20","0","5","0"\n'
        + '"0x20","@P0 BRA 0x10","60","50","55","0","50"\n'
        + '"0x30","NOP","10","5","0","0","0"\n'
        + '"Kernel Name","gemm_b",\n' + header
        + '"0x10","WARPGROUP.DEPBAR.LE gsb0, 0x0","1,000","900","0","990","0"\n')
    stalls.summarize(export.read_text().splitlines(keepends=True), top=2)
    out = capsys.readouterr().out
    first, second = out.split("== ")[1:]
    assert "gemm_a" in first and "100 warp stall samples; top 2" in first
    lines = [line for line in first.splitlines() if "%" in line]
    assert len(lines) == 2 and "60.0%" in lines[0] and "@P0 BRA 0x10" in lines[0]
    assert "stall_long_sb 55.0%" in lines[0] and "Not Issued" not in lines[0]
    assert "30.0%" in lines[1] and "HGMMA" in lines[1] and "stall_barrier 5.0%" in lines[1]
    assert "NOP" not in first
    assert "gemm_b" in second and "100.0%" in second and "stall_barrier 99.0%" in second


def test_clock_probe_help_runs_without_a_gpu():
    """tools/clock_probe.py imports torch and the benchmark only when it runs."""
    from script_module import script_help
    out = script_help("tools/clock_probe.py")
    assert "--tiles" in out and "--seconds" in out


def test_clock_probe_parses_nvidia_smi_samples_and_phase_medians():
    """tools/clock_probe.py: nvidia-smi's timestamped samples (an unreadable "[N/A]" line
    skipped) and the median clock and power of the samples inside a phase, past its first
    half second."""
    probe = load_script("tools/clock_probe.py")
    text = ("2026/12/01 02:59:01.000, 1980, 120.5\n"
            "2026/12/01 02:59:01.250, 1530, 690.0\n"
            "2026/12/01 02:59:01.500, [N/A], [N/A]\n"
            "2026/12/01 02:59:01.750, 1510, 694.0\n"
            "2026/12/01 02:59:02.000, 1520, 692.0\n")
    samples = probe.parse_samples(text)
    assert [c for _, c, _ in samples] == [1980.0, 1530.0, 1510.0, 1520.0]
    t0 = samples[0][0]
    assert abs(samples[1][0] - t0 - 0.25) < 1e-6 and abs(samples[3][0] - t0 - 1.0) < 1e-6
    # phase from t0 - 0.25: the samples from t0 + 0.25 on count
    assert probe.phase_medians(samples, t0 - 0.25, t0 + 1.0) == (1520.0, 692.0, 3)
    assert probe.phase_medians(samples, t0 + 2.0, t0 + 3.0) is None


def test_expert_kernel_times_help_runs_without_a_gpu():
    """tools/expert_kernel_times.py imports torch and the benchmark only when it runs."""
    from script_module import script_help
    out = script_help("tools/expert_kernel_times.py")
    assert "--tiles" in out and "--fused" not in out


def test_expert_kernel_times_counts_the_tiles_of_each_gemm():
    """m-tiles from the rows per local expert (-1: no expert), times each GEMM's n-tiles:
    experts with 70 / 3 / 0 / 5 entries are 2 + 1 + 0 + 1 m-tiles of 64 rows; Qwen3-30B-A3B's
    intermediate 768 and hidden 2048 are 12 / 16 narrow and 6 / 8 m64 n-tiles."""
    import torch
    tool = load_script("tools/expert_kernel_times.py")
    ids = torch.cat([torch.full((70,), 0), torch.full((3,), 1), torch.full((5,), 3),
                     torch.full((9,), -1)]).reshape(-1, 1)
    assert tool.expected_tiles("wgmma_narrow", ids, 2048, 768) == (4 * 12, 4 * 16)
    assert tool.expected_tiles("wgmma_m64", ids, 2048, 768) == (4 * 6, 4 * 8)
    assert tool.expected_tiles("wgmma", ids, 2048, 768) == (3 * 6, 3 * 8)
