"""`--model ORG/NAME`, a Hugging Face hub name: found in this machine's Hugging Face cache as mlx-lm
finds it (huggingface_hub's own lookup, HF_HUB_CACHE and HF_HOME honoured), recorded as typed, and
refused in one line when it is not there. Every process here runs with HF_HUB_OFFLINE: nothing is
downloaded."""

import json
import os
import subprocess
import sys

from conftest import run_cli, tiny_llama_folder

REPO = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def hf_cache(cache):
    """A Hugging Face cache holding REPO as mlx-lm's download leaves it: refs/main names the commit
    whose snapshot folder holds the model's files, and the repo's file listing (huggingface_hub's
    tree cache) also names the README and .gitattributes, which mlx-lm's file patterns skip.
    Returns the snapshot folder."""
    from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache
    repo = cache / ("models--" + REPO.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    tiny_llama_folder(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    listing = [p.name for p in snapshot.iterdir()] + ["README.md", ".gitattributes"]
    write_tree_cache(str(repo), COMMIT, {name: TreeCacheEntry(size=1, blob_id="0" * 40) for name in listing})
    return snapshot


def resolved(model: str, env: dict) -> dict:
    """What mlx_diloco.hub makes of `model` in a fresh process with `env` (huggingface_hub reads
    its cache's place when imported)."""
    code = ("import json, sys\nfrom mlx_diloco import hub\nm = sys.argv[1]\n"
            "print(json.dumps({'hub': hub.is_hub_name(m), 'files': hub.names_files(m), "
            "'folder': str(hub.local_folder(m) or '')}))")
    out = subprocess.run([sys.executable, "-c", code, model], capture_output=True, text=True, timeout=60,
                         env={**os.environ, **OFFLINE, **env})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_hub_name_is_its_cached_snapshot_a_folder_itself_a_preset_neither(tmp_path):
    snapshot = hf_cache(tmp_path / "home" / "hub")
    for env in ({"HF_HUB_CACHE": str(tmp_path / "home" / "hub")}, {"HF_HOME": str(tmp_path / "home")}):
        assert resolved(REPO, env) == {"hub": True, "files": True, "folder": str(snapshot)}
        assert resolved("tiny-org/not-cached", env) == {"hub": True, "files": True, "folder": ""}
    env = {"HF_HUB_CACHE": str(tmp_path / "elsewhere")}  # another machine's cache: the name is not there
    assert resolved(REPO, env)["folder"] == ""
    assert resolved(str(snapshot), env) == {"hub": False, "files": True, "folder": str(snapshot)}
    assert resolved("/no/such/model", env) == {"hub": False, "files": True, "folder": ""}  # a path every Mac needs
    for name in ("tiny", "mypkg.models:build", "models/tiny.json"):
        assert resolved(name, env) == {"hub": False, "files": False, "folder": ""}


def test_a_cached_snapshot_without_weights_is_not_the_model(tmp_path):
    """mlx-lm fetches a tokenizer's files alone (load_tokenizer): such a snapshot holds no model,
    whether the repo's file listing says so or (a cache without listings) the folder does."""
    import shutil
    snapshot = hf_cache(tmp_path / "hub")
    (snapshot / "model.safetensors").unlink()
    assert resolved(REPO, {"HF_HUB_CACHE": str(tmp_path / "hub")})["folder"] == ""
    shutil.rmtree(snapshot.parents[1] / "trees")
    assert resolved(REPO, {"HF_HUB_CACHE": str(tmp_path / "hub")})["folder"] == ""


def sim(tmp_path, run_dir, model, *flags, env):
    (tmp_path / "text.txt").write_text("the user asks and the assistant answers the question\n" * 200)
    return run_cli("sim", "--model", model, "--data", tmp_path / "text.txt", "--seq-len", 16, "--batch-size", 2,
                   "--workers", 2, "--steps", 4, "--sync-every", 2, "--eval-sequences", 2, "--run-dir", run_dir,
                   *flags, env={**OFFLINE, **env})


def test_sim_trains_a_cached_hub_model_and_records_its_name(tmp_path):
    """The run trains the cached snapshot and records the name as typed (each Mac resolves it in its
    own cache); export, and mlx-lm's generate on the adapters with `--model ORG/NAME`, find it again."""
    hf_cache(tmp_path / "hub")
    env = {"HF_HUB_CACHE": str(tmp_path / "hub")}
    out = sim(tmp_path, tmp_path / "full", REPO, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "downloading" not in out.stderr
    assert json.loads((tmp_path / "full" / "config.json").read_text())["model"] == REPO
    out = run_cli("export", tmp_path / "full", tmp_path / "exported", env={**OFFLINE, **env})
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "exported" / "model.safetensors").is_file()

    out = sim(tmp_path, tmp_path / "lora", REPO, "--fine-tune-type", "lora", "--num-layers", 1, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    adapters = tmp_path / "lora" / "adapters"
    assert json.loads((adapters / "adapter_config.json").read_text())["model"] == REPO
    out = subprocess.run([sys.executable, "-m", "mlx_lm", "generate", "--model", REPO, "--adapter-path", str(adapters),
                          "--prompt", "the question", "--max-tokens", "2"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, **OFFLINE, **env})
    assert out.returncode == 0, out.stderr[-2000:]


def test_an_uncached_hub_name_offline_is_refused_in_one_line(tmp_path):
    out = sim(tmp_path, tmp_path / "run", "tiny-org/not-cached", env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert out.returncode == 2
    assert out.stderr.strip() == (
        f"mlx-diloco: error: model 'tiny-org/not-cached' is not in this machine's Hugging Face cache "
        f"({tmp_path / 'hub'}) and HF_HUB_OFFLINE is set; download it first with `hf download tiny-org/not-cached` "
        "(or `mlx_lm.generate --model tiny-org/not-cached` once), or pass an mlx-lm model folder")


def test_launch_refuses_a_hub_model_its_own_machine_lacks(tmp_path):
    """The launcher tokenizes the data and estimates memory with the model: it says so, rather than
    download it, before it asks any agent (the listed one does not exist)."""
    out = run_cli("launch", "--model", "tiny-org/not-cached", "--hosts", "127.0.0.1:9", "--workers", 1,
                  "--run-dir", tmp_path / "run", env={**OFFLINE, "HF_HUB_CACHE": str(tmp_path / "hub"),
                                                      "MLX_DILOCO_SECRET": "test-secret-0123456789abcdef"})
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "mlx-diloco: error: this machine (the launcher) lacks model tiny-org/not-cached, which it reads to tokenize "
        "the data and estimate memory; download it first with `hf download tiny-org/not-cached` (or "
        "`mlx_lm.generate --model tiny-org/not-cached` once) here too")
