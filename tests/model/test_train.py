"""engine.train end to end at toy size: tokenizer -> train (and resume) -> export -> both loaders."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine.train import export, train  # noqa: E402
from engine.train.tokenizer import main as tokenizer_main  # noqa: E402

TOY = [
    "--hidden",
    "32",
    "--layers",
    "1",
    "--heads",
    "2",
    "--kv-heads",
    "1",
    "--ffn",
    "64",
    "--context",
    "128",
    "--seq-len",
    "64",
    "--batch-size",
    "2",
    "--micro-batch",
    "1",
    "--warmup-steps",
    "1",
    "--threads",
    "1",
    "--device",
    "cpu",
    "--log-every",
    "1",
    "--val-seqs",
    "2",
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    tokenizer_main(["--out", str(d), "--vocab-size", "400"])
    # train on a handful of files only (keep the test fast)
    files = (d / "train_files.txt").read_text().splitlines()[:8]
    (d / "train_files.txt").write_text("\n".join(files) + "\n")
    vals = (d / "val_files.txt").read_text().splitlines()[:2]
    (d / "val_files.txt").write_text("\n".join(vals) + "\n")
    return d


def test_train_resume_export(run_dir, tmp_path, capsys):
    train.main(["--run-dir", str(run_dir), "--max-steps", "2", *TOY])
    first = torch.load(run_dir / "ckpt.pt", weights_only=False)
    assert first["step"] == 2 and first["seqs"] == 4
    train.main(["--run-dir", str(run_dir), "--max-steps", "4", *TOY])
    assert "resumed at step 2" in capsys.readouterr().out
    second = torch.load(run_dir / "ckpt.pt", weights_only=False)
    assert second["step"] == 4 and second["seqs"] == 8
    assert any(h["kind"] == "val" for h in second["history"])
    assert (run_dir / "loss_curve.png").stat().st_size > 1000
    assert json.loads((run_dir / "train_summary.json").read_text())["tokens"] == 8 * 64

    out = tmp_path / "model"
    info = export.export(run_dir, out)
    assert info["step"] == 4
    from transformers import AutoModelForCausalLM

    from engine import Engine

    hf = AutoModelForCausalLM.from_pretrained(out).float()
    eng = Engine.load(out, threads=1, wafer=False, cache_dir=tmp_path / "cache")
    ids = eng.tokenizer.encode("def f(x):\n    return x\n")
    ref = hf(torch.tensor([ids])).logits[0].detach().numpy()
    got = eng.forward_logits(ids)
    assert abs(ref - got).max() < 1e-3
    assert eng.tokenizer.fim is not None


def test_bad_args(run_dir):
    with pytest.raises(SystemExit):
        train.main(["--run-dir", str(run_dir), *TOY])  # no budget
    with pytest.raises(SystemExit):
        train.main(
            ["--run-dir", str(run_dir), "--max-steps", "1", *TOY, "--seq-len", "512"]
        )  # > context
    with pytest.raises(SystemExit):
        train.main(
            [
                "--run-dir",
                str(run_dir),
                "--max-steps",
                "1",
                *TOY,
                "--batch-size",
                "3",
                "--micro-batch",
                "2",
            ]
        )
