"""Where the weights a `--model` names live on this machine: an mlx-lm model folder (a local
directory), or a Hugging Face hub name (ORG/NAME, as `mlx_lm.load` takes it) found in this
machine's Hugging Face cache, which huggingface_hub places (HF_HOME, HF_HUB_CACHE). Presets and
`package.module:function` builders name no files. Each Mac resolves the name in its own cache, so
a run records the name as typed.

MLX-free: the agent answers the launcher's `has_model` with `local_folder`. Only `download` (the
training side, for a hub model not cached yet) imports mlx-lm.
"""

import sys
from pathlib import Path

from .options import ConfigError


def is_hub_name(model: str) -> bool:
    """ORG/NAME, a valid hub repo id, and no local path by that name (a folder wins, as in mlx-lm;
    NAME.json is a preset file)."""
    if model.count("/") != 1 or model.startswith((".", "~")) or model.endswith(".json") or Path(model).exists():
        return False
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id
    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


def names_files(model: str) -> bool:
    """Whether `model` is a model folder (here, or a path that must exist on each machine) or a hub
    name: weights each machine must hold. The launcher makes a folder's path absolute."""
    path = Path(model)
    return path.is_dir() or (path.is_absolute() and path.suffix != ".json") or is_hub_name(model)


# The model's config and weights (and its tokenizer's JSON): files that mlx-lm's download fetches (a
# subset of mlx_lm.utils.DEFAULT_ALLOW_PATTERNS), so a snapshot it downloaded counts as complete.
MODEL_FILES = ["*.json", "model*.safetensors"]


def holds_model(folder: Path) -> bool:
    """A config.json and weights: what mlx-lm loads a model from (a cached snapshot can hold only a
    tokenizer's files, which mlx-lm fetches alone)."""
    return (folder / "config.json").is_file() and any(folder.glob("model*.safetensors"))


def cached_folder(repo_id: str):
    """The hub model's snapshot in this machine's Hugging Face cache, or None: looked up on disk
    only (`local_files_only`), as `mlx_lm.utils.hf_repo_to_path` does."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    try:  # an incomplete snapshot (an interrupted download) raises LocalEntryNotFoundError's subclass too
        folder = Path(snapshot_download(repo_id, local_files_only=True, allow_patterns=MODEL_FILES))
    except LocalEntryNotFoundError:
        return None
    return folder if holds_model(folder) else None


def local_folder(model: str):
    """The folder holding `model` on this machine: a directory as it is, a hub name's cached
    snapshot; None when this machine lacks it (or `model` names no files)."""
    if Path(model).is_dir():
        return Path(model)
    return cached_folder(model) if is_hub_name(model) else None


def how_to_get(model: str) -> str:
    """What puts `model` on a machine that lacks it."""
    if is_hub_name(model):
        return f"download it first with `hf download {model}` (or `mlx_lm.generate --model {model}` once)"
    return f"copy the model folder to {model}"


def download(repo_id: str) -> Path:
    """A hub model missing from this machine's cache, downloaded as `mlx_lm.load` downloads it
    (mlx-lm's own download, its file patterns), said in one line first."""
    from huggingface_hub import constants
    from mlx_lm.utils import _download
    if constants.is_offline_mode():
        raise not_cached(repo_id, "and HF_HUB_OFFLINE is set")
    print(f"downloading {repo_id} from the Hugging Face hub into {constants.HF_HUB_CACHE}", file=sys.stderr, flush=True)
    try:
        return Path(_download(repo_id))
    except OSError as e:  # huggingface_hub's errors (not found, gated, no connection) are OSErrors
        raise not_cached(repo_id, f"and downloading it failed ({type(e).__name__}: {str(e).splitlines()[0]})") from None


def not_cached(repo_id: str, why: str) -> ConfigError:
    from huggingface_hub import constants
    return ConfigError(f"model '{repo_id}' is not in this machine's Hugging Face cache ({constants.HF_HUB_CACHE}) "
                       f"{why}; {how_to_get(repo_id)}, or pass an mlx-lm model folder")
