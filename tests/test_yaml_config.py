"""Config files in mlx-lm's YAML (issue 23, item 4): `--config lora.yaml` takes mlx_lm.lora's keys
under their names (mlx_diloco/mlx_lm_config.py), says one line for each it ignores, and refuses in
one line what it cannot do. On the code before it, a .yaml config was read as JSON and refused."""

import json

import pytest

from conftest import run_cli
from mlx_diloco.config import ConfigError, TrainConfig

# mlx-lm's examples/lora_config.yaml as a user keeps it (its comments dropped).
MLX_LM_EXAMPLE = """\
model: "mlx_model"
train: true
fine_tune_type: lora
training_mode: normal
optimizer: adamw
data: "/path/to/training/data"
seed: 0
num_layers: 16
batch_size: 4
iters: 1000
val_batches: 25
learning_rate: 1e-5
steps_per_report: 10
steps_per_eval: 200
resume_adapter_file: null
adapter_path: "adapters"
save_every: 100
test: false
test_batches: 100
max_seq_length: 2048
grad_checkpoint: false
lora_parameters:
  keys: ["self_attn.q_proj", "self_attn.v_proj"]
  rank: 8
  scale: 20.0
  dropout: 0.0
"""


def config_of(tmp_path, text: str, name: str = "lora.yaml") -> TrainConfig:
    path = tmp_path / name
    path.write_text(text)
    return TrainConfig.from_file(path)


def test_mlx_lm_example_config_maps_to_ours(tmp_path, capsys):
    c = config_of(tmp_path, MLX_LM_EXAMPLE)
    assert (c.model, c.data, c.seed, c.batch_size, c.grad_checkpoint) == \
        ("mlx_model", "/path/to/training/data", 0, 4, False)
    # val_batches: 25 batches of batch_size 4 = the first 100 held-out examples
    assert (c.steps, c.lr, c.seq_len, c.eval_every, c.eval_sequences) == (1000, 1e-5, 2048, 200, 100)
    assert isinstance(c.lr, float)  # YAML 1.1 reads 1e-5 as a string; mlx-lm's loader as a number
    assert (c.fine_tune_type, c.num_layers, c.lora_rank, c.lora_scale, c.lora_dropout) == ("lora", 16, 8, 20.0, 0.0)
    assert c.lora_keys == "self_attn.q_proj,self_attn.v_proj"  # lora_parameters.keys, a list there
    assert c.weight_decay == TrainConfig().weight_decay and c.strategy_options == {}  # adamw: ours
    notes = capsys.readouterr().err.splitlines()
    ignored = [line.split(": ")[2].split()[0] for line in notes]  # 'note: PATH: KEY is ignored: how'
    assert ignored == ["steps_per_report", "adapter_path", "save_every", "test_batches"]
    assert "RUN/adapters/" in notes[1]  # adapter_path: where the adapters are written here


def test_a_users_yaml_runs_with_workers_added(tmp_path):
    """The command line: the YAML's keys, this project's beside them, and a flag over the file."""
    (tmp_path / "lora.yaml").write_text(
        "model: tiny\niters: 4\nlearning_rate: 3e-3\nbatch_size: 4\nmax_seq_length: 16\nval_batches: 2\n"
        "steps_per_report: 1\nworkers: 4\nsync_every: 2\n")
    out = run_cli("sim", "--config", tmp_path / "lora.yaml", "--workers", "2", "--run-dir", tmp_path / "r",
                  "--sample-tokens", "0")
    assert out.returncode == 0, out.stderr
    saved = json.loads((tmp_path / "r" / "config.json").read_text())
    assert (saved["workers"], saved["steps"], saved["lr"], saved["seq_len"], saved["sync_every"]) == (2, 4, 3e-3, 16, 2)
    assert f"note: {tmp_path / 'lora.yaml'}: steps_per_report is ignored" in out.stderr


def test_yml_suffix_empty_file_and_strategy_options(tmp_path):
    assert config_of(tmp_path, "# nothing yet\n", "c.yml") == TrainConfig()
    c = config_of(tmp_path, "strategy: diloco\nsync_every: 50\nworkers: 8\n", "c.yml")
    assert (c.workers, c.strategy_options) == (8, {"sync_every": 50})


def test_optimizer_adam_is_adamw_without_weight_decay(tmp_path):
    assert config_of(tmp_path, "optimizer: adam\n").weight_decay == 0.0
    c = config_of(tmp_path, "optimizer: adamw\noptimizer_config:\n  adamw:\n    betas: [0.9, 0.98]\n"
                            "    weight_decay: 0.05\n  sgd: {}\n")
    assert (c.beta1, c.beta2, c.weight_decay) == (0.9, 0.98, 0.05)


def test_loggers_pass_through(tmp_path):
    """report_to and project_name (issue 23, item 6) are ours too; null, mlx-lm's default, is none."""
    c = config_of(tmp_path, "report_to: wandb,swanlab\nproject_name: my-lora\n")
    assert (c.report_to, c.project_name, c.reporters()) == ("wandb,swanlab", "my-lora", ["wandb", "swanlab"])
    assert config_of(tmp_path, "report_to: null\nproject_name: null\n") == TrainConfig()


def test_mask_prompt_maps(tmp_path):
    """mask_prompt is issue 23's data option (item 1): kept under its name."""
    assert config_of(tmp_path, "mask_prompt: true\n").mask_prompt is True


@pytest.mark.parametrize("text, message", [
    ("optimizer: sgd\n", "optimizer 'sgd' is not supported: the inner optimizer here is AdamW"),
    ("optimizer: adamw\noptimizer_config:\n  adamw:\n    eps: 1e-6\n", "optimizer_config.adamw.eps is not supported"),
    ("resume_adapter_file: adapters/adapters.safetensors\n", "resume_adapter_file: 'adapters/adapters.safetensors': "
                                                               "starting from saved adapters is not supported"),
    ("hf_dataset:\n  path: billsum\n", "hf_dataset: {'path': 'billsum'}: Hugging Face datasets are not downloaded"),
    ("train: false\n", "this command trains: remove 'train: false'"),
    ("training_mode: dpo\n", "only normal (next-token) training here"),
    ("batch_size: 4\ngrad_accumulation_steps: 4\n", "multiply batch_size by it (16)"),
    ("val_batches: -1\n", "val_batches -1 (the whole validation set) is not supported here"),
    ("iters: 100\nsteps: 200\n", "iters and steps both set steps; keep one"),
    ("steps: 200\niters: 100\n", "steps and iters both set steps; keep one"),
    ("lora_parameters:\n  rank: 8\n  keys: self_attn.q_proj\n",
     "lora_parameters.keys must be a list of layer paths in a block, e.g. [self_attn.q_proj, self_attn.v_proj]"),
    ("report_to: tensorboard\n", "report-to: no logger 'tensorboard'; choose from wandb, swanlab"),
    ("lora_parameters: 8\n", "lora_parameters must hold rank, scale, dropout, keys"),
    ("iters: 1e3\n", "steps must be a whole number, not 1000.0"),  # this project's type check, on the new name
    ("- iters: 10\n", "must hold 'key: value' lines"),
])
def test_refusals_are_one_line(tmp_path, text, message):
    with pytest.raises(ConfigError) as e:
        config_of(tmp_path, text)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_yaml_names_the_file_and_line(tmp_path):
    (tmp_path / "lora.yaml").write_text("model: tiny\niters: 10\nlora_parameters: {rank: 8\nseed: 1\n")
    out = run_cli("sim", "--config", tmp_path / "lora.yaml", "--workers", "2")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert f"{tmp_path / 'lora.yaml'} is not valid YAML" in out.stderr and "at line 4" in out.stderr
