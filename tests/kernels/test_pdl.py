"""Programmatic dependent launch: when the launch options turn it on."""

from __future__ import annotations

import torch

from verifypd.kernels import pdl


def test_off_on_cpu():
    assert pdl.launch_options(torch.device("cpu")) == {"USE_PDL": False, "launch_pdl": False}


def test_on_for_hopper_when_enabled_and_available(monkeypatch):
    monkeypatch.setattr(pdl, "AVAILABLE", True)
    monkeypatch.setattr(pdl, "_SUPPORTED", {0: True, 1: False})  # device 1: pre-Hopper
    assert pdl.launch_options(torch.device("cuda", 0)) == {"USE_PDL": True, "launch_pdl": True}
    assert pdl.launch_options(torch.device("cuda", 1))["USE_PDL"] is False
    assert pdl.launch_options(torch.device("cuda", 0), use_pdl=False)["launch_pdl"] is False


def test_off_without_triton_support(monkeypatch):
    monkeypatch.setattr(pdl, "AVAILABLE", False)
    monkeypatch.setattr(pdl, "_SUPPORTED", {0: True})
    assert pdl.launch_options(torch.device("cuda", 0))["USE_PDL"] is False
