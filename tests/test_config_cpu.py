"""CPU: the tuning configs. vllm_petit_moe/config.py mirrors the structs of
csrc/common/config.h field by field (names, order, defaults), and nothing in csrc reads the
environment: every tunable is a config field passed from Python."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from conftest import extension_available
from vllm_petit_moe.config import CombineConfig, ExpertConfig, as_dict, parse_config

ROOT = Path(__file__).resolve().parents[1]
CONFIG_H = ROOT / "csrc" / "common" / "config.h"


def header_structs() -> dict[str, dict[str, int]]:
    """{struct name: {field: default}} of the int fields of config.h, in declaration order."""
    text = re.sub(r"//[^\n]*", "", CONFIG_H.read_text())
    structs = {}
    for name, body in re.findall(r"struct (\w+) \{(.*?)\};", text, flags=re.S):
        structs[name] = {field: int(value)
                         for field, value in re.findall(r"int (\w+) = (-?\d+);", body)}
    return structs


def header_field_tables() -> dict[str, list[str]]:
    """{struct name: [field, ...]} of config.h's k*ConfigFields tables (the names the binding
    reads config dicts by), in table order; each entry names its own member."""
    tables = {}
    for struct, body in re.findall(r"std::pair<const char\*, int (\w+)::\*> k\w+Fields\[\] = "
                                   r"\{(.*?)\};", CONFIG_H.read_text(), flags=re.S):
        entries = re.findall(r'\{"(\w+)", &(\w+)::(\w+)\}', body)
        assert all(owner == struct and name == member for name, owner, member in entries), \
            entries
        tables[struct] = [name for name, _, _ in entries]
    return tables


def python_defaults(cls) -> dict[str, int]:
    return {field.name: field.default for field in dataclasses.fields(cls)}


@pytest.mark.parametrize("cls", [ExpertConfig, CombineConfig])
def test_python_mirror_matches_the_header(cls):
    structs = header_structs()
    assert set(structs) == {"ExpertConfig", "CombineConfig"}, structs
    assert list(python_defaults(cls).items()) == list(structs[cls.__name__].items())
    assert as_dict(cls()) == structs[cls.__name__]


@pytest.mark.parametrize("cls", [ExpertConfig, CombineConfig])
def test_the_binding_field_tables_list_every_field_in_order(cls):
    assert header_field_tables()[cls.__name__] == list(header_structs()[cls.__name__])


@pytest.mark.skipif(not extension_available(), reason="compiled extension not built")
def test_extension_reads_config_dicts_by_field_name():
    """ExpertConfig dicts: an unknown field and an invalid value are refused by name (before
    any device call)."""
    from vllm_petit_moe import _C

    assert _C.resolve_expert_tiles(4, 2, 2, 16, config=as_dict(ExpertConfig())) >= 1
    with pytest.raises(RuntimeError, match="ExpertConfig has no field split_k"):
        _C.resolve_expert_tiles(4, 2, 2, 16, config={"split_k": 4})
    with pytest.raises(RuntimeError, match="narrow_max_rows <= m64_max_rows"):
        _C.resolve_expert_tiles(4, 2, 2, 16, config={"narrow_max_rows": 100})
    # (CombineConfig dicts: tests/test_layout_cpu.py, through combine_plan)


@pytest.mark.skipif(not extension_available(), reason="compiled extension not built")
def test_extension_defaults_match():
    from vllm_petit_moe import _C

    defaults = _C.config_defaults()
    assert defaults == {"ExpertConfig": as_dict(ExpertConfig()),
                        "CombineConfig": as_dict(CombineConfig())}


def test_parse_config():
    assert parse_config(CombineConfig, "") == CombineConfig()
    assert parse_config(CombineConfig, "reduce_pct=40, tail_chunks=0") == CombineConfig(
        reduce_pct=40, tail_chunks=0)
    assert parse_config(ExpertConfig, "narrow_max_rows=4") == ExpertConfig(narrow_max_rows=4)
    with pytest.raises(ValueError, match="field=value"):
        parse_config(CombineConfig, "reduce_percent=40")
    with pytest.raises(ValueError, match="field=value"):
        parse_config(CombineConfig, "reduce_pct")


@pytest.mark.parametrize("make", [
    lambda: CombineConfig(reduce_pct=91),
    lambda: CombineConfig(reduce_vectors=-1),
    lambda: CombineConfig(tail_chunks=1025),
    lambda: ExpertConfig(narrow_max_rows=97),
    lambda: ExpertConfig(mc_min_hidden=-8),
])
def test_invalid_values_are_refused(make):
    with pytest.raises(ValueError):
        make()


def test_fields_are_ints():
    with pytest.raises(TypeError):
        CombineConfig(reduce_pct=2.5)
    with pytest.raises(TypeError):
        ExpertConfig(narrow_max_rows=True)


def test_no_environment_reads_in_csrc():
    """Knobs are arguments: no getenv (or any other read of the environment) in the kernels,
    their launchers or the binding."""
    pattern = re.compile(r"\b(?:secure_)?getenv\b|\benviron\b|\bGetEnvironmentVariable")
    sources = [p for p in (ROOT / "csrc").rglob("*") if p.suffix in (".h", ".cu", ".cpp", ".cuh")]
    assert len(sources) > 10, sources
    hits = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
            for path in sources
            for number, line in enumerate(path.read_text().splitlines(), 1)
            if pattern.search(line)]
    assert hits == []
