"""Kernel and runner switches are frozen config fields (``KernelConfig``,
``SpecConfig.always_pad_verify``), validated once; no module-level switch remains for anything
to flip, and two engines in one process each run under their own ``KernelConfig``."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import tiny_config, tiny_draft_spec

from verifypd.config import EngineConfig, KernelConfig, SpecConfig
from verifypd.engine.core import EngineCore

ROOT = Path(__file__).resolve().parents[1]
# The switches that used to be module globals flipped from outside (bench by string name).
OLD_SWITCHES = {
    "GEMV_MAX_ROWS",
    "FUSE_NORM",
    "FUSE_NORM_MAX_N",
    "FUSE_SILU",
    "FUSE_SILU_EPILOGUE",
    "ENABLED",
}


def test_defaults_are_frozen_and_recorded() -> None:
    cfg = EngineConfig()
    assert cfg.kernels == KernelConfig() and cfg.kernels.pdl and cfg.kernels.gemv_max_rows == 16
    assert cfg.spec.always_pad_verify is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.kernels.pdl = False  # type: ignore[misc]
    recorded = dataclasses.asdict(cfg)  # what the benchmarks write (bench/common.json_default)
    assert recorded["kernels"] == {
        "gemv_max_rows": 16,
        "fuse_norm": True,
        "fuse_norm_max_n": 8192,
        "fuse_silu": True,
        "fuse_silu_epilogue": True,
        "pdl": True,
        "weight_prefetch": "auto",
        "fused_sampling_noise": True,
        "gemm_split_rows": 0,
    }
    assert recorded["spec"]["always_pad_verify"] is False
    assert (
        recorded["scheduler"]["max_prefill_chunk"],
        recorded["scheduler"]["prefill_pack_tokens"],
    ) == (4096, 512)
    assert recorded["prefill_sm_carveout"] == 0


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: KernelConfig(gemv_max_rows=17), "gemv_max_rows"),
        (lambda: KernelConfig(gemv_max_rows=-1), "gemv_max_rows"),
        (lambda: KernelConfig(gemv_max_rows=True), "gemv_max_rows"),
        (lambda: KernelConfig(gemv_max_rows=2.0), "gemv_max_rows"),
        (lambda: KernelConfig(fuse_norm_max_n=0), "fuse_norm_max_n"),
        (lambda: KernelConfig(fuse_norm="no"), "fuse_norm"),
        (lambda: KernelConfig(fuse_silu=0), "fuse_silu"),
        (lambda: KernelConfig(fuse_silu_epilogue=None), "fuse_silu_epilogue"),
        (lambda: KernelConfig(pdl="0"), "pdl"),
        (lambda: KernelConfig(weight_prefetch="tile"), "weight_prefetch"),
        (lambda: KernelConfig(fused_sampling_noise=1), "fused_sampling_noise"),
        (lambda: KernelConfig(weight_prefetch=True), "weight_prefetch"),
        (lambda: EngineConfig(kernels={"pdl": False}), "kernels"),
        (lambda: SpecConfig(always_pad_verify="yes"), "always_pad_verify"),
        (lambda: EngineConfig(prefill_sm_carveout=-1), "prefill_sm_carveout"),
        (lambda: EngineConfig(prefill_sm_carveout=128), "prefill_sm_carveout"),
        (lambda: EngineConfig(prefill_sm_carveout=8.0), "prefill_sm_carveout"),
        (lambda: EngineConfig(prefill_sm_carveout=True), "prefill_sm_carveout"),
    ],
)
def test_bad_values_are_refused_naming_the_field(make, field) -> None:
    with pytest.raises(ValueError, match=field):
        make()


def test_edge_values_are_accepted() -> None:
    assert KernelConfig(gemv_max_rows=0).gemv_max_rows == 0  # cuBLAS for every projection
    assert KernelConfig(gemv_max_rows=16, fuse_norm_max_n=1).fuse_norm_max_n == 1


def _module_level_assignments(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _outside_writes(tree: ast.Module) -> set[str]:
    """``module.NAME = ...`` and ``setattr(x, "NAME", ...)`` / ``setattr(x, "mod.NAME", ...)``
    anywhere in a file, for the old switch names."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found |= {t.attr for t in targets if isinstance(t, ast.Attribute)}
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr":
            if len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                found.add(str(node.args[1].value).rsplit(".", 1)[-1])
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value:
            found.add(node.value.rsplit(".", 1)[-1])  # "triton_ops.FUSE_NORM" as a dict key
    return found & OLD_SWITCHES


def _scan(folders: tuple[str, ...], check) -> list[str]:
    offenders = []
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == Path(__file__).resolve():  # the scan's own examples
                continue
            hits = check(ast.parse(path.read_text()))
            offenders += [f"{path.relative_to(ROOT)}: {name}" for name in sorted(hits)]
    return offenders


def test_no_module_level_switch_remains() -> None:
    """The old switch names are no module global anywhere in the package, and neither the
    package nor the benchmarks and tests write them onto a module (the knobs are
    ``KernelConfig`` fields, handed to the kernels at engine construction)."""
    assert not _scan(("verifypd",), lambda t: _module_level_assignments(t) & OLD_SWITCHES)
    assert not _scan(("verifypd", "bench", "tests"), _outside_writes)


def test_the_scan_catches_a_switch() -> None:
    """The scans above fail on the old pattern (a module global; a benchmark flipping it)."""
    old = ast.parse("GEMV_MAX_ROWS = 16\nFUSE_SILU: bool = True\nLIMIT = 3\n")
    assert _module_level_assignments(old) & OLD_SWITCHES == {"GEMV_MAX_ROWS", "FUSE_SILU"}
    flips = "pdl.ENABLED = False\nsetattr(m, 'FUSE_NORM', 0)\nX = {'triton_ops.FUSE_SILU': 0}\n"
    assert _outside_writes(ast.parse(flips)) == {"ENABLED", "FUSE_NORM", "FUSE_SILU"}


def test_two_engines_each_run_their_own_kernel_config() -> None:
    """Two engines in one process, built with different ``KernelConfig``s, each get an op table
    under their own choice (target and drafter alike); the torch references ignore it."""
    cublas, gemv = KernelConfig(gemv_max_rows=0, pdl=False), KernelConfig(fuse_norm=False)
    spec = tiny_draft_spec(max_draft_len=2, initial_draft_len=2)
    a = EngineCore(tiny_config(use_triton=True, kernels=cublas, spec=spec))
    b = EngineCore(tiny_config(use_triton=True, kernels=gemv))
    assert a.ops.linear.__self__.knobs == cublas and b.ops.linear.__self__.knobs == gemv
    assert a.loaded.model.ops is a.ops and b.loaded.model.ops is b.ops
    assert a.spec.drafter.runner.model.ops is a.ops
    ref = EngineCore(tiny_config(kernels=cublas))
    assert ref.ops.linear.__module__.endswith("reference")


def test_always_pad_verify_reaches_only_its_engines_runner() -> None:
    padded = EngineCore(tiny_config(spec=tiny_draft_spec(always_pad_verify=True)))
    plain = EngineCore(tiny_config(spec=tiny_draft_spec()))
    assert padded.runner.inputs.always_pad_verify and not plain.runner.inputs.always_pad_verify
    assert not padded.spec.drafter.runner.inputs.always_pad_verify  # the drafter never verifies
    assert torch.device("cpu") == padded.device
