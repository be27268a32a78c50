"""``%dist export DIR --format safetensors``: the exported job writes the trained model as a Hugging Face folder.

A tiny Llama (built from a config, nothing downloaded) trains one epoch in a cell; the export runs with
``torchrun --standalone`` on 2 ranks, from the weights the cell started from, so the folder the job writes
must be the cell's trained model: ``from_pretrained`` reads it back equal to the notebook's model.
"""

import json
import os

import pytest
import torch

from test_export import run_job

transformers = pytest.importorskip("transformers")

BODY = "x = batch[0]\nloss = model(input_ids=x, labels=x).loss"


def test_job_saves_a_folder_from_pretrained_reads(shell, tmp_path):
    ns = shell.user_ns
    torch.manual_seed(3)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    ns["exh_llama"] = transformers.LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(0)
    ns["exh_tokens"] = torch.utils.data.TensorDataset(torch.randint(0, 64, (16, 12), generator=g))
    shell.run_cell_magic("distrain", "--model exh_llama --data exh_tokens --epochs 1 --batch-size 4 --optimizer sgd "
                         "--lr 0.1 --seed 1 --progress none", BODY)
    job = tmp_path / "job"
    with pytest.raises(Exception, match="--format 'npz' is not one of dcp, safetensors"):
        shell.run_line_magic("dist", f"export {job} --format npz")
    shell.run_line_magic("dist", f"export {job} --format safetensors")
    assert json.loads((job / "options.json").read_text())["save"] == {"format": "safetensors"}
    code, out = run_job(job, "--max-shard-size", "30000")
    assert code == 0, out[-3000:]
    assert f"distnb job: saved the model in {job / 'model'}" in out
    files = sorted(f for f in os.listdir(job / "model") if f.endswith(".safetensors"))
    assert len(files) >= 2 and (job / "model" / "config.json").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(job / "model"))
    want = ns["exh_llama"].state_dict()
    for key, t in loaded.state_dict().items():
        torch.testing.assert_close(t, want[key], atol=1e-5, rtol=0, msg=lambda m: f"{key}: {m}")
    code, out = run_job(job, "--format", "dcp", "--epochs", "2", "--save-dir", str(tmp_path / "not_written"))
    assert code == 0 and not (tmp_path / "not_written").exists(), out[-3000:]
