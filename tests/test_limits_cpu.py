"""vllm_petit_moe.limits, the Python side's one source of the kernels' limits, against the C++
constants it mirrors: parsed from csrc/common/layout.h, csrc/common/fp8.h and the
CombineTraceSlot enum of csrc/api.h (no build needed), and read from the compiled extension
where it is built. Also: `import vllm_petit_moe._C` works in a fresh interpreter on its own."""
from __future__ import annotations

import ast
import importlib.util
import operator
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_petit_moe import buffer, limits, ops
from vllm_petit_moe.vllm_glue import buffer_cache, experts, hook

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"

# limits name -> the constexpr of csrc/common it mirrors.
HEADER_NAMES = {
    "MAX_TOP_K": "kMaxTopK",
    "MAX_WORLD_SIZE": "kMaxWorldSize",
    "MAX_EXPERTS": "kMaxExperts",
    "MAX_TOKENS_PER_RANK": "kMaxTokensPerRank",
    "MAX_LOCAL_EXPERTS": "kMaxExperts",
    "SIZE_MULTIPLE": "kSizeMultiple",
    "TOKEN_GROUP_SIZE": "kTokenGroupSize",
    "MIN_CHUNK_VECTORS": "kMinChunkVectors",
    "REGION_ALIGNMENT": "kRegionAlignment",
    "FP8_E4M3_MAX": "kFp8E4m3Max",
    "FP8_SCALE_BLOCK": "kFp8ScaleBlock",
    "FP8_BLOCK_MIN_AMAX": "kFp8BlockMinAmax",
    "FP8_TOKEN_MIN_SCALE": "kFp8TokenMinScale",
    "MEGAMOE_MAX_ENTRIES": "kMegaMoeMaxEntries",
    "MEGAMOE_SIZE_MULTIPLE": "kMegaMoeSizeMultiple",
    "MEGAMOE_TRACE_HEADER": "kMegaMoeTraceHeader",
    "MEGAMOE_TRACE_TASKS": "kMegaMoeTraceTasks",
    "MEGAMOE_TRACE_STEPS": "kMegaMoeTraceSteps",
    "MEGAMOE_TRACE_SLOTS": "kMegaMoeTraceSlots",
    "MEGAMOE_BLOCKS_PER_SM": "kMegaMoeBlocksPerSm",
    "DEFAULT_TIMEOUT_S": "kDefaultTimeoutS",
    "MAX_TIMEOUT_S": "kMaxTimeoutS",
    "MAX_WAIT_S": "kMaxWaitS",
}

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv}


def _evaluate(expr: str, known: dict | None = None) -> float:
    """A constexpr initializer of numbers, earlier constants (`known`: {name: (type, value)}),
    + - * / and parentheses (float literals lose their f suffix)."""
    def walk(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.Name) and known and node.id in known:
            return known[node.id][1]
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        raise ValueError(f"unsupported constexpr initializer: {expr!r}")
    python = re.sub(r"(\d\.?\d*(?:e-?\d+)?)f\b", r"\1", expr)
    return walk(ast.parse(python, mode="eval").body)


def _constexprs(*headers: str) -> dict[str, tuple[str, float]]:
    """{name: (type, value)} of the `constexpr int|float kName = ...;` lines of the headers."""
    found = {}
    for header in headers:
        text = (CSRC / header).read_text()
        for ctype, name, expr in re.findall(r"constexpr\s+(int|float)\s+(k\w+)\s*=\s*([^;]+);",
                                            text):
            found[name] = (ctype, _evaluate(expr, found))
    return found


def _float32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def test_limits_match_the_headers():
    constants = _constexprs("common/layout.h", "common/fp8.h")
    for name, cname in HEADER_NAMES.items():
        assert cname in constants, f"{cname} (limits.{name}) not found in csrc/common"
        ctype, value = constants[cname]
        ours = getattr(limits, name)
        if ctype == "float":  # the kernels compute with the float32 rounding of the constant
            assert _float32(ours) == _float32(value), (name, ours, cname, value)
        else:
            assert isinstance(ours, int) and ours == value, (name, ours, cname, value)


def test_max_entries_is_int32():
    assert limits.MAX_ENTRIES == 2**31 - 1  # csrc/api.h: N*K < 2^31, int32 entry indices


def test_combine_trace_slots_match_api_h():
    text = (CSRC / "api.h").read_text()
    body = re.search(r"enum\s+CombineTraceSlot\s*\{([^}]*)\}", text).group(1)
    names = [re.match(r"\s*(k\w+)", item).group(1) for item in body.split(",") if item.strip()]
    assert names[-1] == "kCombineTraceSlots"
    # kTraceFirstReduceReady -> first_reduce_ready
    snake = [re.sub(r"(?<!^)(?=[A-Z])", "_", n.removeprefix("kTrace")).lower()
             for n in names[:-1]]
    assert tuple(snake) == buffer.COMBINE_TRACE_SLOTS


def test_runtime_modules_take_limits_from_one_source():
    """ops, buffer and the vLLM glue use limits' objects (imported, not redefined)."""
    for module in (ops, buffer, hook, experts):
        for name in ("MAX_TOP_K", "SIZE_MULTIPLE", "MAX_LOCAL_EXPERTS", "MAX_EXPERTS",
                     "MAX_WORLD_SIZE", "TOKEN_GROUP_SIZE", "MIN_CHUNK_VECTORS", "MAX_ENTRIES",
                     "FP8_SCALE_BLOCK", "FP8_BLOCK_MODES"):
            if hasattr(module, name):
                assert getattr(module, name) is getattr(limits, name), (module.__name__, name)
    assert buffer_cache.BufferConfig.__dataclass_fields__["max_top_k"].default == limits.MAX_TOP_K
    assert set(limits.FP8_QUANT_MODES) == set(buffer.DISPATCH_QUANT) - {None}
    assert set(limits.FP8_BLOCK_MODES) <= set(limits.FP8_QUANT_MODES)


def test_one_default_timeout(monkeypatch):
    """Every entry point's default spin-wait bound is limits.DEFAULT_TIMEOUT_S (kDefaultTimeoutS
    on the C++ side, checked above), not a literal of its own."""
    import inspect

    from vllm_petit_moe.vllm_glue import envs

    default = limits.DEFAULT_TIMEOUT_S
    assert inspect.signature(buffer.EpBuffer).parameters["timeout_s"].default == default
    assert inspect.signature(ops.megamoe_forward).parameters["timeout_s"].default == default
    assert buffer_cache.BufferConfig.__dataclass_fields__["timeout_s"].default == default
    assert limits.check_timeout_s(default) == default
    monkeypatch.delenv(envs.VLLM_PETIT_MOE_TIMEOUT_S, raising=False)
    assert envs.timeout_s() == default
    bindings = (CSRC / "bindings" / "kernels.cpp").read_text()
    assert 'py::arg("timeout_s") = double(kDefaultTimeoutS)' in bindings
    assert not re.search(r'py::arg\("timeout_s"\) = [0-9]', bindings)


def test_runtime_does_not_import_the_testing_package():
    """The runtime package needs neither the oracle nor the diagnostics."""
    code = ("import sys; import vllm_petit_moe.buffer, vllm_petit_moe.ops, "
            "vllm_petit_moe.vllm_glue.prepare_finalize, vllm_petit_moe.vllm_glue.hook; "
            "print(sorted(m for m in sys.modules if m.startswith('vllm_petit_moe.testing')))")
    pytest.importorskip("vllm")  # the glue builds on vLLM's classes
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=str(ROOT), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def _require_extension():
    # find_spec only says whether the module file exists: a built but broken extension
    # (undefined symbol, wrong torch) must fail, not skip.
    if importlib.util.find_spec("vllm_petit_moe._C") is None:
        pytest.skip("compiled extension vllm_petit_moe._C not built "
                    "(pip install --no-build-isolation -e .)")


def test_extension_limits_match():
    _require_extension()
    from vllm_petit_moe import _C
    assert _C.kMaxTopK == limits.MAX_TOP_K
    assert _C.kMaxWorldSize == limits.MAX_WORLD_SIZE
    assert _C.kMaxExperts == limits.MAX_EXPERTS
    assert _C.kTokenGroupSize == limits.TOKEN_GROUP_SIZE
    assert _C.kMinChunkVectors == limits.MIN_CHUNK_VECTORS
    assert _C.kCombineTraceSlots == len(buffer.COMBINE_TRACE_SLOTS)


def test_extension_imports_on_its_own():
    """`import vllm_petit_moe._C` as the first statement of a fresh interpreter: the package
    loads torch (and so libc10/libtorch) before the extension."""
    _require_extension()
    result = subprocess.run([sys.executable, "-c", "import vllm_petit_moe._C"],
                            capture_output=True, text=True, cwd=str(ROOT), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_binding_checks_its_tensors_before_any_device_call():
    """The binding's own checks (dtypes, device) run first and name the tensor; on a machine
    without a GPU they are what a CPU tensor meets."""
    _require_extension()
    import torch

    from vllm_petit_moe import _C
    x = torch.zeros(4, 16, dtype=torch.bfloat16)
    ids, weights = torch.zeros(4, 2, dtype=torch.int32), torch.zeros(4, 2)
    w13, w2 = torch.zeros(2, 16, 16, dtype=torch.bfloat16), torch.zeros(2, 16, 8,
                                                                        dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="w13 and w2 must be bfloat16 .quantized expert "
                                           "weights are not supported"):
        _C.experts_forward(x, ids, weights, w13.half(), w2)
    with pytest.raises(RuntimeError, match="recv_x must be a CUDA tensor"):
        _C.experts_forward(x, ids, weights, w13, w2)
    with pytest.raises(RuntimeError, match="x must be a CUDA tensor"):
        _C.megamoe_forward(x, ids, weights, w13, w2, x, x, x, ids)
    with pytest.raises(RuntimeError, match="topk_ids must be a CUDA tensor"):
        _C.expert_row_lists(ids, 2)
