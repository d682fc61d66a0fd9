"""The dflash-jax command line: inspect, load, demo (convert-nvfp4 is tested with the NVFP4 loading)."""

import jax
import numpy as np

from dflash_jax import load_drafter
from dflash_jax.cli import main

from ._io import load_file, save_file


def test_inspect_reports_family_tensors_missing_and_unexpected(tmp_path, capsys):
    from dflash_jax.testing import write_checkpoint

    write_checkpoint(tmp_path, "tiny-dspark")
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "dspark drafter" in out and "markov_head.markov_w1.weight" in out and "missing or malformed: 0" in out
    tensors = load_file(tmp_path / "model.safetensors")
    tensors.pop("layers.0.mlp.up_proj.weight")
    tensors["stray.weight"] = np.zeros(2, np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    assert main(["inspect", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "missing tensor 'layers.0.mlp.up_proj.weight'" in out and "unexpected: 1\n    stray.weight" in out


def test_load_reports_speed_and_memory(tmp_path, capsys):
    from dflash_jax.testing import write_checkpoint

    write_checkpoint(tmp_path, "tiny-dflash")
    assert main(["load", str(tmp_path), "--devices", "2"]) == 0
    out = capsys.readouterr().out
    assert "loaded onto 2 x cpu" in out and "GB/s" in out and "peak host RSS" in out


def test_errors_are_reported_not_raised(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    assert "without config.json" in capsys.readouterr().err


def test_demo(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    for preset in ("tiny-dflash", "tiny-dflash2", "tiny-dspark"):
        assert f"{preset}:" in out
    assert f"replicated on {len(jax.local_devices())} device(s)" in out


def test_progress_bar_on_request(tmp_path, capsys):
    from dflash_jax.testing import write_checkpoint

    write_checkpoint(tmp_path, "tiny-dflash")
    drafter = load_drafter(tmp_path, progress=True)
    assert len(jax.tree.leaves(drafter.params)) == 25
